"""SiLU-and-mul: torch path vs the Llama MLP expression; Triton (interpreter) vs torch path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagemill.kernels import silu_and_mul, silu_and_mul_torch, silu_and_mul_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_matches_mlp_expression(dtype):
    g = torch.Generator().manual_seed(0)
    gate = torch.randn(5, 48, generator=g).to(dtype)
    up = torch.randn(5, 48, generator=g).to(dtype)
    assert torch.equal(silu_and_mul_torch(torch.cat((gate, up), -1)), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2), (3, 80), (2, 3, 2050)])
def test_triton_matches_torch(interpreter, dtype, shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    y = silu_and_mul_triton(x)
    ref = silu_and_mul_torch(x)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < tol


def test_dispatch_and_errors():
    x = torch.randn(4, 10)
    assert torch.equal(silu_and_mul(x), silu_and_mul_torch(x))
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.randn(4, 9))
