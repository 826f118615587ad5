"""RMSNorm vs transformers' LlamaRMSNorm; Triton (interpreter) vs torch path."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from pagemill.kernels import rms_norm, rms_norm_torch, rms_norm_triton


def make(seed: int, shape: tuple[int, ...], dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g).to(dtype)
    r = torch.randn(*shape, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
    return x, r, w


def hf_norm(w: torch.Tensor, eps: float) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(w.shape[0], eps=eps).to(w.dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_matches_transformers(dtype):
    x, r, w = make(0, (7, 96), dtype)
    norm = hf_norm(w, 1e-5)
    with torch.no_grad():
        assert torch.equal(rms_norm_torch(x, w, 1e-5), norm(x))
        y, s = rms_norm_torch(x, w, 1e-5, residual=r)
        # The decoder layer adds the residual in the model dtype, then normalises.
        assert torch.equal(s, x + r)
        assert torch.equal(y, norm(x + r))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (5, 96), (2, 3, 40)])
def test_triton_matches_torch(interpreter, dtype, shape):
    x, r, w = make(1, shape, dtype)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    y = rms_norm_triton(x, w, 1e-6)
    ref = rms_norm_torch(x, w, 1e-6)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < tol
    y, s = rms_norm_triton(x, w, 1e-6, residual=r)
    ref_y, ref_s = rms_norm_torch(x, w, 1e-6, residual=r)
    # fp32 sums are exact; the interpreter rounds fp32 -> bf16 toward zero (GPUs round to
    # nearest even), so bf16 sums may differ by one ulp there.
    assert ((s.float() - ref_s.float()).norm() / ref_s.float().norm()).item() < tol
    assert ((y.float() - ref_y.float()).norm() / ref_y.float().norm()).item() < tol


def test_dispatch_and_errors():
    x, r, w = make(2, (3, 32), torch.float32)
    assert torch.equal(rms_norm(x, w, 1e-5), rms_norm_torch(x, w, 1e-5))
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, w[:-1], 1e-5)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, w, 1e-5, residual=r[:2])
