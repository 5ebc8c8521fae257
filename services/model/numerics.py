"""Numerics modes of the model: `fast` (the default: each op as its kernel computes it) and `invariant`, in which
no bit of a token's hidden state depends on the batch it shares a step with, on how its prompt was chunked, or on
the layout (TP degree, PP stages, EP) serving it, so a live switch provably changes no token.

Invariant mode rests on these rules, each enforced in one place:
- GEMMs: on the CPU every product (linear layers, the router, the experts) runs through
  services/model/ordered_gemm.py, a kernel that adds each output element in one order fixed by its reduction
  length alone, whatever the other rows and columns, the thread count or the CPU: no BLAS keeps that promise on
  every CPU (MKL's float32 GEMM and oneDNN's AMX bfloat16 GEMM give a row other bits at other row counts, at any
  padding, on this project's Xeons). On a GPU a product's rows are padded to a multiple of `row_multiple`, the
  smallest of ROW_MULTIPLES under which `probe` finds the device's GEMMs invariant (`choose_row_multiple`, at a
  worker's start; the worker refuses the mode where none holds).
- TP reductions (`reduction_pieces`): a row-parallel layer's reduction dimension (and each expert's, in an MoE
  model: services/model/moe.py) is cut at every shard boundary of every TP degree the model allows on
  INVARIANT_WORKERS workers; each piece's partial product is computed on its own, the partials are gathered in
  rank order (which is piece order) and added in piece order in float32, on one worker as on many (there, on a
  CPU, inside the GEMM kernel).
- attention (`services/model/invariant_attention.py`): on the CPU every row alone over its visible keys, in the
  fixed order of services/model/attention_kernel.py; on a GPU keys in chunks of KEY_CHUNK positions counted from
  position 0, the row maximum (exact in any order), sums over fixed-size chunks, chunks folded in order; a chunk
  past a row's context adds exact zeros, so padding and batch composition change nothing.
- elementwise transcendental kernels (exp, sin, cos, silu) compute the tail of a tensor (or of a thread's part of
  it) that does not fill two vectors on a scalar path, with other roundings: in invariant mode they run through
  `whole_vectors`, which pads the flattened tensor so that every element takes the vector path, and a worker's
  thread count stays a power of two (`invariant_threads`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.contracts.numerics import MODES
from services.model.cpu_kernels import kind as ordered_gemm_kind
from services.model.ordered_gemm import ordered_linear, ordered_matmul, ordered_pieces, ordered_pieces_sum
from services.model.ordered_gemm import pack as pack_panels

LinearFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # F.linear(x, weight)
MatmulFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # torch.matmul(a, b)

ROW_MULTIPLES = (1, 4, 8)  # the row paddings invariant mode tries on a GPU, cheapest first (choose_row_multiple)
# A stack cuts its row-parallel reductions for every TP degree the model allows on this many workers (or its own
# world, if larger): stacks of up to this many workers then give the same bits, whatever their size and layout.
INVARIANT_WORKERS = 8
_VECTORS = 1024  # elements: two vectors of any dtype times up to 16 threads, for a tensor torch does not split
_GRAIN = 32768   # at::internal::GRAIN_SIZE: a larger tensor is cut into min(threads, ceil(numel / grain)) parts


@dataclass(frozen=True, slots=True)
class Numerics:
    """How a shard computes: the mode, and in invariant mode where its row-parallel reductions are cut."""

    mode: str = "fast"
    row_multiple: int = 1                      # a GEMM's rows are padded to a multiple of this (1: none)
    ordered_gemm: bool = False                 # products by ordered_gemm.ordered_matmul (invariant mode, CPU)
    head_bounds: tuple[int, ...] = ()          # query-head boundaries of o_proj's pieces (invariant mode)
    intermediate_bounds: tuple[int, ...] = ()  # intermediate boundaries of down_proj's pieces (invariant mode)
    expert_bounds: tuple[int, ...] = ()        # an expert's intermediate boundaries of its down pieces (MoE)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"numerics must be one of {', '.join(MODES)}, not {self.mode!r}")

    @property
    def is_invariant(self) -> bool:
        return self.mode == "invariant"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, panels: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, in] x weight [out, in] -> [N, out] in x's dtype, by this mode's GEMM rule. panels: the weight
        packed for the ordered GEMM (ordered_gemm.pack), where it was (`weight` then gives only the shape)."""
        if self.ordered_gemm:
            out = ordered_matmul(x, weight) if panels is None else ordered_linear(x, panels, weight.shape[0])
            return out.to(x.dtype)
        return padded_linear(x, weight, self.row_multiple)

    def linear_pieces(self, x: torch.Tensor, weight: torch.Tensor, pieces: Sequence[range],
                      panels: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, in] x weight [out, in], each piece (adjacent ranges of `in`) apart -> [N, len(pieces) * out], piece
        p's partial product in columns [p * out, (p + 1) * out): a row-parallel layer's partials, for ordered_sum
        after a gather. float32 from the ordered GEMM (the sum `reduced_pieces` computes in one call), else in x's
        dtype. panels: as for `linear` (packed here when not given)."""
        if self.ordered_gemm:
            return ordered_pieces(x, pack_panels(weight) if panels is None else panels, weight.shape[0], tuple(pieces))
        return torch.cat([padded_linear(x[:, p.start:p.stop], weight[:, p.start:p.stop], self.row_multiple)
                          for p in pieces], dim=-1)

    def reduced_pieces(self, x: torch.Tensor, weight: torch.Tensor, pieces: Sequence[range],
                       panels: torch.Tensor | None = None) -> torch.Tensor:
        """ordered_sum(linear_pieces(...)) in x's dtype, bitwise: a row-parallel layer on one rank."""
        if self.ordered_gemm:
            panels = pack_panels(weight) if panels is None else panels
            return ordered_pieces_sum(x, panels, weight.shape[0], tuple(pieces)).to(x.dtype)
        return ordered_sum(self.linear_pieces(x, weight, pieces, panels), len(pieces), x.dtype)

    @property
    def gemm(self) -> str:
        """What computes the products, in words (the worker.ready log line)."""
        if self.ordered_gemm:
            return f"ordered ({ordered_gemm_kind()})"
        return f"blas, rows padded to {self.row_multiple}" if self.row_multiple > 1 else "blas"


