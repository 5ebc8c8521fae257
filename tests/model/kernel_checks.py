"""What the Triton kernels' tests share: their device (CUDA where there is one, else the CPU, where Triton's
interpreter runs them) and their tolerances: float32 within float rounding (the kernels add in another order);
bfloat16 within 4 ulps or 2^-6 (the eager path rounds after each op, the kernels once; and the interpreter's float32
-> bfloat16 cast truncates)."""

from __future__ import annotations

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if expected.dtype == torch.bfloat16:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2 ** -5, atol=2 ** -6)
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
