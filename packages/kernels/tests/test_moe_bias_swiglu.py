"""Fused MoE with expert biases and gpt-oss's clamped SwiGLU ("swigluoai"), and gpt-oss's
router (top-k of the logits, then a softmax over them): the CPU path and the Triton kernel
(interpreter) against a per-pair einsum reference that writes transformers' formula out."""

from __future__ import annotations

import pytest
import torch

from pagemill.kernels import fused_moe, fused_moe_torch, fused_moe_triton, topk_then_softmax

ALPHA, LIMIT = 1.702, 7.0


def _reference(x, w13, w2, b13, b2, weights, ids):
    """transformers' GptOssExperts per (token, slot): gate/up with bias, gate clamped above,
    up clamped both sides, ``(up + 1) * gate * sigmoid(gate * alpha)``, down with bias."""
    inter = w2.shape[-1]
    gu = torch.einsum("th,tknh->tkn", x.double(), w13.double()[ids]) + b13.double()[ids]
    gate = gu[..., :inter].clamp(max=LIMIT)
    up = gu[..., inter:].clamp(min=-LIMIT, max=LIMIT)
    act = (up + 1) * (gate * torch.sigmoid(gate * ALPHA))
    out = torch.einsum("tki,tkhi->tkh", act, w2.double()[ids]) + b2.double()[ids]
    return (out * weights.double()[..., None]).sum(1)


def _case(t, h, inter, e, k, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # Large enough that some gate/up values pass the clamp limit (the clamp is exercised).
    x = (torch.randn(t, h, generator=g) * 3).to(dtype)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) * 2 / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(dtype)
    b13 = torch.randn(e, 2 * inter, generator=g).to(dtype)
    b2 = torch.randn(e, h, generator=g).to(dtype)
    logits = torch.randn(t, e, generator=g)
    weights, ids = topk_then_softmax(logits, k)
    return x, w13, w2, b13, b2, weights, ids


def test_router_is_topk_then_softmax() -> None:
    logits = torch.tensor([[1.0, 3.0, -2.0, 0.5, 2.0], [0.0, 4.0, 4.0, 1.0, -1.0]])
    weights, ids = topk_then_softmax(logits, 3)
    ref_v, ref_ids = torch.topk(logits, 3, dim=-1)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, torch.softmax(ref_v, -1))
    assert weights.dtype == torch.float32
    assert topk_then_softmax(logits.bfloat16(), 2)[0].dtype == torch.float32


@pytest.mark.parametrize(("t", "e", "k"), [(1, 8, 2), (29, 6, 4)])
def test_torch_path_matches_reference(t, e, k) -> None:
    x, w13, w2, b13, b2, weights, ids = _case(t, 32, 24, e, k)
    ref = _reference(x, w13, w2, b13, b2, weights, ids)
    gu = torch.einsum("th,tknh->tkn", x, w13[ids])
    assert (gu.abs() > LIMIT).any()  # the clamp changes some values
    got = fused_moe_torch(
        x, w13, w2, weights, ids, b13, b2, "swigluoai", swiglu_alpha=ALPHA, swiglu_limit=LIMIT
    )
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    # Without the biases / with SiLU the result differs: the comparison can fail.
    assert not torch.allclose(fused_moe(x, w13, w2, weights, ids, None, b2, "swigluoai"), got)
    assert not torch.allclose(fused_moe(x, w13, w2, weights, ids, b13, b2, "silu"), got)


@pytest.mark.parametrize("block_m", [16, 64])
def test_triton_matches_reference(interpreter, block_m) -> None:
    x, w13, w2, b13, b2, weights, ids = _case(21, 32, 24, 5, 2, seed=1)
    ref = _reference(x, w13, w2, b13, b2, weights, ids)
    got = fused_moe_triton(x, w13, w2, weights, ids, b13, b2, "swigluoai", block_m=block_m)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_bad_extras_are_refused() -> None:
    x, w13, w2, b13, b2, weights, ids = _case(3, 16, 8, 4, 2)
    with pytest.raises(ValueError, match="w13_bias"):
        fused_moe_torch(x, w13, w2, weights, ids, b13[:, :4], b2)
    with pytest.raises(ValueError, match="activation"):
        fused_moe_torch(x, w13, w2, weights, ids, activation="gelu")


def test_custom_op_takes_the_extras() -> None:
    x, w13, w2, b13, b2, weights, ids = _case(7, 16, 8, 4, 2, seed=3)
    got = torch.ops.pagemill.fused_moe(x, w13, w2, weights, ids, b13, b2, "swigluoai", ALPHA, LIMIT)
    ref = _reference(x, w13, w2, b13, b2, weights, ids)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