FAST = Numerics()


def slice_bounds(total: int, tp_sizes: Iterable[int]) -> tuple[int, ...]:
    """Every shard boundary of `total` units (heads, intermediate columns) cut evenly for each TP degree, sorted,
    0 and `total` included (the placement's _slice: rank r holds [r * total // tp, (r + 1) * total // tp))."""
    bounds = {0, total}
    for tp in tp_sizes:
        per_rank = total // tp
        bounds.update(r * per_rank for r in range(tp + 1))
    return tuple(sorted(bounds))


def reduction_pieces(bounds: Sequence[int], held: range, unit: int = 1) -> tuple[range, ...]:
    """The pieces of a shard holding units `held` (a range between two bounds), as ranges of its local reduction
    dimension (unit: elements per unit, e.g. head_dim for heads)."""
    inside = [b for b in bounds if held.start <= b <= held.stop]
    if not inside or inside[0] != held.start or inside[-1] != held.stop:
        raise ValueError(f"shard {held} does not start and end on a boundary of {tuple(bounds)}")
    return tuple(range((a - held.start) * unit, (b - held.start) * unit) for a, b in zip(inside, inside[1:]))


def invariant_numerics(num_heads: int, intermediate_size: int, tp_sizes: Iterable[int],
                       row_multiple: int | None = None, moe_intermediate_size: int = 0) -> Numerics:
    """Invariant numerics for a model whose TP layouts use the degrees `tp_sizes` (an EP layout holds its
    experts whole and cuts them at the same bounds). row_multiple: None for the ordered GEMM (the CPU's), else the
    BLAS rows rule's multiple (a GPU's: choose_row_multiple)."""
    tp_sizes = tuple(tp_sizes)
    return Numerics("invariant", row_multiple or 1, row_multiple is None, slice_bounds(num_heads, tp_sizes),
                    slice_bounds(intermediate_size, tp_sizes),
                    slice_bounds(moe_intermediate_size, tp_sizes) if moe_intermediate_size else ())


def pad_rows(x: torch.Tensor, row_multiple: int) -> torch.Tensor:
    """x [N, ...] with zero rows appended up to a multiple of row_multiple (the GEMM rows rule); x itself when N is
    one already."""
    return F.pad(x, (0, 0, 0, -x.shape[0] % row_multiple)) if x.shape[0] % row_multiple else x


def padded_linear(x: torch.Tensor, weight: torch.Tensor, row_multiple: int) -> torch.Tensor:
    """F.linear(x, weight) with x's rows padded to a multiple of row_multiple."""
    return F.linear(pad_rows(x, row_multiple), weight)[: x.shape[0]]


def choose_row_multiple(device: torch.device, dtype: torch.dtype, linear: LinearFn = F.linear,
                        matmul: MatmulFn = torch.matmul) -> int:
    """The smallest of ROW_MULTIPLES under which probe() finds this device's GEMMs invariant; RuntimeError saying
    what failed when none is."""
    for row_multiple in ROW_MULTIPLES:
        failures = probe(device, dtype, row_multiple, linear=linear, matmul=matmul)
        if not failures:
            return row_multiple
    raise RuntimeError(f"invariant numerics cannot hold on {device} in {dtype}: even with rows padded to a multiple "
                       f"of {row_multiple}, " + "; ".join(failures[:3]))


