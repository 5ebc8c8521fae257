"""A GEMM whose every output element is added in one order fixed by its reduction length alone: invariant
numerics' products on the CPU (services/model/numerics.py).

A BLAS picks its kernel, its blocking of the reduction and its split between threads by the shape of the whole
product and by the CPU it runs on: MKL's float32 GEMM on one Xeon gives a row other bits in a product of 8 rows
than in one of 328 (at any padding), and with AVX2 kernels other bits at another position in a product of one
fixed shape; oneDNN's AMX bfloat16 GEMM likewise. No padding rule holds on every CPU, so invariant mode does not
ask a BLAS: `ordered_matmul` computes out[..., m, n] = sum_k a[..., m, k] * b[..., n, k] as

    acc = 0; for k = 0, 1, ..., K - 1: acc = fmaf(a[m, k], b[n, k], acc)
    (C's fmaf: one rounding, exactly specified, so every CPU computes the same bits)

whatever the other rows and columns, the row's position, the thread count, the vector width or the CPU; with
reduction pieces (a row-parallel layer's), one such chain a piece and the pieces' sums added in piece order. The
kernel (gemm_kernel.py, compiled by cpu_kernels.py) vectorises across the output columns: 8 x 32 tiles over a
weight packed once into 32-column panels (`pack`, `ordered_linear`), on AVX-512 where the CPU has it and in the
portable C of the same order elsewhere: both give the same bits (tests/model/test_numerics.py builds both). Each
operand float32 or bfloat16 (a bf16 product is exact in float32), float32 out, any strides (b read in place where
its columns are adjacent), two batch dimensions. About MKL's float32 rate; bfloat16 about a third of oneDNN's AMX
kernel (bench/numerics.py measures the mode's cost).
"""

from __future__ import annotations

import array
import functools

import torch

from services.model.cpu_kernels import library
from services.model.gemm_kernel import PANEL


def ordered_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] x b [..., N, K] -> [..., M, N] float32 (b's rows, not its columns, as in F.linear), every
    element reduced in the fixed order of the module's docstring. CPU tensors, each float32 or bfloat16 (a
    bfloat16 operand is exact in float32: mixing them is the float32 product of the values); the leading
    dimensions of a and b equal (b may have none: one weight for every batch). Any strides: b is read in place
    where its N elements are adjacent (a transposed view, as `values.transpose(-1, -2)`), else copied so; a weight
    used at every step is best packed once (`pack`, `ordered_linear`)."""
    _check(a, b)
    shape, k = a.shape, a.shape[-1]
    if b.dim() == 2:  # one weight: every row of a is a row of one product
        if b.shape[1] != k:
            raise ValueError(f"ordered_matmul: shapes {tuple(a.shape)} and {tuple(b.shape)} do not match")
        out = torch.empty((*shape[:-1], b.shape[0]), dtype=torch.float32)
        if out.numel():
            _plain(a.reshape(-1, k)[None, None], b[None, None], out.view(1, 1, -1, b.shape[0]))
        return out
    if b.shape[:-2] != shape[:-2] or b.shape[-1] != k:
        raise ValueError(f"ordered_matmul: shapes {tuple(a.shape)} and {tuple(b.shape)} do not match")
    out = torch.empty((*shape[:-1], b.shape[-2]), dtype=torch.float32)
    if out.numel():
        _plain(_four(a), _four(b), _four(out))
    return out


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (F.linear's) -> its panels [ceil(N / PANEL), K, PANEL] (zero columns past N), the layout
    ordered_linear reads: a tile's columns of one row of b in one line of cache, a panel's rows one after another."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = torch.nn.functional.pad(weight, (0, 0, 0, panels * PANEL - n))
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def ordered_linear(x: torch.Tensor, panels: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] x a packed weight (pack: [N, K] -> panels) -> [M, N] float32, the bits ordered_matmul(x, weight)
    gives. Called for every product of a step: a few microseconds of Python around the kernel."""
    x = _rows(x, panels)
    m, k = x.shape
    out = torch.empty((m, n), dtype=torch.float32)
    if m and n:
        _gemm(x, panels, out, 1, 1, m, n, k, (0, 0, x.stride(0), 0, 0, PANEL, k * PANEL, 0, 0, n))
    return out


def ordered_pieces(x: torch.Tensor, panels: torch.Tensor, n: int, pieces: tuple[range, ...]) -> torch.Tensor:
    """x [M, K] x a packed weight [N, K], each piece of the reduction (adjacent ranges of K) apart ->
    [M, len(pieces) * N] float32: piece p's partial product in columns [p * N, (p + 1) * N), each the bits
    ordered_matmul(x[:, p], weight[:, p]) gives; one call per run of pieces of one width."""
    x = _rows(x, panels)
    m, k = x.shape
    width = len(pieces) * n
    out = torch.empty((m, width), dtype=torch.float32)
    if not out.numel():
        return out
    first = 0
    while first < len(pieces):
        start, size = pieces[first].start, len(pieces[first])
        last = first + 1
        while last < len(pieces) and len(pieces[last]) == size and pieces[last].start == pieces[last - 1].stop:
            last += 1
        # piece first + i: x's columns and every panel's rows from start + i * size, out's columns from
        # (first + i) * n
        _gemm(x[:, start:], panels[:, start:], out[:, first * n:], 1, last - first, m, n, size,
              (0, size, x.stride(0), 0, size * PANEL, PANEL, k * PANEL, 0, n, width))
        first = last
    return out


