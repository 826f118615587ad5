"""The planner's arithmetic against the numbers everyone quotes."""

from __future__ import annotations

import json
import math

import pytest

from pagemill.blockpool import kv_bytes_per_token
from pagemill.server.sim import (
    RooflineCostModel,
    estimate_activation_bytes,
    format_plan,
    known_gpus,
    known_models,
    load_gpu,
    load_model,
    make_plan,
)

# Published parameter counts (model cards / safetensors index totals).
PUBLISHED_PARAMS = {
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "mistral-7b": 7_248_023_552,
    "qwen2.5-7b": 7_615_616_512,
    "smollm2-135m": 134_515_008,
}


def test_shipped_data_covers_the_issue() -> None:
    assert set(PUBLISHED_PARAMS) <= set(known_models())
    assert {"h100", "h200", "a100-80g", "l40s", "rtx-4090"} <= set(known_gpus())


@pytest.mark.parametrize(("name", "params"), sorted(PUBLISHED_PARAMS.items()))
def test_param_count_from_shape(name: str, params: int) -> None:
    assert load_model(name).num_params == params


def test_llama_8b_kv_bytes_per_token() -> None:
    cost = RooflineCostModel(load_model("llama-3.1-8b"), load_gpu("h200"))
    assert cost.kv_bytes_per_token == 131_072
    m = load_model("Llama-3.1-8B")  # names are case-insensitive
    assert kv_bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim, "bf16") == 131_072
    fp8 = RooflineCostModel(m, load_gpu("h200"), kv_dtype="fp8")
    assert fp8.kv_bytes_per_token == 65_536


def test_h200_streams_16gb_of_weights_in_about_3_3_ms() -> None:
    cost = RooflineCostModel(load_model("llama-3.1-8b"), load_gpu("h200"))
    assert cost.weight_bytes == 2 * 8_030_261_248
    assert 16.0e9 < cost.weight_bytes < 16.1e9
    assert cost.weight_stream_time_s() == pytest.approx(16.06e9 / 4.8e12, rel=1e-3)
    assert 3.2e-3 < cost.weight_stream_time_s() < 3.4e-3


def test_crossover_batch_is_peak_over_twice_bandwidth_per_weight_byte() -> None:
    gpu = load_gpu("h200")
    cost = RooflineCostModel(load_model("llama-3.1-8b"), gpu)
    expected = gpu.bf16_flops / (2 * gpu.bandwidth_bytes_per_s) * 2  # 2 bytes per bf16 weight
    assert cost.crossover_batch() == pytest.approx(expected)
    assert 150 < cost.crossover_batch() < 300  # "on the order of 200"
    # At the crossover the two sides of the roofline meet (context 0: weights only).
    b = cost.crossover_batch()
    flops = b * cost.flops_per_token
    assert flops / gpu.bf16_flops == pytest.approx(cost.weight_bytes / gpu.bandwidth_bytes_per_s)
    # Smaller weights move the crossover proportionally: int8 halves it.
    int8 = RooflineCostModel(load_model("llama-3.1-8b"), gpu, weight_dtype="int8")
    assert int8.crossover_batch() == pytest.approx(expected / 2)


def test_long_context_decode_never_becomes_compute_bound() -> None:
    cost = RooflineCostModel(load_model("llama-3.1-8b"), load_gpu("h200"))
    assert cost.crossover_batch(8192) is None
    short = cost.crossover_batch(128)
    assert short is not None and short > cost.crossover_batch()


def test_roofline_sides() -> None:
    cost = RooflineCostModel(load_model("llama-3.1-8b"), load_gpu("h100"))
    one = cost.decode_step(1, 16)
    assert one.bound == "memory"
    assert one.time_s == pytest.approx(one.memory_time_s)
    big = cost.decode_step(1024, 16)
    assert big.bound == "compute"
    prefill = cost.step_cost([(4096, 4096)])
    assert prefill.bound == "compute"
    # Weights are streamed once per step, not once per sequence.
    assert big.weight_bytes == one.weight_bytes == cost.weight_bytes
    assert big.kv_bytes == 1024 * one.kv_bytes
    with pytest.raises(ValueError, match="bad chunk"):
        cost.step_cost([(5, 3)])


