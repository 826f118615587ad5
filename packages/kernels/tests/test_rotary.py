"""Rotary embedding vs transformers' Llama rotary; Triton (interpreter) vs torch path."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from pagemill.kernels import apply_rotary, apply_rotary_torch, apply_rotary_triton, rope_cos_sin

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small so that low, medium (blended) and high frequencies all occur for head_dim 64.
    "original_max_position_embeddings": 64,
}
SCALINGS = [None, LLAMA3, {"rope_type": "linear", "factor": 4.0}]


def hf_rotary(theta: float, scaling: dict | None, head_dim: int = 64) -> LlamaRotaryEmbedding:
    params = (
        {"rope_type": "default", "rope_theta": theta}
        if scaling is None
        else {**scaling, "rope_theta": theta}
    )
    cfg = LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rope_parameters=params,
    )
    return LlamaRotaryEmbedding(config=cfg)


@pytest.mark.parametrize("scaling", SCALINGS, ids=["default", "llama3", "linear"])
def test_table_matches_transformers(scaling):
    theta = 500000.0 if scaling else 10000.0
    table = rope_cos_sin(64, 4096, theta, scaling)
    positions = torch.tensor([[0, 1, 7, 100, 2047, 4095]])
    cos, sin = hf_rotary(theta, scaling)(torch.zeros(1, 6, 64), positions)
    assert torch.equal(table[positions[0], :32], cos[0, :, :32])
    assert torch.equal(table[positions[0], 32:], sin[0, :, :32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["default", "llama3"])
def test_apply_matches_transformers(dtype, scaling):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 4, 64, generator=g).to(dtype)
    k = torch.randn(6, 2, 64, generator=g).to(dtype)
    positions = torch.tensor([5, 0, 3, 900, 17, 4000])
    theta = 500000.0
    cos, sin = hf_rotary(theta, scaling)(q, positions[None])
    # transformers wants [batch, heads, seq, dim]
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    out_q, out_k = apply_rotary_torch(positions, q, k, rope_cos_sin(64, 4096, theta, scaling))
    assert torch.equal(out_q, ref_q[0].transpose(0, 1))
    assert torch.equal(out_k, ref_k[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(4, 4, 16), (9, 3, 64), (6, 2, 24)]
)
def test_triton_matches_torch(interpreter, dtype, num_heads, num_kv_heads, head_dim):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(7, num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(7, num_kv_heads, head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 512, (7,), generator=g)
    table = rope_cos_sin(head_dim, 512, 10000.0, LLAMA3)
    tq, tk = apply_rotary_triton(positions, q, k, table)
    rq, rk = apply_rotary_torch(positions, q, k, table)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for a, b in ((tq, rq), (tk, rk)):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < tol


def test_inputs_untouched_and_dispatch():
    q, k = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    q0, k0 = q.clone(), k.clone()
    table = rope_cos_sin(8, 16, 10000.0)
    out = apply_rotary(torch.tensor([0, 4, 9]), q, k, table)
    assert torch.equal(q, q0) and torch.equal(k, k0)
    assert torch.equal(out[0][0], q[0])  # position 0 is the identity rotation


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="rope_type"):
        rope_cos_sin(64, 16, 10000.0, {"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="low_freq_factor"):
        rope_cos_sin(64, 16, 10000.0, {"rope_type": "llama3", "factor": 2.0})
    with pytest.raises(ValueError, match="even"):
        rope_cos_sin(7, 16, 10000.0)
    with pytest.raises(ValueError, match="cos_sin"):
        apply_rotary(
            torch.tensor([0]), torch.randn(1, 2, 8), torch.randn(1, 1, 8), torch.randn(4, 6)
        )
