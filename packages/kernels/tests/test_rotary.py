"""Rotary embedding vs transformers' own rotary modules (Llama's, Phi-3's for longrope) for
every scaling, at positions past the original context; Triton (interpreter) vs torch path."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from pagemill.kernels import apply_rotary, apply_rotary_torch, apply_rotary_triton, rope_cos_sin
from pagemill.kernels.rotary import apply_rotary_qk

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small so that low, medium (blended) and high frequencies all occur for head_dim 64.
    "original_max_position_embeddings": 64,
}
SCALINGS = [None, LLAMA3, {"rope_type": "linear", "factor": 4.0}]
# Qwen2.5/Qwen3-style YaRN (the attention factor from `factor`), DeepSeek-style mscale
# ratio, an explicit attention factor with untruncated ramp bounds.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
YARNS = {
    "yarn": YARN,
    "yarn-mscale": {**YARN, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707},
    "yarn-untruncated": {
        **YARN,
        "attention_factor": 1.3,
        "beta_fast": 16,
        "beta_slow": 2,
        "truncate": False,
    },
}


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


def hf_rows(rotary: torch.nn.Module, positions: list[int], head_dim: int = 64) -> torch.Tensor:
    """transformers' cos|sin for each position, one forward per position as `generate`
    decodes (the dynamic scalings recompute their frequencies from the length each time)."""
    rows = []
    for p in positions:
        cos, sin = rotary(torch.zeros(1, 1, head_dim), torch.tensor([[p]]))
        rows.append(torch.cat((cos[0, 0, : head_dim // 2], sin[0, 0, : head_dim // 2])))
    return torch.stack(rows)


def ours(cfg, head_dim: int, max_position: int) -> torch.Tensor:
    """pagemill's table from a transformers config's rope_parameters (the keys pagemill's
    ModelConfig fills in: factor, dynamic's max_position_embeddings)."""
    params = dict(cfg.rope_parameters)
    theta = params.pop("rope_theta")
    params.pop("partial_rotary_factor", None)
    if params["rope_type"] in ("yarn", "longrope") and params.get("factor") is None:
        params["factor"] = cfg.max_position_embeddings / params["original_max_position_embeddings"]
    if params["rope_type"] == "dynamic":
        params["max_position_embeddings"] = cfg.max_position_embeddings
    return rope_cos_sin(head_dim, max_position, theta, params)


@pytest.mark.parametrize("name", list(YARNS))
def test_yarn_matches_transformers(name):
    rotary = hf_rotary(10000.0, YARNS[name])
    table = ours(rotary.config, 64, 1024)
    positions = [0, 1, 5, 63, 64, 100, 255, 1023]  # the original context is 64
    assert torch.equal(table[positions], hf_rows(rotary, positions))
    # The attention factor is applied: a row's cos^2 + sin^2 is its square.
    assert rotary.attention_scaling != 1.0
    norm = table[100, :32] ** 2 + table[100, 32:] ** 2
    torch.testing.assert_close(norm, torch.full_like(norm, rotary.attention_scaling**2))


@pytest.mark.parametrize(("theta", "factor"), [(10000.0, 2.0), (5000.0, 3.3)])
def test_dynamic_matches_transformers_row_by_row(theta, factor):
    """Row p equals transformers' rotation of the token at p while decoding, its base
    rescaled to the length p + 1 once that passes max_position_embeddings (64)."""
    params = {"rope_type": "dynamic", "factor": factor, "rope_theta": theta}
    cfg = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        head_dim=64,
        max_position_embeddings=64,
        rope_parameters=params,
    )
    table = ours(cfg, 64, 300)
    rotary = LlamaRotaryEmbedding(config=cfg)
    positions = list(range(300))  # in order: transformers' frequencies only grow
    assert torch.equal(table, hf_rows(rotary, positions))
    # Below the original length it is plain RoPE; past it, not.
    plain = rope_cos_sin(64, 300, theta)
    assert torch.equal(table[:64], plain[:64]) and not torch.equal(table[64:], plain[64:])


def _phi3_longrope(head_dim: int = 64) -> Phi3Config:
    rng = random.Random(0)
    half = head_dim // 2
    return Phi3Config(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        original_max_position_embeddings=64,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1 + rng.random() for _ in range(half)],
            "long_factor": [1 + 5 * rng.random() for _ in range(half)],
        },
    )


def test_longrope_matches_transformers_short_and_long():
    """A table that fits the original context (64) is transformers' short-factor rotation;
    a longer one its long-factor rotation — at every position, with Phi-3's attention
    factor sqrt(1 + ln(512/64) / ln(64)) on both."""
    cfg = _phi3_longrope()
    rotary = Phi3RotaryEmbedding(config=cfg)
    assert rotary.attention_scaling > 1.0
    short = ours(cfg, 64, 64)
    assert torch.equal(short, hf_rows(rotary, list(range(64))))
    long = ours(cfg, 64, 512)
    # transformers takes the long factors once the sequence passes 64 tokens; a paged
    # engine serving up to 512 uses them throughout (see pagemill.kernels.rotary).
    assert torch.equal(long[64:], hf_rows(rotary, list(range(64, 512))))
    long_inv, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, None, seq_len=65)
    expect = torch.arange(64).float()[:, None] * long_inv[None, :]
    scale = rotary.attention_scaling
    torch.testing.assert_close(long[:64, :32], expect.cos() * scale, rtol=0, atol=1e-6)
    assert not torch.allclose(long[:64], short)


