"""Long-context RoPE (yarn, longrope, dynamic NTK) in whole models equals transformers.

Tiny random models whose original context is 32 tokens, run far past it: logits at every
position, then greedy generation through the engine with chunked prefill, prefix-cache
hits and preemption, in fp32 against `generate`. Where pagemill's choice for a batched,
paged engine differs from transformers' per-call behaviour (see `pagemill.kernels.rotary`),
the tests pin down exactly which cases are equal — and that the others are not.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagemill.runtime import LLM, SamplingParams
from pagemill.runtime.config import ModelConfig
from pagemill.runtime.model_executor.loader import load_model
from pagemill.runtime.worker.model_runner import ModelRunner

GREEDY = dict(temperature=0.0, ignore_eos=True)
ORIGINAL = 32

YARN = dict(
    # Qwen2.5's recipe: max_position_embeddings stays the original, yarn reaches 4x past it.
    max_position_embeddings=ORIGINAL,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
        "rope_theta": 10000.0,
    },
)
# Phi-3.5 / Phi-4-mini layout: original context beside the RoPE keys, partial rotary (8 of
# 16 dims: 4 factors each), the attention factor from max_position_embeddings / original.
LONGROPE = dict(
    max_position_embeddings=256,
    original_max_position_embeddings=ORIGINAL,
    partial_rotary_factor=0.5,
    rope_parameters={
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0, 1.1, 1.3, 1.7],
        "long_factor": [1.0, 2.5, 6.0, 15.0],
    },
)
DYNAMIC = dict(
    max_position_embeddings=ORIGINAL,
    rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
)


def _runner(folder: Path, max_position: int) -> ModelRunner:
    config = ModelConfig.from_pretrained(folder)
    model = load_model(folder, config, torch.float32, torch.device("cpu"), max_position)
    runner = ModelRunner(
        model, config, torch.device("cpu"), torch.float32, 16, 8, 512, max_position
    )
    runner.init_kv_cache(64)
    return runner


def _hf_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


def _hf_stepwise_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """Logits at every position with one token per forward, as `generate` decodes."""
    past, rows = None, []
    with torch.no_grad():
        for i, t in enumerate(tokens):
            out = model(
                torch.tensor([[t]]),
                past_key_values=past,
                use_cache=True,
                position_ids=torch.tensor([[i]]),
            )
            past = out.past_key_values
            rows.append(out.logits[0, -1])
    return torch.stack(rows)


def _small_pool(folder: Path, blocks: int, **kwargs) -> LLM:
    """An engine whose KV pool holds `blocks` blocks (too few for the batch: preemption)."""
    probe = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=1 << 20)
    block_bytes = (1 << 20) // probe.llm_engine.num_blocks
    del probe
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=blocks * block_bytes, **kwargs)
    assert llm.llm_engine.num_blocks == blocks
    return llm


def _generate_matches_hf(llm, model, prompts, max_tokens, hf_greedy) -> None:
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, m, out in zip(prompts, max_tokens, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, m), (
            f"prompt of {len(prompt)} tokens diverged"
        )


# ---- yarn ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def yarn_model(tmp_path_factory, build_tiny_model) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("tiny-yarn")
    return folder, build_tiny_model(folder, "qwen3", seed=3, head_dim=32, **YARN)


def test_yarn_reaches_factor_times_the_original_context(yarn_model) -> None:
    folder, _ = yarn_model
    config = ModelConfig.from_pretrained(folder)
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "yarn"
    assert config.max_model_len_limit == 4 * ORIGINAL
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=1 << 20)
    assert llm.llm_engine.max_model_len == 4 * ORIGINAL


def test_yarn_logits_match_transformers(yarn_model, random_prompts, all_logits) -> None:
    folder, model = yarn_model
    runner = _runner(folder, 4 * ORIGINAL)
    prompts = random_prompts([1, 20, 40, 120], model.config.vocab_size, seed=11)
    for prompt, got in zip(prompts, all_logits(runner, prompts)):
        torch.testing.assert_close(got, _hf_logits(model, prompt), rtol=1e-4, atol=1e-4)


def test_yarn_generation_past_the_original_context(yarn_model, hf_greedy, random_prompts) -> None:
    """Chunked prefill (16-token budget), a shared prefix and a pool too small for the
    batch, with every request ending past the original 32 tokens."""
    folder, model = yarn_model
    vocab = model.config.vocab_size
    prefix = random_prompts([36], vocab, seed=5)[0]
    prompts = [prefix + s for s in random_prompts([1, 9], vocab, seed=6)]
    prompts += random_prompts([70, 5, 30], vocab, seed=7)
    llm = _small_pool(folder, 12, max_num_batched_tokens=16)
    llm.generate([[*prefix, 7]], SamplingParams(max_tokens=1, **GREEDY), use_tqdm=False)
    _generate_matches_hf(llm, model, prompts, [20, 30, 25, 40, 30], hf_greedy)
    stats = llm.llm_engine.get_stats()
    assert stats.prefix_cache_hits >= 32 and stats.num_preemptions > 0


# ---- longrope --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def longrope_model(tmp_path_factory, build_tiny_model) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("tiny-longrope")
    return folder, build_tiny_model(folder, "phi3", seed=4, **LONGROPE)


def test_longrope_config_loads_as_phi3_5_does(longrope_model) -> None:
    folder, _ = longrope_model
    config = ModelConfig.from_pretrained(folder)
    scaling = config.rope_scaling
    assert scaling is not None and scaling["rope_type"] == "longrope"
    assert scaling["original_max_position_embeddings"] == ORIGINAL
    assert scaling["factor"] == 256 / ORIGINAL  # filled in as transformers computes it
    assert config.max_model_len_limit == 256


def test_longrope_long_prompts_match_transformers(
    longrope_model, random_prompts, all_logits, hf_greedy
) -> None:
    """Served up to 256 tokens, every position takes the long factors: what transformers
    does for a prompt longer than the original context, and for all it generates after."""
    folder, model = longrope_model
    runner = _runner(folder, 256)
    prompts = random_prompts([33, 40, 100], model.config.vocab_size, seed=11)
    for prompt, got in zip(prompts, all_logits(runner, prompts)):
        torch.testing.assert_close(got, _hf_logits(model, prompt), rtol=1e-4, atol=1e-4)
    # A short prompt is where transformers uses the short factors and this engine not.
    short = random_prompts([20], model.config.vocab_size, seed=12)[0]
    assert not torch.allclose(all_logits(runner, [short])[0], _hf_logits(model, short))
    # Any served length past the original context takes the long factors: 128 here.
    llm = _small_pool(folder, 12, max_num_batched_tokens=16, max_model_len=128)
    prompts = random_prompts([70, 33, 45, 60], model.config.vocab_size, seed=13)
    _generate_matches_hf(llm, model, prompts, [25, 30, 20, 30], hf_greedy)
    assert llm.llm_engine.get_stats().num_preemptions > 0


def test_longrope_within_the_original_context_uses_the_short_factors(
    longrope_model, random_prompts, hf_greedy
) -> None:
    """--max-model-len within the original context: transformers' short-factor rotation."""
    folder, model = longrope_model
    llm = LLM(
        str(folder),
        dtype="float32",
        max_model_len=ORIGINAL,
        max_num_batched_tokens=16,
        kv_cache_memory_bytes=1 << 20,
    )
    prompts = random_prompts([5, 20, 12], model.config.vocab_size, seed=14)
    _generate_matches_hf(llm, model, prompts, [27, 12, 20], hf_greedy)


