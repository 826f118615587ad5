"""Fused MoE: routing against torch.softmax/topk, the CPU path and the Triton kernel
(interpreter) against a per-token gather reference written with plain einsums."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagemill.kernels import (
    fused_moe,
    fused_moe_torch,
    fused_moe_triton,
    moe_align_block_size,
    topk_softmax,
)


def _reference(x, w13, w2, weights, ids):
    """Every (token, slot) pair with its own gathered expert weights: no sorting at all."""
    xf, w13f, w2f = x.float(), w13.float(), w2.float()
    inter = w2.shape[-1]
    gu = torch.einsum("th,tknh->tkn", xf, w13f[ids])
    act = F.silu(gu[..., :inter]) * gu[..., inter:]
    return (torch.einsum("tki,tkhi->tkh", act, w2f[ids]) * weights.float()[..., None]).sum(1)


def _case(t, h, inter, e, k, dtype=torch.float32, seed=0, logits=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(dtype)
    if logits is None:
        logits = torch.randn(t, e, generator=g)
    weights, ids = topk_softmax(logits, k, renormalize=True)
    return x, w13, w2, weights, ids


def test_topk_softmax_is_softmax_then_topk_with_its_ties() -> None:
    # Integer logits with many equal values: ties go where torch.topk puts them.
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    weights, ids = topk_softmax(logits, 2, renormalize=False)
    ref_w, ref_ids = torch.topk(torch.softmax(logits, -1), 2, dim=-1)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_w)
    norm_w, norm_ids = topk_softmax(logits, 3, renormalize=True)
    torch.testing.assert_close(norm_w.sum(-1), torch.ones(2))
    assert torch.equal(norm_ids, torch.topk(torch.softmax(logits, -1), 3, dim=-1).indices)
    bf = topk_softmax(logits.bfloat16(), 2, renormalize=False)[0]
    assert bf.dtype == torch.float32  # softmax in fp32 whatever the logits' dtype


@pytest.mark.parametrize(("t", "e", "k"), [(1, 8, 2), (13, 6, 3), (40, 16, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_matches_reference(t, e, k, dtype) -> None:
    x, w13, w2, weights, ids = _case(t, 32, 24, e, k, dtype)
    got = fused_moe_torch(x, w13, w2, weights, ids)
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    ref = _reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol)
    assert torch.equal(fused_moe(x, w13, w2, weights, ids), got)  # CPU dispatch


def test_all_tokens_to_one_expert() -> None:
    logits = torch.zeros(9, 6)
    logits[:, 4] = 50.0  # expert 4 first for everyone; the second pick is a 5-way tie
    x, w13, w2, weights, ids = _case(9, 32, 16, 6, 2, logits=logits)
    assert (ids[:, 0] == 4).all()
    got = fused_moe_torch(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, _reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    # The unused experts' weights are never read: poisoning them changes nothing.
    used = set(ids.unique().tolist())
    poisoned = w13.clone()
    for j in set(range(6)) - used:
        poisoned[j] = float("nan")
    assert torch.equal(fused_moe_torch(x, poisoned, w2, weights, ids), got)


def test_align_block_size_pads_each_expert_run() -> None:
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    sorted_ids, expert_ids, total = moe_align_block_size(ids, 4, 4)
    # Flat pairs [2, 0, 2, 1, 0, 2]: expert 0 has pairs 1, 4; expert 1 pair 3; expert 2
    # pairs 0, 2, 5; expert 3 none.
    pad = ids.numel()
    assert sorted_ids.tolist()[:12] == [1, 4, pad, pad, 3, pad, pad, pad, 0, 2, 5, pad]
    assert expert_ids.tolist()[:3] == [0, 1, 2] and set(expert_ids.tolist()[3:]) <= {-1}
    assert total.tolist() == [12]


@pytest.mark.parametrize(
    ("t", "h", "inter", "e", "k", "block_m"),
    [(1, 32, 16, 4, 2, 16), (19, 48, 40, 6, 2, 16), (33, 64, 32, 8, 3, 32)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference(interpreter, t, h, inter, e, k, block_m, dtype) -> None:
    x, w13, w2, weights, ids = _case(t, h, inter, e, k, dtype, seed=t)
    got = fused_moe_triton(x, w13, w2, weights, ids, block_m=block_m)
    ref = _reference(x, w13, w2, weights, ids)
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol)


def test_triton_all_tokens_to_one_expert(interpreter) -> None:
    logits = torch.zeros(21, 5)
    logits[:, 1] = 50.0
    x, w13, w2, weights, ids = _case(21, 32, 16, 5, 1, logits=logits)
    got = fused_moe_triton(x, w13, w2, weights, ids, block_m=16)
    torch.testing.assert_close(got, _reference(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-4)


def test_shape_errors() -> None:
    x, w13, w2, weights, ids = _case(3, 32, 16, 4, 2)
    with pytest.raises(ValueError, match="disagree"):
        fused_moe_torch(x[:, :16], w13, w2, weights, ids)