def test_partial_rotary_longrope_has_half_the_factors():
    cfg = _phi3_longrope(head_dim=32)  # 16 factors: a rotary dim of 32
    with pytest.raises(ValueError, match="needs 8"):
        ours(cfg, 16, 512)


@pytest.mark.parametrize("scaling", SCALINGS, ids=["default", "llama3", "linear"])
def test_table_matches_transformers(scaling):
    theta = 500000.0 if scaling else 10000.0
    table = rope_cos_sin(64, 4096, theta, scaling)
    positions = torch.tensor([[0, 1, 7, 100, 2047, 4095]])
    cos, sin = hf_rotary(theta, scaling)(torch.zeros(1, 6, 64), positions)
    assert torch.equal(table[positions[0], :32], cos[0, :, :32])
    assert torch.equal(table[positions[0], 32:], sin[0, :, :32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [None, LLAMA3, YARN], ids=["default", "llama3", "yarn"])
def test_apply_matches_transformers(dtype, scaling):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 4, 64, generator=g).to(dtype)
    k = torch.randn(6, 2, 64, generator=g).to(dtype)
    positions = torch.tensor([5, 0, 3, 900, 17, 4000])
    theta = 500000.0
    cos, sin = hf_rotary(theta, scaling)(q, positions[None])
    # transformers wants [batch, heads, seq, dim]
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    table = ours(hf_rotary(theta, scaling).config, 64, 4096)
    out_q, out_k = apply_rotary_torch(positions, q, k, table)
    assert torch.equal(out_q, ref_q[0].transpose(0, 1))
    assert torch.equal(out_k, ref_k[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "scaling"),
    [
        (4, 4, 16, LLAMA3),
        (9, 3, 64, YARNS["yarn-mscale"]),
        (6, 2, 24, {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 64}),
        (
            4,
            2,
            16,
            {
                "rope_type": "longrope",
                "factor": 8.0,
                "original_max_position_embeddings": 64,
                "short_factor": [1.0 + i / 8 for i in range(8)],
                "long_factor": [1.0 + i for i in range(8)],
            },
        ),
    ],
    ids=["llama3", "yarn", "dynamic", "longrope"],
)
def test_triton_matches_torch(interpreter, dtype, num_heads, num_kv_heads, head_dim, scaling):
    """The kernel reads the table whatever built it: every scaling (the attention factor
    included) goes through it unchanged."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(7, num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(7, num_kv_heads, head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 512, (7,), generator=g)
    table = rope_cos_sin(head_dim, 512, 10000.0, scaling)
    tq, tk = apply_rotary_triton(positions, q, k, table)
    rq, rk = apply_rotary_torch(positions, q, k, table)
    # bf16: the interpreter's bf16 rounding differs from torch's in about one element in
    # two by an ulp (~1% in norm, unscaled tables too); a wrong table is off by O(1).
    tol = 1e-6 if dtype == torch.float32 else 2e-2
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
        rope_cos_sin(64, 16, 10000.0, {"rope_type": "mrope", "factor": 2.0})
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        rope_cos_sin(64, 16, 10000.0, {"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="max_position_embeddings"):
        rope_cos_sin(64, 16, 10000.0, {"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="low_freq_factor"):
        rope_cos_sin(64, 16, 10000.0, {"rope_type": "llama3", "factor": 2.0})
    with pytest.raises(ValueError, match="even"):
        rope_cos_sin(7, 16, 10000.0)
    with pytest.raises(ValueError, match="cos_sin"):
        apply_rotary(
            torch.tensor([0]), torch.randn(1, 2, 8), torch.randn(1, 1, 8), torch.randn(4, 6)
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_qk_together_equals_separate(dtype):
    """q and k rotated as one tensor of heads (a fused projection's layout) equal
    `apply_rotary_torch` on each, bit for bit, whatever the positions."""
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(5, (9 + 3 + 3) * 64, generator=g).to(dtype)
    qk = qkv[:, : 12 * 64].reshape(5, 12, 64)
    positions = torch.tensor([0, 7, 63, 1000, 4095])
    table = rope_cos_sin(64, 4096, 100000.0)
    q, k = apply_rotary_qk(positions, qk, 9, table)
    rq, rk = apply_rotary_torch(positions, qk[:, :9], qk[:, 9:], table)
    assert q.shape == (5, 9, 64) and k.shape == (5, 3, 64)
    assert torch.equal(q, rq) and torch.equal(k, rk)
    with pytest.raises(ValueError, match="H \\+ KVH"):
        apply_rotary_qk(positions, qk, 12, table)
