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

from services.model.cache import default_cache_dir

LANES = 16  # accumulators per output element: part of the order, so fixed (not the machine's vector width)

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define VECTOR 1
#endif

#define LANES 16

static inline float fold(const float *acc) {
    return ((((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])))
            + (((acc[8] + acc[9]) + (acc[10] + acc[11])) + ((acc[12] + acc[13]) + (acc[14] + acc[15]))));
}

#ifdef VECTOR
static inline __m512 load_f32(const void *p, int64_t i) { return _mm512_loadu_ps((const float *)p + i); }
static inline __m512 load_bf16(const void *p, int64_t i) {
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 mload_f32(const void *p, int64_t i, __mmask16 m) {
    return _mm512_maskz_loadu_ps(m, (const float *)p + i);
}
static inline __m512 mload_bf16(const void *p, int64_t i, __mmask16 m) {
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
/* MB rows of a (row stride lda) against NB rows of b (row stride ldb), one 16-lane register per element. */
#define TILE(NAME, LOADA, MLOADA, LOADB, MLOADB, MB, NB)                                              \
static void NAME(const void *a, const void *b, float *out, int64_t m0, int64_t n0, int64_t K,        \
                 int64_t lda, int64_t ldb, int64_t ldo) {                                             \
    __m512 acc[MB][NB], av[MB], bv[NB];                                                               \
    for (int i = 0; i < MB; i++)                                                                      \
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();                                 \
    int64_t k = 0;                                                                                    \
    for (; k + LANES <= K; k += LANES) {                                                              \
        for (int i = 0; i < MB; i++) av[i] = LOADA(a, (m0 + i) * lda + k);                            \
        for (int j = 0; j < NB; j++) bv[j] = LOADB(b, (n0 + j) * ldb + k);                            \
        for (int i = 0; i < MB; i++)                                                                  \
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_fmadd_ps(av[i], bv[j], acc[i][j]);       \
    }                                                                                                 \
    if (k < K) {                                                                                      \
        __mmask16 m = (__mmask16)((1u << (K - k)) - 1);                                               \
        for (int i = 0; i < MB; i++) av[i] = MLOADA(a, (m0 + i) * lda + k, m);                        \
        for (int j = 0; j < NB; j++) bv[j] = MLOADB(b, (n0 + j) * ldb + k, m);                        \
        for (int i = 0; i < MB; i++)                                                                  \
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_mask3_fmadd_ps(av[i], bv[j], acc[i][j], m); \
    }                                                                                                 \
    float lanes[LANES];                                                                               \
    for (int i = 0; i < MB; i++)                                                                      \
        for (int j = 0; j < NB; j++) {                                                                \
            _mm512_storeu_ps(lanes, acc[i][j]);                                                       \
            out[(m0 + i) * ldo + n0 + j] = fold(lanes);                                               \
        }                                                                                             \
}
#else
static inline float load_f32(const void *p, int64_t i) { return ((const float *)p)[i]; }
static inline float load_bf16(const void *p, int64_t i) {
    uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#define TILE(NAME, LOADA, MLOADA, LOADB, MLOADB, MB, NB)                                              \
static void NAME(const void *a, const void *b, float *out, int64_t m0, int64_t n0, int64_t K,        \
                 int64_t lda, int64_t ldb, int64_t ldo) {                                             \
    float acc[MB][NB][LANES];                                                                         \
    memset(acc, 0, sizeof acc);                                                                       \
    int64_t k = 0;                                                                                    \
    for (; k + LANES <= K; k += LANES)                                                                \
        for (int i = 0; i < MB; i++)                                                                  \
            for (int j = 0; j < NB; j++)                                                              \
                for (int l = 0; l < LANES; l++)                                                       \
                    acc[i][j][l] = fmaf(LOADA(a, (m0 + i) * lda + k + l), LOADB(b, (n0 + j) * ldb + k + l), \
                                        acc[i][j][l]);                                                \
    for (int l = 0; k + l < K; l++)                                                                   \
        for (int i = 0; i < MB; i++)                                                                  \
            for (int j = 0; j < NB; j++)                                                              \
                acc[i][j][l] = fmaf(LOADA(a, (m0 + i) * lda + k + l), LOADB(b, (n0 + j) * ldb + k + l), \
                                    acc[i][j][l]);                                                    \
    for (int i = 0; i < MB; i++)                                                                      \
        for (int j = 0; j < NB; j++)                                                                  \
            out[(m0 + i) * ldo + n0 + j] = fold(acc[i][j]);                                           \
}
#endif

/* Every tile shape for a's and b's dtypes (f: float32, h: bfloat16). */
#define TILES(AB, LA, MLA, LB, MLB)                                                                   \
    TILE(tile_##AB##_44, LA, MLA, LB, MLB, 4, 4)                                                      \
    TILE(tile_##AB##_14, LA, MLA, LB, MLB, 1, 4)                                                      \
    TILE(tile_##AB##_41, LA, MLA, LB, MLB, 4, 1)                                                      \
    TILE(tile_##AB##_11, LA, MLA, LB, MLB, 1, 1)
TILES(ff, load_f32, mload_f32, load_f32, mload_f32)
TILES(fh, load_f32, mload_f32, load_bf16, mload_bf16)
TILES(hf, load_bf16, mload_bf16, load_f32, mload_f32)
TILES(hh, load_bf16, mload_bf16, load_bf16, mload_bf16)

typedef void (*tile_fn)(const void *, const void *, float *, int64_t, int64_t, int64_t, int64_t, int64_t,
                        int64_t);
static const tile_fn TILE_FNS[4][4] = {
    {tile_ff_44, tile_ff_14, tile_ff_41, tile_ff_11}, {tile_fh_44, tile_fh_14, tile_fh_41, tile_fh_11},
    {tile_hf_44, tile_hf_14, tile_hf_41, tile_hf_11}, {tile_hh_44, tile_hh_14, tile_hh_41, tile_hh_11}};

int ordered_gemm_vector(void) {
#ifdef VECTOR
    return 1;
#else
    return 0;
#endif
}

/* out[g1, g2] = a[g1, g2] b[g1, g2]^T for every (g1, g2) < (G1, G2): a [M, K], b [N, K], out [M, N] float32, each
   with its own strides in elements (st: a's g1, g2 and row strides, then b's, then out's; a row's K elements are
   contiguous). Tiles of 4 x 4 elements; a column of tiles (4 rows of b) meets every row tile in turn, so b's rows
   stay in cache. a_bf16 / b_bf16: that operand is bfloat16 (else float32). */
void ordered_gemm(const void *a, const void *b, float *out, int64_t G1, int64_t G2, int64_t M, int64_t N,
                  int64_t K, const int64_t *st, int a_bf16, int b_bf16, int threads) {
    const tile_fn *t = TILE_FNS[2 * (a_bf16 != 0) + (b_bf16 != 0)];
    const int64_t ea = a_bf16 ? 2 : 4, eb = b_bf16 ? 2 : 4;
    const int64_t mt = (M + 3) / 4, nt = (N + 3) / 4;
    int parallel = threads > 1 && G1 * G2 * M * N * K >= (1 << 18);  /* a small product is not worth waking threads */
    #pragma omp parallel for collapse(4) schedule(static) num_threads(threads) if(parallel)
    for (int64_t g1 = 0; g1 < G1; g1++)
        for (int64_t g2 = 0; g2 < G2; g2++)
            for (int64_t tj = 0; tj < nt; tj++)
                for (int64_t ti = 0; ti < mt; ti++) {
                    const char *ag = (const char *)a + (g1 * st[0] + g2 * st[1]) * ea;
                    const char *bg = (const char *)b + (g1 * st[3] + g2 * st[4]) * eb;
                    float *og = out + g1 * st[6] + g2 * st[7];
                    const int64_t lda = st[2], ldb = st[5], ldo = st[8];
                    int64_t m0 = ti * 4, n0 = tj * 4, mb = M - m0 < 4 ? M - m0 : 4, nb = N - n0 < 4 ? N - n0 : 4;
                    if (mb == 4 && nb == 4) {
                        t[0](ag, bg, og, m0, n0, K, lda, ldb, ldo);
                    } else if (nb == 4) {
                        for (int64_t m = m0; m < m0 + mb; m++) t[1](ag, bg, og, m, n0, K, lda, ldb, ldo);
                    } else if (mb == 4) {
                        for (int64_t n = n0; n < n0 + nb; n++) t[2](ag, bg, og, m0, n, K, lda, ldb, ldo);
                    } else {
                        for (int64_t m = m0; m < m0 + mb; m++)
                            for (int64_t n = n0; n < n0 + nb; n++) t[3](ag, bg, og, m, n, K, lda, ldb, ldo);
                    }
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
    parts = (_SOURCE, compiler, *flags, *_LIBS, _cpu_key(), sys.platform)
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()
    target = _cache_dir() / f"ordered_gemm-{key[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            source = Path(scratch) / "ordered_gemm.c"
            source.write_text(_SOURCE)
            built = Path(scratch) / target.name
            result = subprocess.run([compiler, *flags, str(source), "-o", str(built), *_LIBS], capture_output=True,
                                    text=True)
            if result.returncode:
                raise OrderedGemmUnavailable(f"compiling the ordered GEMM kernel with {compiler} failed: "
                                             f"{result.stderr.strip()[-2000:]}")
            os.replace(built, target)  # atomic: workers building it at once all load a whole file
    library = ctypes.CDLL(str(target))
    library.ordered_gemm.restype = None
    library.ordered_gemm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 5,
                                     ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
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
    dimensions of a and b equal (b may have none: one weight for every batch). Any strides but a unit one along K
    (else a copy). Called for every product of a step: a few microseconds of Python around the kernel."""
    _check(a, b)
    shape, k = a.shape, a.shape[-1]
    if b.dim() == 2:  # one weight: every row of a is a row of one product
        if b.shape[1] != k:
            raise ValueError(f"ordered_matmul: shapes {tuple(a.shape)} and {tuple(b.shape)} do not match")
        out = torch.empty((*shape[:-1], b.shape[0]), dtype=torch.float32)
        if out.numel():
            rows = a.reshape(-1, k)
            _gemm(rows[None, None], b[None, None], out.view(1, 1, -1, b.shape[0]))
        return out
    if b.shape[:-2] != shape[:-2] or b.shape[-1] != k:
        raise ValueError(f"ordered_matmul: shapes {tuple(a.shape)} and {tuple(b.shape)} do not match")
    out = torch.empty((*shape[:-1], b.shape[-2]), dtype=torch.float32)
    if out.numel():
        _gemm(_four(a), _four(b), _four(out))
    return out


def ordered_pieces(x: torch.Tensor, weight: torch.Tensor, pieces: tuple[range, ...]) -> torch.Tensor:
    """x [N, in] x weight [out, in] over each piece of the input columns apart (adjacent ranges of in) ->
    [N, len(pieces) * out] float32: piece p's partial product in columns [p * out, (p + 1) * out), each the bits
    ordered_matmul(x[:, p], weight[:, p]) gives, in one call per run of pieces of one width."""
    _check(x, weight)
    rows, width = x.shape[0], weight.shape[0]
    out = torch.empty((rows, len(pieces) * width), dtype=torch.float32)
    if not out.numel():
        return out
    first = 0
    while first < len(pieces):
        start, size = pieces[first].start, len(pieces[first])
        last = first + 1
        while last < len(pieces) and len(pieces[last]) == size and pieces[last].start == pieces[last - 1].stop:
            last += 1
        count, stop = last - first, start + (last - first) * size
        _gemm(x[:, start:stop].unflatten(1, (count, size)).transpose(0, 1)[None],  # [1, count, N, size]
              weight[:, start:stop].unflatten(1, (count, size)).transpose(0, 1)[None],  # [1, count, out, size]
              out[:, first * width: last * width].unflatten(1, (count, width)).transpose(0, 1)[None])
        first = last
    return out


def _check(a: torch.Tensor, b: torch.Tensor) -> None:
    for t in (a, b):
        if t.dtype is not torch.float32 and t.dtype is not torch.bfloat16:
            raise TypeError(f"ordered_matmul takes float32 or bfloat16 tensors, not {a.dtype} and {b.dtype}")
        if t.device.type != "cpu":
            raise ValueError("ordered_matmul runs on the CPU")


def _four(t: torch.Tensor) -> torch.Tensor:
    """t [..., rows, cols] as 4 dimensions [G1, G2, rows, cols] (leading ones merged where they can be viewed so,
    else copied)."""
    if t.dim() == 4:
        return t
    if t.dim() < 4:
        return t[(None,) * (4 - t.dim())]
    return t.reshape(-1, *t.shape[-2:])[None]


def _gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """The kernel: out = a b^T for each of [G1, G2]; a [G1, G2, M, K], b [G1, G2, N, K] (a stride 0 repeats one),
    out [G1, G2, M, N] float32."""
    k = a.shape[-1]
    if k == 0:
        out.zero_()
        return
    if k > 1 and a.stride(-1) != 1:
        a = a.contiguous()
    if k > 1 and b.stride(-1) != 1:
        b = b.contiguous()
    g1, g2, m, n = out.shape
    strides = (ctypes.c_int64 * 9)(*a.stride()[:3], *b.stride()[:3], *out.stride()[:3])
    (_library or load()).ordered_gemm(a.data_ptr(), b.data_ptr(), out.data_ptr(), g1, g2, m, n, k, strides,
                                      a.dtype is torch.bfloat16, b.dtype is torch.bfloat16, torch.get_num_threads())