# ---- dynamic NTK ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dynamic_model(tmp_path_factory, build_tiny_model) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("tiny-dynamic")
    return folder, build_tiny_model(folder, "llama", seed=5, **DYNAMIC)


def test_dynamic_equals_transformers_decoding_token_by_token(
    dynamic_model, random_prompts, all_logits
) -> None:
    """Each position is rotated as transformers rotates it when it decodes that token: so a
    60-token prefill here equals transformers fed the same tokens one at a time."""
    folder, model = dynamic_model
    assert ModelConfig.from_pretrained(folder).max_model_len_limit == 2 * ORIGINAL
    runner = _runner(folder, 2 * ORIGINAL)
    tokens = random_prompts([60], model.config.vocab_size, seed=15)[0]
    got = all_logits(runner, [tokens])[0]
    torch.testing.assert_close(got, _hf_stepwise_logits(model, tokens), rtol=1e-4, atol=1e-4)
    # transformers' one-call prefill of the same 60 tokens rescales them all to 60: not equal.
    assert not torch.allclose(got[ORIGINAL:], _hf_logits(model, tokens)[ORIGINAL:])


def test_dynamic_generation_past_the_original_context(
    dynamic_model, random_prompts, hf_greedy
) -> None:
    """Prompts within the original context, generations far past it: token for token, with
    chunked prefill and preemption."""
    folder, model = dynamic_model
    llm = _small_pool(folder, 10, max_num_batched_tokens=16)
    prompts = random_prompts([5, 20, 31, 12], model.config.vocab_size, seed=16)
    _generate_matches_hf(llm, model, prompts, [40, 40, 30, 45], hf_greedy)
    assert llm.llm_engine.get_stats().num_preemptions > 0


