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
models) and called through ctypes; float32 and bfloat16 inputs (a bf16 product is exact in float32), float32 out.
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
/* MB rows of a against NB rows of b, one 16-lane register per element. */
#define TILE(NAME, LOAD, MLOAD, MB, NB)                                                               \
static void NAME(const void *a, const void *b, float *out, int64_t m0, int64_t n0, int64_t K,        \
                 int64_t ldo) {                                                                       \
    __m512 acc[MB][NB], av[MB], bv[NB];                                                               \
    for (int i = 0; i < MB; i++)                                                                      \
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();                                 \
    int64_t k = 0;                                                                                    \
    for (; k + LANES <= K; k += LANES) {                                                              \
        for (int i = 0; i < MB; i++) av[i] = LOAD(a, (m0 + i) * K + k);                               \
        for (int j = 0; j < NB; j++) bv[j] = LOAD(b, (n0 + j) * K + k);                               \
        for (int i = 0; i < MB; i++)                                                                  \
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_fmadd_ps(av[i], bv[j], acc[i][j]);       \
    }                                                                                                 \
    if (k < K) {                                                                                      \
        __mmask16 m = (__mmask16)((1u << (K - k)) - 1);                                               \
        for (int i = 0; i < MB; i++) av[i] = MLOAD(a, (m0 + i) * K + k, m);                           \
        for (int j = 0; j < NB; j++) bv[j] = MLOAD(b, (n0 + j) * K + k, m);                           \
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
#define TILE(NAME, LOAD, MLOAD, MB, NB)                                                               \
static void NAME(const void *a, const void *b, float *out, int64_t m0, int64_t n0, int64_t K,        \
                 int64_t ldo) {                                                                       \
    float acc[MB][NB][LANES];                                                                         \
    memset(acc, 0, sizeof acc);                                                                       \
    int64_t k = 0;                                                                                    \
    for (; k + LANES <= K; k += LANES)                                                                \
        for (int i = 0; i < MB; i++)                                                                  \
            for (int j = 0; j < NB; j++)                                                              \
                for (int l = 0; l < LANES; l++)                                                       \
                    acc[i][j][l] = fmaf(LOAD(a, (m0 + i) * K + k + l), LOAD(b, (n0 + j) * K + k + l),   \
                                        acc[i][j][l]);                                                \
    for (int l = 0; k + l < K; l++)                                                                   \
        for (int i = 0; i < MB; i++)                                                                  \
            for (int j = 0; j < NB; j++)                                                              \
                acc[i][j][l] = fmaf(LOAD(a, (m0 + i) * K + k + l), LOAD(b, (n0 + j) * K + k + l),       \
                                    acc[i][j][l]);                                                    \
    for (int i = 0; i < MB; i++)                                                                      \
        for (int j = 0; j < NB; j++)                                                                  \
            out[(m0 + i) * ldo + n0 + j] = fold(acc[i][j]);                                           \
}
#endif

TILE(tile_f32_44, load_f32, mload_f32, 4, 4)
TILE(tile_f32_14, load_f32, mload_f32, 1, 4)
TILE(tile_f32_41, load_f32, mload_f32, 4, 1)
TILE(tile_f32_11, load_f32, mload_f32, 1, 1)
TILE(tile_bf16_44, load_bf16, mload_bf16, 4, 4)
TILE(tile_bf16_14, load_bf16, mload_bf16, 1, 4)
TILE(tile_bf16_41, load_bf16, mload_bf16, 4, 1)
TILE(tile_bf16_11, load_bf16, mload_bf16, 1, 1)

typedef void (*tile_fn)(const void *, const void *, float *, int64_t, int64_t, int64_t, int64_t);

int ordered_gemm_vector(void) {
#ifdef VECTOR
    return 1;
#else
    return 0;
#endif
}

/* out[g] = a[g] b[g]^T for g < G: a [G, M, K], b [G, N, K] (rows contiguous), out [G, M, N] float32. Tiles of
   4 x 4 elements; a column of tiles (4 rows of b) meets every row tile in turn, so b's rows stay in cache. */
void ordered_gemm(const void *a, const void *b, float *out, int64_t G, int64_t M, int64_t N, int64_t K,
                  int64_t elem, int bf16, int threads) {
    tile_fn t44 = bf16 ? tile_bf16_44 : tile_f32_44, t14 = bf16 ? tile_bf16_14 : tile_f32_14,
            t41 = bf16 ? tile_bf16_41 : tile_f32_41, t11 = bf16 ? tile_bf16_11 : tile_f32_11;
    int64_t mt = (M + 3) / 4, nt = (N + 3) / 4;
    int parallel = threads > 1 && G * M * N * K >= (1 << 18);  /* a small product is not worth waking threads */
    #pragma omp parallel for collapse(3) schedule(static) num_threads(threads) if(parallel)
    for (int64_t g = 0; g < G; g++)
        for (int64_t tj = 0; tj < nt; tj++)
            for (int64_t ti = 0; ti < mt; ti++) {
                const char *ag = (const char *)a + g * M * K * elem, *bg = (const char *)b + g * N * K * elem;
                float *og = out + g * M * N;
                int64_t m0 = ti * 4, n0 = tj * 4, mb = M - m0 < 4 ? M - m0 : 4, nb = N - n0 < 4 ? N - n0 : 4;
                if (mb == 4 && nb == 4) {
                    t44(ag, bg, og, m0, n0, K, N);
                } else if (nb == 4) {
                    for (int64_t m = m0; m < m0 + mb; m++) t14(ag, bg, og, m, n0, K, N);
                } else if (mb == 4) {
                    for (int64_t n = n0; n < n0 + nb; n++) t41(ag, bg, og, m0, n, K, N);
                } else {
                    for (int64_t m = m0; m < m0 + mb; m++)
                        for (int64_t n = n0; n < n0 + nb; n++) t11(ag, bg, og, m, n, K, N);
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
                                     ctypes.c_int, ctypes.c_int]
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
    element reduced in the fixed order of the module's docstring. CPU tensors of one dtype, float32 or bfloat16;
    the leading dimensions of a and b equal (b may have none: one weight for every batch). Called for every
    product of a step: a few microseconds of Python around the kernel."""
    dtype = a.dtype
    if dtype is not b.dtype or (dtype is not torch.float32 and dtype is not torch.bfloat16):
        raise TypeError(f"ordered_matmul takes float32 or bfloat16 tensors of one dtype, not {a.dtype} and {b.dtype}")
    if a.device.type != "cpu" or b.device.type != "cpu":
        raise ValueError("ordered_matmul runs on the CPU")
    shape, k = a.shape, a.shape[-1]
    if b.dim() == 2:  # one weight: every row of a is a row of one product
        n = b.shape[0]
        if b.shape[1] != k:
            raise ValueError(f"ordered_matmul: shapes {tuple(a.shape)} and {tuple(b.shape)} do not match")
        groups, rows = 1, math.prod(shape[:-1])
    else:
        n = b.shape[-2]
        if b.shape[:-2] != shape[:-2] or b.shape[-1] != k:
            raise ValueError(f"ordered_matmul: shapes {tuple(a.shape)} and {tuple(b.shape)} do not match")
        groups, rows = math.prod(shape[:-2]), shape[-2]
    out = torch.empty((*shape[:-1], n), dtype=torch.float32)
    if out.numel():
        if k == 0:
            return out.zero_()
        a, b = a.contiguous(), b.contiguous()
        (_library or load()).ordered_gemm(a.data_ptr(), b.data_ptr(), out.data_ptr(), groups, rows, n, k,
                                          a.element_size(), dtype is torch.bfloat16, torch.get_num_threads())
    return out
