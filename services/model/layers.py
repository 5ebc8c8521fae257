"""Building blocks of the sharded model: TP group, shard loader, norms, rotary embedding, parallel layers."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import torch
import torch.nn.functional as F

from services.model.numerics import FAST, Numerics, ordered_sum, whole_vectors
from services.model.ordered_gemm import pack as pack_panels
from services.model.spec import RopeSpec


class TPGroup(Protocol):
    """Collectives over the tensor-parallel group of one pipeline stage."""

    size: int
    rank: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place; returns the tensor."""
        ...

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's tensor along the last dimension, in rank order."""
        ...

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                   input_splits: list[int]) -> torch.Tensor:
        """Rows input[sum(input_splits[:p]) : ... + input_splits[p]] go to rank p; output receives, in rank order,
        output_splits[p] rows from each rank p (dim 0). Returns output (filled in place)."""
        ...


class SingleRankGroup:
    """A TP group of one: collectives are identities."""

    size = 1
    rank = 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                   input_splits: list[int]) -> torch.Tensor:
        return output.copy_(input)


class ShardLoader:
    """Copies slices of full checkpoint tensors (e.g. zero-copy views of shared memory) into owned tensors."""

    def __init__(self, source: Callable[[str], torch.Tensor], names: set[str], dtype: torch.dtype,
                 device: torch.device, piece: Callable[[], AbstractContextManager] = nullcontext) -> None:
        self._source = source
        self._names = names
        self.dtype = dtype
        self.device = device
        self._piece = piece  # wraps each copy (a staging build paces itself by them)

    def has(self, name: str) -> bool:
        return name in self._names

    def full(self, name: str) -> torch.Tensor:
        return self._own(self._source(name))

    def rows(self, name: str, rows: range) -> torch.Tensor:
        """Rows `rows` of a 1-D or 2-D tensor; rows past its end are zeros (padded vocabulary)."""
        full = self._source(name)
        real = full[rows.start:min(rows.stop, full.shape[0])]
        if len(real) == len(rows):
            return self._own(real)
        out = torch.zeros((len(rows), *full.shape[1:]), dtype=self.dtype, device=self.device)
        out[: len(real)] = real.to(self.dtype)
        return out

    def cols(self, name: str, cols: range) -> torch.Tensor:
        return self._own(self._source(name)[:, cols.start:cols.stop])

    def _own(self, view: torch.Tensor) -> torch.Tensor:
        # .to() with copy=True: never keep a view of the (shared) source alive.
        with self._piece():
            return view.to(device=self.device, dtype=self.dtype, copy=True).contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, returned in x's dtype (as Hugging Face Llama does)."""
    if x.dtype == weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused kernel, bitwise equal to the lines below
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RotaryEmbedding:
    """Rotary position embedding (non-interleaved halves), with `linear` and `llama3` frequency scaling."""

    def __init__(self, rope: RopeSpec, head_dim: int, device: torch.device, whole_vectors: bool = False) -> None:
        """whole_vectors: sin and cos on the vector path for every position (invariant numerics)."""
        self.whole_vectors = whole_vectors
        inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        if rope.rope_type == "linear":
            inv_freq = inv_freq / rope.factor
        elif rope.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope)
        self.inv_freq = inv_freq.float().to(device)  # [D/2]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, D] for int positions [T]; sin's first half negated (see apply_rotary)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = whole_vectors(torch.sin, emb) if self.whole_vectors else emb.sin()
        cos = whole_vectors(torch.cos, emb) if self.whole_vectors else emb.cos()
        sin[:, : freqs.shape[1]].neg_()
        return cos.to(dtype), sin.to(dtype)


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short kept, a smooth blend between."""
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D] from cos_sin. Hugging Face's x * cos + rotate_half(x) * sin, with
    rotate_half's negation moved into sin (exact: only signs change)."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + swapped * sin[:, None, :]


_PACK_ROWS = 32  # rows of x MKL is told to expect when packing; the layout serves any count (test_linear.py)


def _mkl_packed(weight: torch.Tensor) -> torch.Tensor | None:
    """MKL's packed copy of a float32 CPU weight for its GEMM; None where that path does not exist. Packed with a
    thread per usable core: MKL computes with at most the threads that packed, and a worker's count changes with
    the layout (services/worker/threads.py)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkl.is_available():
        return None
    num_threads = torch.get_num_threads()  # of this thread
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    try:
        return torch.ops.mkl._mkl_reorder_linear_weight(weight, _PACK_ROWS)
    finally:
        torch.set_num_threads(num_threads)


