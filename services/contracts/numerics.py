"""The names of the workers' compute settings, shared by the launcher, the CLIs and the workers (no torch here)."""

from __future__ import annotations

# How a shard computes (services/model/numerics.py): "fast", each op as its kernel computes it; "invariant", no
# bit of a token's result depends on its batch, its prompt's chunking or the layout.
MODES = ("fast", "invariant")
# The dtype of the weights, activations and KV cache; "auto": float32 on CPU, the checkpoint's own on a GPU.
DTYPES = ("auto", "float32", "bfloat16", "float16")
# What computes a layer's norms, rotary + KV write, decode attention and SwiGLU (services/model/kernels.py):
# "torch", eager ops; "triton", fused kernels (for CUDA; a CPU runs them in Triton's interpreter, for tests).
KERNELS = ("torch", "triton")


def check_compute(dtype: str, numerics: str, kernels: str = "torch") -> None:
    """ValueError naming the choices when `dtype`, `numerics` or `kernels` is not one of them, or when invariant
    numerics meets fused kernels (whose reductions are not its fixed ones)."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, not {kernels!r}")
    if kernels != "torch" and numerics == "invariant":
        raise ValueError(f"numerics 'invariant' computes with its own kernels: kernels {kernels!r} cannot join it")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if numerics not in MODES:
        raise ValueError(f"numerics must be one of {', '.join(MODES)}, not {numerics!r}")