def ordered_sum(partials: torch.Tensor, num_pieces: int, dtype: torch.dtype) -> torch.Tensor:
    """partials [N, num_pieces * out] (piece p in columns [p * out, (p + 1) * out)) -> [N, out] in `dtype`: the
    pieces added in float32, one after the other in piece order."""
    rows = partials.shape[0]
    pieces = partials.view(rows, num_pieces, partials.shape[1] // num_pieces)
    total = pieces[:, 0].to(torch.float32, copy=True)  # [N, out]
    for p in range(1, num_pieces):
        total += pieces[:, p]
    return total.to(dtype)


def whole_vectors(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn (elementwise) of x with every element on the kernel's vector path: x flattened and padded with zeros to a
    whole number of grains (or of _VECTORS when it fits in one), so that no part ends in a scalar tail."""
    numel = x.numel()
    multiple = _VECTORS if numel <= _GRAIN else _GRAIN
    flat = F.pad(x.reshape(-1), (0, -numel % multiple))
    return fn(flat)[:numel].view(x.shape)


def invariant_threads(num_threads: int) -> int:
    """The largest power of two <= num_threads (>= 1): torch's elementwise kernels cut a tensor between threads at
    numel / threads, and only a power-of-two cut keeps every piece a whole number of vectors."""
    return 1 << (max(1, num_threads).bit_length() - 1)


def _order_revealing_rows(num_rows: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """[num_rows, k] rows whose dot product with a column of ones depends on the order the GEMM adds in: each row
    holds 2^24, 1 + 2^-7 and -2^24, twice, at random positions (zeros elsewhere). Adding the big terms first gives
    1 + 2^-7 exactly; adding 1 + 2^-7 to 2^24 first loses it to float32 rounding. Random data rarely shows an order
    difference through a bf16 output's rounding; these rows show every one that reorders their three terms."""
    rows = torch.zeros(num_rows, k)
    terms = torch.tensor([2.0 ** 24, 1 + 2.0 ** -7, -(2.0 ** 24)] * 2)  # two such triples a row
    for row in rows:
        row[torch.randperm(k, generator=generator)[:6]] = terms
    return rows


def probe(device: torch.device, dtype: torch.dtype, row_multiple: int, seed: int = 0, linear: LinearFn = F.linear,
          matmul: MatmulFn = torch.matmul) -> list[str]:
    """What of invariant mode's GEMM rule fails on this device and dtype (empty: it holds): with rows padded to a
    multiple of row_multiple, every row's product must be bitwise the same at every row count and at every
    position in the batch (tails included), at any column count, and in a batched product whatever the batch.
    Random rows and order-revealing ones (_order_revealing_rows). Cheap (tens of ms); run where the mode is
    chosen. linear and matmul: the products probed (F.linear's and torch.matmul's signatures)."""
    generator = torch.Generator().manual_seed(seed)
    failures = []
    for k, n in ((64, 64), (128, 96), (320, 192), (1024, 80)):
        ones = torch.ones(n // 2, k)
        weight = torch.cat([ones, torch.randn(n - n // 2, k, generator=generator)]).to(device=device, dtype=dtype)
        x = torch.stack([row for pair in zip(_order_revealing_rows(165, k, generator),
                                             torch.randn(165, k, generator=generator)) for row in pair])
        x = x.to(device=device, dtype=dtype)  # order-revealing and random rows alternate
        whole = linear(x[:-(330 % row_multiple) or None], weight)  # every row of x, in one product
        for rows in sorted({-(-r // row_multiple) * row_multiple for r in (1, 2, 3, 5, 11, 17, 64, 257, 300)}):
            for start in (0, 1, 9, 327 - rows):  # the same rows, a product of `rows` rows starting at `start`
                if start >= 0 and start + rows <= whole.shape[0] and not torch.equal(
                        linear(x[start: start + rows], weight), whole[start: start + rows]):
                    failures.append(f"linear [{rows}, {k}] x [{k}, {n}] from row {start}: a row's product depends "
                                    "on the row count or its position")
        if not torch.equal(linear(x[:64], weight[n // 4:]), linear(x[:64], weight)[:, n // 4:]):
            failures.append(f"linear [{k}, {n}]: a column's product depends on the column count")
    a = torch.cat([_order_revealing_rows(12 * row_multiple, 64, generator).view(12, row_multiple, 64)[:, :, None],
                   torch.randn(12, row_multiple, 1, 64, generator=generator)], dim=2).view(12, 2 * row_multiple, 64)
    a = a.to(device=device, dtype=dtype)
    b = torch.cat([torch.ones(12, 64, 64), torch.randn(12, 64, 64, generator=generator)], dim=2)
    b = b.to(device=device, dtype=dtype)
    whole = matmul(a, b)
    if not (torch.equal(matmul(a[:1], b[:1]), whole[:1]) and torch.equal(matmul(a[3:7], b[3:7]),
                                                                                 whole[3:7])):
        failures.append("batched matmul: a matrix's product depends on the batch")
    if not torch.equal(matmul(a[:4], b[:4, :, 32:]), whole[:4, :, 32:]):
        failures.append("batched matmul: a column's product depends on the column count")
    return failures
