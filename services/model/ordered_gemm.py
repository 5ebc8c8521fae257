"""A GEMM whose every output element is added in one order fixed by its reduction length alone: invariant
numerics' products on the CPU (services/model/numerics.py).

A BLAS picks its kernel, its blocking of the reduction and its split between threads by the shape of the whole
product and by the CPU it runs on: MKL's float32 GEMM on one Xeon gives a row other bits in a product of 8 rows
than in one of 328 (at any padding), and with AVX2 kernels other bits at another position in a product of one
fixed shape; oneDNN's AMX bfloat16 GEMM likewise. No padding rule holds on every CPU, so invariant mode does not
ask a BLAS: `ordered_matmul` computes out[..., m, n] = sum_k a[..., m, k] * b[..., n, k] as

    lane l (0..15) adds a[k] * b[k] for k = l, l + 16, l + 32, ... in order (a multiply, then an add: no FMA)
    the 16 lanes are folded as a fixed tree: ((l0 + l1) + (l2 + l3)) + ... in float32,

whatever the other rows and columns, the row's position, the thread count, the vector width or the CPU. The
kernel is C, compiled on first use with the system's C compiler (`cc`, or $CC) into a per-CPU cache (beside the models) and called
through ctypes; float32 and bfloat16 inputs (a bf16 product is exact in float32), float32 out. It is a correctness
path, several times slower than MKL at large batches (bench/numerics.py measures the mode's cost).
"""

from __future__ import annotations

import ctypes
import hashlib
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

#define LANES 16

static inline float load_f32(const void *p, int64_t i) { return ((const float *)p)[i]; }
static inline float load_bf16(const void *p, int64_t i) {
    uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float fold(const float *acc) {
    return ((((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])))
            + (((acc[8] + acc[9]) + (acc[10] + acc[11])) + ((acc[12] + acc[13]) + (acc[14] + acc[15]))));
}

/* MB rows of a against NB rows of b: every element's lanes as in the module's docstring. */
#define TILE(NAME, LOAD, MB, NB)                                                                      \
static void NAME(const void *a, const void *b, float *out, int64_t m0, int64_t n0, int64_t K,        \
                 int64_t lda, int64_t ldb, int64_t ldo) {                                             \
    float acc[MB][NB][LANES];                                                                         \
    memset(acc, 0, sizeof acc);                                                                       \
    int64_t k = 0;                                                                                    \
    for (; k + LANES <= K; k += LANES)                                                                \
        for (int i = 0; i < MB; i++)                                                                  \
            for (int j = 0; j < NB; j++)                                                              \
                for (int l = 0; l < LANES; l++)                                                       \
                    acc[i][j][l] += LOAD(a, (m0 + i) * lda + k + l) * LOAD(b, (n0 + j) * ldb + k + l);  \
    for (int l = 0; k + l < K; l++)                                                                   \
        for (int i = 0; i < MB; i++)                                                                  \
            for (int j = 0; j < NB; j++)                                                              \
                acc[i][j][l] += LOAD(a, (m0 + i) * lda + k + l) * LOAD(b, (n0 + j) * ldb + k + l);      \
    for (int i = 0; i < MB; i++)                                                                      \
        for (int j = 0; j < NB; j++)                                                                  \
            out[(m0 + i) * ldo + n0 + j] = fold(acc[i][j]);                                           \
}

TILE(tile_f32_42, load_f32, 4, 2)
TILE(tile_f32_12, load_f32, 1, 2)
TILE(tile_f32_11, load_f32, 1, 1)
TILE(tile_bf16_42, load_bf16, 4, 2)
TILE(tile_bf16_12, load_bf16, 1, 2)
TILE(tile_bf16_11, load_bf16, 1, 1)

typedef void (*tile_fn)(const void *, const void *, float *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);

