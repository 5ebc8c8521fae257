"""A GEMM whose every output element is added in one order fixed by its reduction length alone: invariant
numerics' products on the CPU (services/model/numerics.py).

A BLAS picks its kernel, its blocking of the reduction and its split between threads by the shape of the whole
product and by the CPU it runs on: MKL's float32 GEMM on one Xeon gives a row other bits in a product of 8 rows
than in one of 328 (at any padding), and with AVX2 kernels other bits at another position in a product of one
fixed shape; oneDNN's AMX bfloat16 GEMM likewise. No padding rule holds on every CPU, so invariant mode does not
ask a BLAS: `ordered_matmul` computes out[..., m, n] = sum_k a[..., m, k] * b[..., n, k] as

    lane l (0..15) adds a[k] * b[k] for k = l, l + 16, l + 32, ... in order, each a fused multiply-add (one
    rounding: C's fmaf, exactly specified, so every CPU computes the same bits)
    the 16 lanes are folded as a fixed tree: ((l0 + l1) + (l2 + l3)) + ... in float32,

whatever the other rows and columns, the row's position, the thread count, the vector width or the CPU. The
kernel is C, compiled on first use with the system's C compiler (`cc`, or $CC) into a per-CPU cache (beside the
models) and called through ctypes; each operand float32 or bfloat16 (a bf16 product is exact in float32), float32
out, any strides but along the reduction, and two batch dimensions (the attention's (head, sequence) products read
the gathered keys in place); a row-parallel layer's reduction pieces are one call (`ordered_pieces`).
Where the CPU has AVX-512 (F, BW, VL) a lane is one of a register's 16 (4 x 4 elements of the product per tile, b's
rows kept in cache across the row tiles); elsewhere the portable C of the same order, which the compiler vectorises
as it can: both give the same bits (tests/model/test_numerics.py builds both and compares). Slower than MKL or
oneDNN, which pick faster orders per shape (bench/numerics.py measures the mode's cost).
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from services.model import attention_kernel
from services.model.cache import default_cache_dir

PANEL = 32  # columns of b per panel (the C's NR)

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define VECTOR 1
#endif

#define MR 8   /* rows of a tile */
#define NR 32  /* columns of a tile: a panel of b */

/* A tile: out[i, j] = sum over k of a[i, k] * b(k, j) for i < R, j < nr (<= NR): each piece of `step` k's (the
   last may be shorter) a chain of fused multiply-adds in k order from 0, the pieces' sums added in piece order
   (float32). a: float32, row stride lda; b(k, j) at b[k * ldb + j] (float32 or bfloat16); out: row stride ldo. */
#ifdef VECTOR
static inline __mmask16 first(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }
/* float32 b: columns [0, 16) and [16, 32) of the tile. */
#define MASKS_F32(nr) const __mmask16 mlo = first(nr), mhi = first((nr) - 16);
#define LOAD_F32(b, i, lo, hi) {                                                                      \
    lo = _mm512_maskz_loadu_ps(mlo, (const float *)(b) + (i));                                        \
    hi = _mm512_maskz_loadu_ps(mhi, (const float *)(b) + (i) + 16); }
#define NATURAL_F32(lo, hi, v0, v1) { v0 = lo; v1 = hi; }
/* bfloat16 b: 32 columns in one load; the even columns (each 32-bit lane's low half) and the odd ones. */
#define MASKS_BF16(nr)                                                                                \
    const __mmask16 mlo = first(nr), mhi = first((nr) - 16);                                          \
    const __mmask32 mall = (nr) >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (nr)) - 1);      \
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);                                         \
    const __m512i first_half = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);   \
    const __m512i second_half = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
#define LOAD_BF16(b, i, lo, hi) {                                                                     \
    __m512i x = _mm512_maskz_loadu_epi16(mall, (const uint16_t *)(b) + (i));                          \
    lo = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));                                               \
    hi = _mm512_castsi512_ps(_mm512_and_si512(x, high)); }
#define NATURAL_BF16(lo, hi, v0, v1) {                                                                \
    v0 = _mm512_permutex2var_ps(lo, first_half, hi);                                                  \
    v1 = _mm512_permutex2var_ps(lo, second_half, hi); }
/* A row of the tile into out (its columns in order), or added to what a previous piece left there. */
#define STORE(T, o, lo, hi, add) {                                                                    \
    __m512 v0, v1;                                                                                    \
    NATURAL_##T(lo, hi, v0, v1)                                                                       \
    if (add) {                                                                                        \
        v0 = _mm512_add_ps(_mm512_maskz_loadu_ps(mlo, o), v0);                                        \
        v1 = _mm512_add_ps(_mm512_maskz_loadu_ps(mhi, (o) + 16), v1);                                 \
    }                                                                                                 \
    _mm512_mask_storeu_ps(o, mlo, v0);                                                                \
    _mm512_mask_storeu_ps((o) + 16, mhi, v1); }
#define KERNEL(NAME, R, T)                                                                            \
static void NAME(const float *a, int64_t lda, const void *b, int64_t ldb, float *out, int64_t ldo,    \
                 int64_t K, int64_t step, int64_t nr) {                                               \
    MASKS_##T(nr)                                                                                     \
    for (int64_t k0 = 0; k0 == 0 || k0 < K; k0 += step) {                                             \
        const int64_t k1 = k0 + step < K ? k0 + step : K;                                             \
        __m512 lo[R], hi[R], blo, bhi;                                                                \
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) lo[i] = hi[i] = _mm512_setzero_ps();      \
        for (int64_t k = k0; k < k1; k++) {                                                           \
            LOAD_##T(b, k * ldb, blo, bhi)                                                            \
            _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {                                     \
                __m512 av = _mm512_set1_ps(a[i * lda + k]);                                           \
                lo[i] = _mm512_fmadd_ps(av, blo, lo[i]);                                              \
                hi[i] = _mm512_fmadd_ps(av, bhi, hi[i]);                                              \
            }                                                                                         \
        }                                                                                             \
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) STORE(T, out + i * ldo, lo[i], hi[i], k0 > 0) \
    }                                                                                                 \
}
#else
static inline float scalar_F32(const void *b, int64_t i) { return ((const float *)b)[i]; }
static inline float scalar_BF16(const void *b, int64_t i) {
    uint32_t bits = (uint32_t)((const uint16_t *)b)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#define KERNEL(NAME, R, T)                                                                            \
static void NAME(const float *a, int64_t lda, const void *b, int64_t ldb, float *out, int64_t ldo,    \
                 int64_t K, int64_t step, int64_t nr) {                                               \
    for (int64_t k0 = 0; k0 == 0 || k0 < K; k0 += step) {                                             \
        const int64_t k1 = k0 + step < K ? k0 + step : K;                                             \
        float acc[R][NR];                                                                             \
        memset(acc, 0, sizeof acc);                                                                   \
        for (int64_t k = k0; k < k1; k++)                                                             \
            for (int i = 0; i < R; i++)                                                               \
                for (int64_t j = 0; j < nr; j++)                                                      \
                    acc[i][j] = fmaf(a[i * lda + k], scalar_##T(b, k * ldb + j), acc[i][j]);          \
        for (int i = 0; i < R; i++)                                                                   \
            for (int64_t j = 0; j < nr; j++) out[i * ldo + j] = k0 > 0 ? out[i * ldo + j] + acc[i][j] : acc[i][j]; \
    }                                                                                                 \
}
#endif

#define KERNELS(T)                                                                                    \
    KERNEL(kernel_##T##_1, 1, T) KERNEL(kernel_##T##_2, 2, T) KERNEL(kernel_##T##_3, 3, T)             \
    KERNEL(kernel_##T##_4, 4, T) KERNEL(kernel_##T##_5, 5, T) KERNEL(kernel_##T##_6, 6, T)             \
    KERNEL(kernel_##T##_7, 7, T) KERNEL(kernel_##T##_8, 8, T)
KERNELS(F32)
KERNELS(BF16)

typedef void (*kernel_fn)(const float *, int64_t, const void *, int64_t, float *, int64_t, int64_t, int64_t,
                          int64_t);
static const kernel_fn KERNEL_FNS[2][MR] = {
    {kernel_F32_1, kernel_F32_2, kernel_F32_3, kernel_F32_4, kernel_F32_5, kernel_F32_6, kernel_F32_7, kernel_F32_8},
    {kernel_BF16_1, kernel_BF16_2, kernel_BF16_3, kernel_BF16_4, kernel_BF16_5, kernel_BF16_6, kernel_BF16_7,
     kernel_BF16_8}};

int ordered_gemm_vector(void) {
#ifdef VECTOR
    return 1;
#else
    return 0;
#endif
}

/* out[g1, g2] = a[g1, g2] b[g1, g2] for every (g1, g2) < (G1, G2): a [M, K] float32, b [K, N] float32 or
   bfloat16, out [M, N] float32. p: G1, G2, M, N, K, b_bf16, threads, then strides in elements: a's g1, g2 and
   row; b's g1, g2, row (k) and panel (b's columns come in panels of NR: column n of row k at
   (n / NR) * panel + k * row + n % NR; NR for a plain row-major b); out's g1, g2 and row; then the piece (0: K,
   one chain): the reduction in pieces of that many k's, their sums added in order. Tiles of MR x NR; the row tiles
   meet one panel of b in turn, so it stays in cache. */
void ordered_gemm(const float *a, const void *b, float *out, const int64_t *p) {
    const int64_t G1 = p[0], G2 = p[1], M = p[2], N = p[3], K = p[4], threads = p[6];
    const int64_t *st = p + 7, step = p[17] > 0 && p[17] < K ? p[17] : (K > 0 ? K : 1);
    const kernel_fn *kernels = KERNEL_FNS[p[5] != 0];
    const int64_t eb = p[5] ? 2 : 4, mt = (M + MR - 1) / MR, nt = (N + NR - 1) / NR;
    int parallel = threads > 1 && G1 * G2 * M * N * K >= (1 << 18);  /* a small product is not worth waking threads */
    #pragma omp parallel for collapse(4) schedule(static) num_threads(threads) if(parallel)
    for (int64_t g1 = 0; g1 < G1; g1++)
        for (int64_t g2 = 0; g2 < G2; g2++)
            for (int64_t tj = 0; tj < nt; tj++)
                for (int64_t ti = 0; ti < mt; ti++) {
                    const int64_t m0 = ti * MR, n0 = tj * NR;
                    const int64_t mr = M - m0 < MR ? M - m0 : MR, nr = N - n0 < NR ? N - n0 : NR;
                    kernels[mr - 1](a + g1 * st[0] + g2 * st[1] + m0 * st[2], st[2],
                                    (const char *)b + (g1 * st[3] + g2 * st[4] + tj * st[6]) * eb, st[5],
                                    out + g1 * st[7] + g2 * st[8] + m0 * st[9] + n0, st[9], K, step, nr);
                }
}
"""