# ---- configs as published -------------------------------------------------------------------


def _published(**kw) -> dict:
    """A config.json's keys as the Hub files spell them (read without transformers)."""
    base = dict(
        vocab_size=64,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
    )
    return {**base, **kw}


@pytest.mark.parametrize("rope_type", ["longrope", "su"])
def test_phi4_mini_and_phi3_5_configs_load(rope_type) -> None:
    """Phi-4-mini's layout (Phi-3.5-mini's is the same with full rotary): ``rope_scaling``
    with the old ``type`` key, the original context beside it, partial rotary."""
    rotary = 24  # head_dim 32 x partial_rotary_factor 0.75
    raw = _published(
        architectures=["Phi3ForCausalLM"],
        model_type="phi3",
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        partial_rotary_factor=0.75,
        rope_theta=10000.0,
        rope_scaling={
            "type": rope_type,
            "short_factor": [1.0] * (rotary // 2),
            "long_factor": [1.0 + i for i in range(rotary // 2)],
        },
    )
    config = ModelConfig.from_dict(raw)
    assert config.rotary_dim == rotary and config.max_model_len_limit == 131072
    scaling = config.rope_scaling
    assert scaling is not None and scaling["rope_type"] == "longrope"
    assert scaling["factor"] == 32.0 and scaling["original_max_position_embeddings"] == 4096
    from pagemill.kernels import rope_cos_sin

    table = rope_cos_sin(rotary, 8192, config.rope_theta, scaling)
    attention = (1 + torch.log(torch.tensor(32.0)) / torch.log(torch.tensor(4096.0))).sqrt()
    torch.testing.assert_close(table[0, :12], attention.expand(12))  # cos 0 x factor
    assert not torch.allclose(table, rope_cos_sin(rotary, 8192, config.rope_theta))


def test_qwen2_5_yarn_config_reaches_128k() -> None:
    """Qwen2.5's documented recipe: ``rope_scaling`` {type yarn, factor 4, original 32768}."""
    raw = _published(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    )
    config = ModelConfig.from_dict(raw)
    assert config.max_model_len_limit == 131072
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "yarn"
    dynamic = ModelConfig.from_dict(
        _published(
            model_type="llama",
            max_position_embeddings=2048,
            rope_scaling={"type": "dynamic", "factor": 2.0},
        )
    )
    assert dynamic.rope_scaling == {
        "rope_type": "dynamic",
        "factor": 2.0,
        "max_position_embeddings": 2048,
    }
    assert dynamic.max_model_len_limit == 4096


def test_unknown_rope_type_is_refused_with_the_config() -> None:
    from pagemill.kernels.rotary import ROPE_TYPES
    from pagemill.runtime.model_config import SUPPORTED_ROPE_TYPES

    assert SUPPORTED_ROPE_TYPES == ROPE_TYPES  # the torch-free copy of the kernels' list
    raw = _published(model_type="llama", rope_scaling={"rope_type": "mrope", "factor": 2.0})
    with pytest.raises(ValueError, match=r"'mrope'.*yarn, longrope, dynamic"):
        ModelConfig.from_dict(raw)