/* out[g] = a[g] b[g]^T for g < G: a [G, M, K], b [G, N, K] (rows contiguous), out [G, M, N] float32. */
void ordered_gemm(const void *a, const void *b, float *out, int64_t G, int64_t M, int64_t N, int64_t K,
                  int64_t elem, int bf16, int threads) {
    tile_fn big = bf16 ? tile_bf16_42 : tile_f32_42, row = bf16 ? tile_bf16_12 : tile_f32_12,
            one = bf16 ? tile_bf16_11 : tile_f32_11;
    int64_t mt = (M + 3) / 4, nt = (N + 1) / 2;
    int parallel = threads > 1 && G * M * N * K >= (1 << 18);  /* a small product is not worth waking threads */
    #pragma omp parallel for collapse(3) schedule(static) num_threads(threads) if(parallel)
    for (int64_t g = 0; g < G; g++)
        for (int64_t ti = 0; ti < mt; ti++)
            for (int64_t tj = 0; tj < nt; tj++) {
                const char *ag = (const char *)a + g * M * K * elem, *bg = (const char *)b + g * N * K * elem;
                float *og = out + g * M * N;
                int64_t m0 = ti * 4, n0 = tj * 2;
                if (m0 + 4 <= M && n0 + 2 <= N) {
                    big(ag, bg, og, m0, n0, K, K, K, N);
                } else {
                    for (int64_t m = m0; m < M && m < m0 + 4; m++) {
                        if (n0 + 2 <= N && m0 + 4 > M) {
                            row(ag, bg, og, m, n0, K, K, K, N);
                        } else {
                            for (int64_t n = n0; n < N && n < n0 + 2; n++)
                                one(ag, bg, og, m, n, K, K, K, N);
                        }
                    }
                }
            }
}
"""

_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-shared", "-fPIC")
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


def _build() -> ctypes.CDLL:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OrderedGemmUnavailable("invariant numerics on a CPU compiles a small C kernel (ordered_gemm) on first "
                                     "use, and no C compiler was found: install gcc, or set CC")
    key = hashlib.sha256("\0".join((_SOURCE, compiler, *_FLAGS, _cpu_key(), sys.platform)).encode()).hexdigest()
    target = _cache_dir() / f"ordered_gemm-{key[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            source = Path(scratch) / "ordered_gemm.c"
            source.write_text(_SOURCE)
            built = Path(scratch) / target.name
            result = subprocess.run([compiler, *_FLAGS, str(source), "-o", str(built)], capture_output=True,
                                    text=True)
            if result.returncode:
                raise OrderedGemmUnavailable(f"compiling the ordered GEMM kernel with {compiler} failed: "
                                             f"{result.stderr.strip()[-2000:]}")
            os.replace(built, target)  # atomic: workers building it at once all load a whole file
    library = ctypes.CDLL(str(target))
    library.ordered_gemm.restype = None
    library.ordered_gemm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 5,
                                     ctypes.c_int, ctypes.c_int]
    return library


def load() -> ctypes.CDLL:
    """The compiled kernel (built on first use; OrderedGemmUnavailable when it cannot be)."""
    global _library
    with _lock:
        if _library is None:
            _library = _build()
        return _library


def ordered_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] x b [..., N, K] -> [..., M, N] float32 (b's rows, not its columns, as in F.linear), every
    element reduced in the fixed order of the module's docstring. CPU tensors of one dtype, float32 or bfloat16;
    the leading dimensions of a and b equal (b may have none: one weight for every batch)."""
    if a.dtype != b.dtype or a.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"ordered_matmul takes float32 or bfloat16 tensors of one dtype, not {a.dtype} and {b.dtype}")
    if a.device.type != "cpu" or b.device.type != "cpu":
        raise ValueError("ordered_matmul runs on the CPU")
    *lead, m, k = a.shape
    if b.dim() == 2:
        a2 = a.reshape(-1, k)  # one weight: every row of a is a row of one product
        out = _gemm(a2[None], b[None])
        return out.view(*lead, m, b.shape[0])
    if tuple(b.shape[:-2]) != tuple(lead) or b.shape[-1] != k:
        raise ValueError(f"ordered_matmul: shapes {tuple(a.shape)} and {tuple(b.shape)} do not match")
    out = _gemm(a.reshape(-1, m, k), b.reshape(-1, b.shape[-2], k))
    return out.view(*lead, m, b.shape[-2])


def _gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [G, M, K], b [G, N, K] -> [G, M, N] float32."""
    a, b = a.contiguous(), b.contiguous()
    groups, m, k = a.shape
    n = b.shape[1]
    out = torch.empty(groups, m, n, dtype=torch.float32)
    if out.numel():
        if k == 0:
            return out.zero_()
        load().ordered_gemm(a.data_ptr(), b.data_ptr(), out.data_ptr(), groups, m, n, k, a.element_size(),
                            int(a.dtype == torch.bfloat16), torch.get_num_threads())
    return out
