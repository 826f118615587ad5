"""Qwen3, Phi-3, Gemma 2, Gemma 3, windowed Mistral, SmolLM3, OLMo 2 and Granite equal
transformers, token for token.

Each family is a tiny random model built by transformers from a config here, most with a
small sliding window (9-12 tokens, not a multiple of the 16-token block) so that prompts
run far past it (OLMo 2 and Granite have none): logits at every prompt position through
the paged cache, then greedy generation through the engine with chunked prefill (a
16-token budget), prefix-cache hits and preemption (a KV pool too small for the batch),
all in fp32 against `generate`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagemill.runtime import LLM, SamplingParams
from pagemill.runtime.config import ModelConfig
from pagemill.runtime.model_config import FULL, SLIDING, SUPPORTED_ARCHITECTURES
from pagemill.runtime.model_executor.loader import load_model
from pagemill.runtime.worker.model_runner import ModelRunner

GREEDY = dict(temperature=0.0, ignore_eos=True)

# Every family with its own code path, each with a window shorter than the test prompts.
FAMILIES = {
    # Per-head q/k norms, head_dim != hidden / heads, Qwen's window on layers >= 1 only.
    "qwen3": (
        "qwen3",
        dict(head_dim=32, use_sliding_window=True, sliding_window=12, max_window_layers=1),
    ),
    # Fused qkv / gate_up in the checkpoint, half the head rotated, every layer windowed.
    "phi3": ("phi3", dict(sliding_window=12, partial_rotary_factor=0.5)),
    # Soft-capped scores and logits, query_pre_attn_scalar, alternating windowed layers.
    # (A cap of 2 bends these tiny models' scores; the default 50 would hardly touch them.)
    "gemma2": (
        "gemma2",
        dict(
            head_dim=16,
            sliding_window=10,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=5.0,
            tie_word_embeddings=True,
        ),
    ),
    # q/k norms, a local RoPE base for windowed layers and a scaled global one.
    "gemma3": (
        "gemma3",
        dict(
            head_dim=16,
            sliding_window=9,
            num_hidden_layers=3,
            query_pre_attn_scalar=16,
            tie_word_embeddings=True,
            layer_types=[SLIDING, FULL, SLIDING],
            rope_parameters={
                FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                SLIDING: {"rope_type": "default", "rope_theta": 1000.0},
            },
        ),
    ),
    "mistral": ("mistral", dict(sliding_window=11)),
    # Layer 1 without RoPE (and windowed: SmolLM3 windows its NoPE layers only).
    "smollm3": (
        "smollm3",
        dict(
            num_hidden_layers=3,
            no_rope_layer_interval=2,
            use_sliding_window=True,
            sliding_window=12,
            tie_word_embeddings=True,
        ),
    ),
    # Norms after each block, q/k norms over whole projections, biases everywhere.
    "olmo2": ("olmo2", dict(attention_bias=True)),
    # Scaled embeddings, residual branches, scores and logits (none of them 1).
    "granite": (
        "granite",
        dict(
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.4,
            logits_scaling=2.5,
        ),
    ),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, build_tiny_model) -> tuple[str, Path, torch.nn.Module]:
    arch, overrides = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return request.param, folder, build_tiny_model(folder, arch, seed=3, **overrides)


def _check_against_hf(llm, model, prompts, max_tokens, hf_greedy) -> None:
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, m, out in zip(prompts, max_tokens, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, m), (
            f"prompt of {len(prompt)} tokens diverged"
        )


def test_config_reads_the_family(family) -> None:
    name, folder, model = family
    config = ModelConfig.from_pretrained(folder)
    assert config.architecture == type(model).__name__
    hf_types = getattr(model.config, "layer_types", None)
    default = SLIDING if getattr(model.config, "sliding_window", None) else FULL
    expected = hf_types or [default] * model.config.num_hidden_layers
    assert config.layer_types == expected
    windows = [config.layer_window(i) for i in range(config.num_hidden_layers)]
    assert windows == [model.config.sliding_window if t == SLIDING else 0 for t in expected]
    assert 0 in windows or name in ("phi3", "mistral")
    assert any(windows) or name in ("olmo2", "granite")


def test_prefill_logits_match_transformers(family, random_prompts, all_logits) -> None:
    """Logits at every position of prompts up to 9x the window, in one flattened batch."""
    _, folder, model = family
    config = ModelConfig.from_pretrained(folder)
    runner = ModelRunner(
        load_model(folder, config, torch.float32, torch.device("cpu"), 512),
        config,
        torch.device("cpu"),
        torch.float32,
        16,
        8,
        512,
        512,
    )
    runner.init_kv_cache(64)
    prompts = random_prompts([1, 9, 16, 40, 100], model.config.vocab_size, seed=11)
    got = all_logits(runner, prompts)
    for prompt, logits in zip(prompts, got):
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_chunked_prefill_past_the_window_matches_hf(family, hf_greedy, random_prompts) -> None:
    """A 16-token budget cuts prompts of up to 70 tokens into chunks that start past the
    window; decodes run far past it too."""
    _, folder, model = family
    prompts = random_prompts([70, 5, 33, 21], model.config.vocab_size, seed=4)
    llm = LLM(
        str(folder),
        dtype="float32",
        max_num_batched_tokens=16,
        max_num_seqs=3,
        kv_cache_memory_bytes=4 << 20,
    )
    _check_against_hf(llm, model, prompts, [12, 30, 8, 10], hf_greedy)


@pytest.mark.parametrize("name", ["gemma2", "mistral"])
def test_prefix_hits_past_the_window_match_hf(
    name, tmp_path, build_tiny_model, hf_greedy, random_prompts
) -> None:
    arch, overrides = FAMILIES[name]
    model = build_tiny_model(tmp_path, arch, seed=5, **overrides)
    vocab = model.config.vocab_size
    prefix = random_prompts([48], vocab, seed=5)[0]
    prompts = [prefix + s for s in random_prompts([1, 9, 20], vocab, seed=6)]
    llm = LLM(
        str(tmp_path), dtype="float32", max_num_batched_tokens=64, kv_cache_memory_bytes=4 << 20
    )
    llm.generate([[*prefix, 7]], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    before = llm.llm_engine.get_stats().prefix_cache_hits
    _check_against_hf(llm, model, prompts, [8, 8, 8], hf_greedy)
    assert llm.llm_engine.get_stats().prefix_cache_hits - before >= 32 * len(prompts)


@pytest.mark.parametrize("name", ["gemma3", "phi3"])
def test_preemption_with_windows_recomputes_exactly(
    name, tmp_path, build_tiny_model, hf_greedy, random_prompts
) -> None:
    arch, overrides = FAMILIES[name]
    model = build_tiny_model(tmp_path, arch, seed=7, **overrides)
    prompts = random_prompts([20, 33, 12, 40, 27], model.config.vocab_size, seed=7)
    probe = LLM(str(tmp_path), dtype="float32", kv_cache_memory_bytes=1 << 20)
    block_bytes = (1 << 20) // probe.llm_engine.num_blocks
    del probe
    # Gemma 3's three layers are three KV cache groups (one full, two windowed) of one
    # layer each: one 128-token request needs 8 blocks + 2 per windowed group + the null.
    num_blocks = 13 if name == "gemma3" else 9
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        max_model_len=128,
        kv_cache_memory_bytes=num_blocks * block_bytes,
        max_num_batched_tokens=64,
    )
    assert llm.llm_engine.num_blocks == num_blocks
    _check_against_hf(llm, model, prompts, [30, 25, 40, 20, 28], hf_greedy)
    assert llm.llm_engine.get_stats().num_preemptions > 0


def test_window_models_are_not_capped_at_the_window(family) -> None:
    _, folder, model = family
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=1 << 20)
    assert llm.llm_engine.max_model_len == model.config.max_position_embeddings


def test_layer_types_without_transformers() -> None:
    """Configs without ``layer_types`` (older files, or read without transformers) get
    transformers' own patterns."""
    base = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=7,
        num_attention_heads=2,
        sliding_window=8,
    )
    gemma2 = ModelConfig.from_dict(dict(base, model_type="gemma2"))
    assert gemma2.layer_types == [SLIDING, FULL] * 3 + [SLIDING]
    gemma3 = ModelConfig.from_dict(
        dict(base, model_type="gemma3_text", rope_theta=1e6, rope_local_base_freq=1e4)
    )
    assert gemma3.layer_types == [SLIDING] * 5 + [FULL, SLIDING]
    assert gemma3.rope_for(SLIDING) == (1e4, None) and gemma3.rope_for(FULL)[0] == 1e6
    qwen3 = ModelConfig.from_dict(
        dict(base, model_type="qwen3", use_sliding_window=True, max_window_layers=5)
    )
    assert [qwen3.layer_window(i) for i in range(7)] == [0] * 5 + [8, 8]
    off = ModelConfig.from_dict(dict(base, model_type="qwen3"))
    assert off.sliding_window is None and off.layer_window(6) == 0
    smollm3 = dict(base, model_type="smollm3", no_rope_layer_interval=3)
    assert ModelConfig.from_dict(dict(smollm3, use_sliding_window=True)).layer_types == [
        FULL,
        FULL,
        SLIDING,
    ] * 2 + [FULL]
    assert ModelConfig.from_dict(smollm3).sliding_window is None
    mistral = ModelConfig.from_dict(dict(base, model_type="mistral"))
    assert all(mistral.layer_window(i) == 8 for i in range(7))
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_dict(dict(base, model_type="gemma2", layer_types=["chunked"] * 7))


def test_unsupported_architecture_names_the_supported(tmp_path) -> None:
    raw = dict(
        architectures=["FalconForCausalLM"],
        model_type="falcon",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
    )
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="FalconForCausalLM") as err:
        ModelConfig.from_dict(raw)
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(err.value)
