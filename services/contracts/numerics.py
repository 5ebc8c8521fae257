"""The names of the workers' compute settings, shared by the launcher, the CLIs and the workers (no torch here)."""

from __future__ import annotations

# How a shard computes (services/model/numerics.py): "fast", each op as its kernel computes it; "invariant", no
# bit of a token's result depends on its batch, its prompt's chunking or the layout.
MODES = ("fast", "invariant")
# The dtype of the weights, activations and KV cache; "auto": float32 on CPU, the checkpoint's own on a GPU.
DTYPES = ("auto", "float32", "bfloat16", "float16")


def check_compute(dtype: str, numerics: str) -> None:
    """ValueError naming the choices when `dtype` or `numerics` is not one of them."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if numerics not in MODES:
        raise ValueError(f"numerics must be one of {', '.join(MODES)}, not {numerics!r}")
