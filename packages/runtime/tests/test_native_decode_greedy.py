"""Greedy equality with transformers through the native CPU decode kernel's vectorised path.

The shared tiny models have head dim 16, which the kernel serves on its portable path;
head dims 64 and 128 take the AVX-512 one (three passes per chunk, GQA groups sharing
each K/V row). fp32 weights, so the kernel's fp32 path must agree with transformers' eager
attention token for token.
"""

from __future__ import annotations

import pytest

from pagemill.kernels import cpu_native
from pagemill.runtime import LLM, SamplingParams


@pytest.mark.parametrize(
    ("heads", "kv_heads", "hidden"),
    [(4, 2, 256), (2, 1, 256)],  # head dims 64 (GQA 2) and 128 (GQA 2)
)
def test_native_decode_matches_hf(
    tmp_path, build_tiny_model, hf_greedy, random_prompts, monkeypatch, heads, kv_heads, hidden
) -> None:
    if cpu_native.load() is None:
        pytest.skip("the native CPU kernel could not be built here (no C++ compiler?)")
    calls = []
    real = cpu_native.paged_decode
    monkeypatch.setattr(
        cpu_native, "paged_decode", lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    )
    model = build_tiny_model(
        tmp_path,
        "llama",
        seed=7,
        hidden_size=hidden,
        intermediate_size=256,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
    )
    prompts = random_prompts([3, 17, 40, 75], model.config.vocab_size, seed=11)
    max_tokens = [20, 14, 24, 9]
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory_bytes=8 << 20)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert calls, "the decode steps did not reach the native kernel"
    for prompt, m, out in zip(prompts, max_tokens, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, m)