_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-shared", "-fPIC")
_LIBS = ("-lm",)  # fmaf, where the CPU has no FMA instruction
_lock = threading.Lock()
_library: ctypes.CDLL | None = None


class OrderedGemmUnavailable(RuntimeError):
    """No C compiler to build the kernel with (invariant numerics on a CPU needs one)."""


def _cache_dir() -> Path:
    """kernels/ in the model cache (services/model/cache.py), or a directory of this user's under the system's
    temporary directory where that is not writable (a container's read-only cache)."""
    cache = default_cache_dir() / "kernels"
    try:
        cache.mkdir(parents=True, exist_ok=True)
        if os.access(cache, os.W_OK):
            return cache
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"reconfig-kernels-{os.getuid()}"


def _cpu_key() -> str:
    """What -march=native compiles for: the CPU's flags (a cache shared by hosts of other CPUs keeps apart)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")
    except OSError:
        return os.uname().machine


def build(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Compile (or find in the cache) and load the kernel; `extra_flags` after the usual ones (the tests build the
    portable path with -mno-avx512f, to compare it with the vector path)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OrderedGemmUnavailable("invariant numerics on a CPU compiles a small C kernel (ordered_gemm) on first "
                                     "use, and no C compiler was found: install gcc, or set CC")
    flags = (*_FLAGS, *extra_flags)
    source = _SOURCE + attention_kernel.SOURCE
    parts = (source, compiler, *flags, *_LIBS, _cpu_key(), sys.platform)
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()
    target = _cache_dir() / f"ordered_gemm-{key[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            path = Path(scratch) / "ordered_gemm.c"
            path.write_text(source)
            built = Path(scratch) / target.name
            result = subprocess.run([compiler, *flags, str(path), "-o", str(built), *_LIBS], capture_output=True,
                                    text=True)
            if result.returncode:
                raise OrderedGemmUnavailable(f"compiling the ordered GEMM kernel with {compiler} failed: "
                                             f"{result.stderr.strip()[-2000:]}")
            os.replace(built, target)  # atomic: workers building it at once all load a whole file
    library = ctypes.CDLL(str(target))
    library.ordered_gemm.restype = None
    library.ordered_gemm.argtypes = [ctypes.c_void_p] * 4
    library.ordered_attention.restype = None
    library.ordered_attention.argtypes = [*[ctypes.c_void_p] * 8, ctypes.c_float]
    library.ordered_gemm_vector.restype = ctypes.c_int
    return library


def load() -> ctypes.CDLL:
    """The compiled kernel (built on first use; OrderedGemmUnavailable when it cannot be)."""
    global _library
    with _lock:
        if _library is None:
            _library = build()
        return _library


def kind() -> str:
    """Which path the kernel compiled to here: "avx512" or "portable" (the same bits either way)."""
    return "avx512" if load().ordered_gemm_vector() else "portable"


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
    if all(len(p) == size for p in pieces[:-1]) and len(pieces[-1]) <= size and all(
            p.start == q.stop for q, p in zip(pieces, pieces[1:])):
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


def _check(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype not in _DTYPES or b.dtype not in _DTYPES:
        raise TypeError(f"ordered_matmul takes float32 or bfloat16 tensors, not {a.dtype} and {b.dtype}")
    if a.is_cuda or b.is_cuda or a.device.type != "cpu" or b.device.type != "cpu":
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
    params = (ctypes.c_int64 * 18)(g1, g2, m, n, k, b.dtype is torch.bfloat16, torch.get_num_threads(), *strides,
                                   piece)
    (_library or load()).ordered_gemm(a.data_ptr(), b.data_ptr(), out.data_ptr(), params)
