"""Invariant numerics' C kernels for the CPU (gemm_kernel.py, attention_kernel.py), compiled on first use with the
system's C compiler (`cc`, or $CC) into a per-CPU cache beside the models (-march=native: a host of another CPU
builds its own), loaded through ctypes as one library. Compiled with -ffp-contract=off and without fast-math: each
operation rounds as written, so the AVX-512 path and the portable one give the same bits.
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

from services.model import attention_kernel, gemm_kernel
from services.model.cache import default_cache_dir

# What every kernel's source may use: the headers, and VECTOR where the CPU has AVX-512 F, BW and VL (else each
# kernel's portable C of the same order).
_PRELUDE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define VECTOR 1
#endif
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
    source = _PRELUDE + gemm_kernel.SOURCE + attention_kernel.SOURCE
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


def library() -> ctypes.CDLL:
    """load(), without the lock once loaded (every product calls it)."""
    return _library or load()


def kind() -> str:
    """Which path the kernel compiled to here: "avx512" or "portable" (the same bits either way)."""
    return "avx512" if load().ordered_gemm_vector() else "portable"
