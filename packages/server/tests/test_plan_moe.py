"""The planner on mixture-of-experts configs: parameters held vs read per token, against the
totals and active counts the model cards publish, and what a decode step streams."""

from __future__ import annotations

import json

import pytest

from pagemill.server.sim import RooflineCostModel, format_plan, load_gpu, load_model, make_plan

# The published config.json fields that size each model (Hugging Face model repos).
CONFIGS = {
    "Qwen3-30B-A3B": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
    "Mixtral-8x7B-v0.1": dict(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=32000,
        tie_word_embeddings=False,
    ),
    "OLMoE-1B-7B-0924": dict(
        architectures=["OlmoeForCausalLM"],
        model_type="olmoe",
        hidden_size=2048,
        intermediate_size=1024,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        num_experts=64,
        num_experts_per_tok=8,
        vocab_size=50304,
        tie_word_embeddings=False,
    ),
}
# (total, active) as the model cards state them, in billions.
PUBLISHED = {
    "Qwen3-30B-A3B": (30.5, 3.3),
    "Mixtral-8x7B-v0.1": (46.7, 12.9),
    "OLMoE-1B-7B-0924": (6.9, 1.3),
}


def _spec(tmp_path, name):
    path = tmp_path / name / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(CONFIGS[name]))
    return load_model(path)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_held_and_active_params_match_the_model_cards(tmp_path, name) -> None:
    spec = _spec(tmp_path, name)
    total, active = PUBLISHED[name]
    assert spec.num_params / 1e9 == pytest.approx(total, rel=0.02)
    assert spec.active_params / 1e9 == pytest.approx(active, rel=0.04)


def test_decode_streams_the_picked_experts_and_computes_on_active(tmp_path) -> None:
    spec = _spec(tmp_path, "Qwen3-30B-A3B")
    cost = RooflineCostModel(spec, load_gpu("h200"))
    one = cost.decode_step(1, 1024)
    # One token reads its 8 experts of 128 per layer: the active weights, not all held.
    assert one.weight_bytes == pytest.approx(spec.active_params * 2, rel=1e-6)
    assert one.weight_bytes < cost.weight_bytes / 5
    # A large batch touches (nearly) every expert.
    big = cost.decode_step(256, 1024)
    assert big.weight_bytes == pytest.approx(cost.weight_bytes, rel=0.01)
    assert cost.flops_per_token == 2.0 * spec.active_params
    plan = make_plan(spec, load_gpu("h200"))
    assert plan.weight_bytes == spec.num_params * 2  # memory holds every expert
    text = format_plan(plan)
    assert "8 of 128 experts" in text and "active per token" in text
    assert plan.as_dict()["active_params"] == spec.active_params


def test_other_moe_layouts_are_refused_by_name(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(dict(CONFIGS["Mixtral-8x7B-v0.1"], model_type="deepseek_v3", n_routed_experts=8))
    )
    with pytest.raises(ValueError, match="mixture-of-experts configs other than"):
        load_model(path)


def test_gpt_oss_20b_params_match_the_model_card(tmp_path) -> None:
    """gpt-oss-20b's config.json: 21B held, 3.6B active — OpenAI's count of active
    parameters leaves out the embedding table (the unembedding is in), the planner reads
    both per token (as the Qwen3 card counts them)."""
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            dict(
                architectures=["GptOssForCausalLM"],
                model_type="gpt_oss",
                hidden_size=2880,
                intermediate_size=2880,
                num_hidden_layers=24,
                num_attention_heads=64,
                num_key_value_heads=8,
                head_dim=64,
                num_local_experts=32,
                num_experts_per_tok=4,
                sliding_window=128,
                attention_bias=True,
                vocab_size=201088,
                tie_word_embeddings=False,
            )
        )
    )
    spec = load_model(path)
    assert spec.num_params / 1e9 == pytest.approx(21, rel=0.02)
    embedding = 201088 * 2880
    assert (spec.active_params - embedding) / 1e9 == pytest.approx(3.6, rel=0.04)