def ordered_pieces_sum(x: torch.Tensor, panels: torch.Tensor, n: int, pieces: tuple[range, ...]) -> torch.Tensor:
    """The pieces' partial products (ordered_pieces) added in piece order in float32, ((p0 + p1) + p2) + ...:
    [M, N] float32, the bits numerics.ordered_sum of ordered_pieces gives; one call where the pieces are of one
    width (the last may be narrower), the sums added inside the kernel."""
    size = len(pieces[0])
    if _one_width(pieces):
        x = _rows(x, panels)
        m, k = x.shape
        out = torch.empty((m, n), dtype=torch.float32)
        if out.numel():
            start = pieces[0].start
            _gemm(x[:, start:], panels[:, start:], out, 1, 1, m, n, pieces[-1].stop - start,
                  (0, 0, x.stride(0), 0, 0, PANEL, k * PANEL, 0, 0, n), piece=size)
        return out
    parts = ordered_pieces(x, panels, n, pieces).view(x.shape[0], len(pieces), n)
    out = parts[:, 0].clone()
    for p in range(1, len(pieces)):
        out += parts[:, p]
    return out


_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _one_width(pieces: tuple[range, ...]) -> bool:
    """Adjacent pieces of one width, the last possibly narrower: one kernel call sums them (a layer's pieces are
    the same every step: asked once)."""
    size = len(pieces[0])
    return all(len(p) == size for p in pieces[:-1]) and len(pieces[-1]) <= size and all(
        p.start == q.stop for q, p in zip(pieces, pieces[1:]))


def _check(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype not in _DTYPES or b.dtype not in _DTYPES:
        raise TypeError(f"ordered_matmul takes float32 or bfloat16 tensors, not {a.dtype} and {b.dtype}")
    if not (a.is_cpu and b.is_cpu):
        raise ValueError("ordered_matmul runs on the CPU")


def _rows(x: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the kernel reads a: float32, each row's elements adjacent."""
    _check(x, panels)
    if x.dim() != 2 or x.shape[1] != panels.shape[1]:
        raise ValueError(f"ordered_linear: x {tuple(x.shape)} does not match panels {tuple(panels.shape)}")
    if x.dtype is not torch.float32:
        return x.float()  # the kernel broadcasts a's elements as float32 (exact)
    return x if x.stride(1) == 1 or x.shape[1] <= 1 else x.contiguous()


def _four(t: torch.Tensor) -> torch.Tensor:
    """t [..., rows, cols] as 4 dimensions [G1, G2, rows, cols] (leading ones merged where they can be viewed so,
    else copied)."""
    if t.dim() == 4:
        return t
    if t.dim() < 4:
        return t[(None,) * (4 - t.dim())]
    return t.reshape(-1, *t.shape[-2:])[None]


def _plain(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out = a b^T for each of [G1, G2]: a [G1, G2, M, K], b [G1, G2, N, K] (a stride 0 repeats one), out
    [G1, G2, M, N] float32."""
    if a.dtype is not torch.float32:
        a = a.float()  # the kernel broadcasts a's elements as float32 (exact)
    elif a.shape[-1] > 1 and a.stride(-1) != 1:
        a = a.contiguous()
    bt = b.transpose(-1, -2)  # [G1, G2, K, N]: the kernel's b, its N elements adjacent
    if bt.shape[-1] > 1 and bt.stride(-1) != 1:
        bt = bt.contiguous()
    _gemm(a, bt, out, *out.shape, a.shape[-1], (*a.stride()[:3], *bt.stride()[:3], PANEL, *out.stride()[:3]))


def _gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, g1: int, g2: int, m: int, n: int, k: int,
          strides: tuple[int, ...], piece: int = 0) -> None:
    """The kernel: out [G1, G2, M, N] = a [G1, G2, M, K] (float32, rows of adjacent elements) x b, whose element
    (g1, g2, k, n) is at g1 * s0 + g2 * s1 + k * s2 + (n // PANEL) * s3 + n % PANEL; strides: a's (g1, g2, row),
    b's (s0, s1, s2, s3), out's (g1, g2, row), in elements from each tensor's first. piece > 0: the reduction in
    pieces of that many k's, each a chain of its own, their sums added in order (float32)."""
    # an array.array, not a ctypes one: ~1 us to build instead of ~5, at every product of every step
    params = array.array("q", (g1, g2, m, n, k, b.dtype is torch.bfloat16, torch.get_num_threads(), *strides, piece))
    library().ordered_gemm(a.data_ptr(), b.data_ptr(), out.data_ptr(), params.buffer_info()[0])