def test_attention_flops_causal_count() -> None:
    m = load_model("smollm2-135m")
    per_key = 4 * m.num_layers * m.num_heads * m.head_dim
    assert m.attention_flops(1, 10) == per_key * 10
    assert m.attention_flops(3, 3) == per_key * (1 + 2 + 3)


def test_plan_pool_arithmetic() -> None:
    model, gpu = load_model("llama-3.1-8b"), load_gpu("h200")
    reserve = 2 * 1024**3
    plan = make_plan(model, gpu, context_len=8192, activation_reserve_bytes=reserve)
    usable = int(gpu.memory_bytes * 0.9)
    budget = usable - 2 * model.num_params - reserve
    assert plan.kv_budget_bytes == budget
    assert plan.num_blocks == budget // (16 * 131_072)
    assert plan.kv_token_capacity == plan.num_blocks * 16
    assert plan.max_concurrent_seqs == plan.num_blocks // (8192 // 16)
    assert plan.max_context_tokens == min(plan.kv_token_capacity, 131_072)
    assert plan.fits
    text = format_plan(plan)
    assert "131,072" in text and "3.35 ms" in text
    json.dumps(plan.as_dict())  # serialisable


def test_plan_default_activation_reserve_grows_with_budget() -> None:
    m = load_model("llama-3.1-8b")
    small = estimate_activation_bytes(m, 512, 64)
    big = estimate_activation_bytes(m, 8192, 256)
    assert 0 < small < big < 8 * 1024**3


def test_70b_bf16_does_not_fit_one_h100() -> None:
    plan = make_plan(load_model("llama-3.1-70b"), load_gpu("h100"))
    assert not plan.fits
    assert plan.num_blocks == 0 and plan.max_concurrent_seqs == 0
    assert "DOES NOT FIT" in format_plan(plan)
    int4 = make_plan(load_model("llama-3.1-70b"), load_gpu("h100"), weight_dtype="int4")
    assert int4.fits and int4.weight_bytes == pytest.approx(70.55e9 / 2, rel=1e-3)


def test_hf_config_json_path(tmp_path) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "max_position_embeddings": 8192,
    }
    folder = tmp_path / "my-smol"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    for where in (folder, folder / "config.json", str(folder / "config.json")):
        spec = load_model(where)
        assert spec.name == "my-smol"
        assert spec.num_params == PUBLISHED_PARAMS["smollm2-135m"]
        assert spec.head_dim == 64
    qwen = dict(config, model_type="qwen2", tie_word_embeddings=False)
    (folder / "config.json").write_text(json.dumps(qwen))
    assert load_model(folder).qkv_bias


def test_bad_inputs_have_clear_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown model"):
        load_model("gpt-5")
    with pytest.raises(ValueError, match="unknown GPU"):
        load_gpu("voodoo2")
    moe = tmp_path / "config.json"
    moe.write_text(json.dumps({"num_local_experts": 8, "hidden_size": 4096}))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        load_model(moe)
    moe.write_text(json.dumps({"hidden_size": 4096}))
    with pytest.raises(ValueError, match="lacks"):
        load_model(moe)
    moe.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model(moe)
    with pytest.raises(ValueError, match="weight dtype"):
        RooflineCostModel(load_model("smollm2-135m"), load_gpu("h100"), weight_dtype="int3")
    with pytest.raises(ValueError, match="KV dtype"):
        make_plan(load_model("smollm2-135m"), load_gpu("h100"), kv_dtype="int3")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        make_plan(load_model("smollm2-135m"), load_gpu("h100"), gpu_memory_utilization=1.5)


def test_custom_gpu_json(tmp_path) -> None:
    path = tmp_path / "mygpu.json"
    path.write_text(
        json.dumps(
            {"memory_bytes": 16 * 1024**3, "bandwidth_bytes_per_s": 5e11, "bf16_flops": 1e14}
        )
    )
    gpu = load_gpu(path)
    assert gpu.name == "mygpu" and gpu.memory_bytes == 16 * 1024**3
    cost = RooflineCostModel(load_model("smollm2-135m"), gpu)
    assert math.isclose(cost.crossover_batch(), 1e14 / 5e11)