class Linear:
    """y = x W^T + b. Once pack() ran (CPU, float32), W lives in MKL's packed GEMM layout instead: F.linear packs W
    again on every call, most of its cost when x has few rows (decode); packed, a decode step at batch 32 takes ~20%
    less time. MKL computes a packed W at full speed only on the thread that packed it, or once that thread has
    ended: pack on the model thread, or on a thread that ends (services.worker.staging.pack_on_own_thread)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, keep_weight: bool = False,
                 numerics: Numerics = FAST) -> None:
        """keep_weight: W is held elsewhere too (a tied lm_head shares the embedding), so dropping it frees nothing.
        numerics: invariant mode's products take its GEMM rule (services/model/numerics.py)."""
        if weight.stride(0) == 0:
            raise ValueError("a packed Linear's placeholder is not a weight: reuse the Linear itself")
        self.weight = weight  # [out, in]
        self.bias = bias      # [out] or None
        self.keep_weight = keep_weight
        self.numerics = numerics
        self.packed: torch.Tensor | None = None
        self.panels: torch.Tensor | None = None  # W packed for the ordered GEMM (invariant numerics on a CPU)
        if numerics.ordered_gemm:
            self.panels = pack_panels(weight)
            if not keep_weight:
                self.weight = weight.new_zeros(()).expand(weight.shape)

    def pack(self) -> None:
        """Move W into MKL's packed layout (where it exists; idempotent). The dense W is dropped: a zero-stride
        placeholder keeps its shape and dtype (what the packed GEMM checks, and what parameter accounting counts)."""
        if self.packed is None and (packed := _mkl_packed(self.weight)) is not None:
            self.packed = packed
            if not self.keep_weight:
                self.weight = self.weight.new_zeros(()).expand(self.weight.shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in] -> [N, out]."""
        if self.numerics.is_invariant:
            y = self.numerics.linear(x, self.weight, self.panels)
            return y + self.bias if self.bias is not None else y
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, x.shape[0])


class RowParallelLinear:
    """y = x W^T with W split by input columns across TP ranks: partial sums all-reduced, bias added once after.

    With `pieces` (invariant numerics) the local input columns are cut into those ranges: each piece's partial
    product is computed alone, every rank's partials are gathered in rank order and added in piece order in float32
    (numerics.ordered_sum), so the sum is bitwise the same on one rank as on several."""

    def __init__(self, linear: Linear, bias: torch.Tensor | None, group: TPGroup,
                 pieces: tuple[range, ...] | None = None) -> None:
        self.linear = linear  # x [N, in_local] -> partial sums [N, out]
        self.bias = bias      # [out] (full; added after the reduction, so once)
        self.group = group
        self.pieces = pieces  # ranges of in_local (invariant numerics), or None: one product, all-reduced

    def regrouped(self, group: TPGroup) -> RowParallelLinear:
        """The same weights reducing over another TP group."""
        return RowParallelLinear(self.linear, self.bias, group, self.pieces)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        numerics, weight, panels = self.linear.numerics, self.linear.weight, self.linear.panels
        if self.pieces is None:
            y = self.group.all_reduce(self.linear(x))
        elif self.group.size == 1:  # the same sum, bitwise, without the partials (one kernel call on a CPU)
            y = numerics.reduced_pieces(x, weight, self.pieces, panels)
        else:
            partials = numerics.linear_pieces(x, weight, self.pieces, panels)  # [N, pieces_local * out]
            gathered = self.group.all_gather_last_dim(partials)  # [N, pieces_total * out], in piece order
            y = ordered_sum(gathered, len(self.pieces) * self.group.size, x.dtype)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding:
    """Embedding with rows split by vocabulary across TP ranks; out-of-range ids contribute zeros, then all-reduce."""

    def __init__(self, weight: torch.Tensor, rows: range, group: TPGroup) -> None:
        self.weight = weight  # [rows_local, hidden]
        self.rows = rows
        self.group = group

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        local = token_ids - self.rows.start
        mask = (local >= 0) & (local < len(self.rows))
        out = F.embedding(local.clamp(0, len(self.rows) - 1), self.weight)
        out = out * mask[:, None].to(out.dtype)
        return self.group.all_reduce(out)


class ParallelLMHead:
    """lm_head with rows split by vocabulary: local logits, all-gathered, padding trimmed."""

    def __init__(self, linear: Linear, vocab_size: int, group: TPGroup) -> None:
        self.linear = linear  # hidden -> this rank's vocabulary rows [N, rows_local]
        self.vocab_size = vocab_size
        self.group = group

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.group.all_gather_last_dim(self.linear(hidden))  # [N, padded_vocab]
        return logits[:, : self.vocab_size]
