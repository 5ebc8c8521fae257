"""Linear with MKL's packed weight (CPU, float32) computes F.linear for any number of rows, holding W once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.model.layers import Linear

needs_mkl = pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="needs a torch build with MKL")


@needs_mkl
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_equals_f_linear_for_every_row_count(with_bias):
    torch.manual_seed(0)
    weight, bias = torch.randn(200, 96), torch.randn(200) if with_bias else None
    linear = Linear(weight, bias)
    linear.pack()
    assert linear.packed is not None
    for rows in (0, 1, 2, 3, 17, 32, 33, 100, 513):
        x = torch.randn(rows, 96)
        torch.testing.assert_close(linear(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@needs_mkl
def test_the_dense_weight_is_dropped_unless_held_elsewhere():
    weight = torch.randn(8, 4)
    linear = Linear(weight)
    assert linear.weight is weight and linear.packed is None  # dense until packed (on the model thread)
    linear.pack()
    assert linear.weight.shape == weight.shape and linear.weight.stride() == (0, 0)  # a placeholder, no storage
    with pytest.raises(ValueError, match="placeholder"):
        Linear(linear.weight)  # re-wrapping it would pack zeros
    tied = Linear(weight, keep_weight=True)
    tied.pack()
    assert tied.weight is weight and tied.packed is not None  # a tied lm_head: the embedding keeps W anyway


def test_without_packing_it_is_f_linear():
    weight, x = torch.randn(8, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    linear = Linear(weight)
    linear.pack()  # float64: no packed GEMM
    assert linear.packed is None and linear.weight is weight
    assert torch.equal(linear(x), F.linear(x, weight))
