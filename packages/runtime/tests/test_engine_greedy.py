"""The engine's greedy output equals transformers' token for token, however it is batched.

Every test compares whole continuations with `generate(do_sample=False)` on the same
weights (tiny random fp32 Llama and Qwen2): a mixed batch, chunked prefill under a tiny token
budget, prefix-cache hits, and a pool so small that requests are preempted and recomputed.
"""

from __future__ import annotations

import pytest

from pagemill.runtime import LLM, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _check_against_hf(llm, model, prompts, max_tokens, hf_greedy) -> None:
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts  # input order kept
    for prompt, m, out in zip(prompts, max_tokens, outs):
        expected = hf_greedy(model, prompt, m)
        assert out.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens diverged"
        assert out.outputs[0].finish_reason == "length"
        assert out.finished


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_mixed_batch_matches_hf(fixture, request, hf_greedy, random_prompts) -> None:
    folder, model = request.getfixturevalue(fixture)
    lengths = [1, 2, 7, 16, 17, 31, 33, 48, 64, 90, 5, 120]
    prompts = random_prompts(lengths, model.config.vocab_size, seed=3)
    max_tokens = [12, 20, 5, 16, 9, 24, 1, 18, 11, 7, 30, 14]
    llm = LLM(
        str(folder), dtype="float32", max_num_batched_tokens=256, kv_cache_memory_bytes=4 << 20
    )
    _check_against_hf(llm, model, prompts, max_tokens, hf_greedy)


def test_chunked_prefill_matches_hf(tiny_llama, hf_greedy, random_prompts) -> None:
    folder, model = tiny_llama
    prompts = random_prompts([70, 45, 3, 100, 18], model.config.vocab_size, seed=4)
    llm = LLM(
        str(folder),
        dtype="float32",
        max_num_batched_tokens=16,
        max_num_seqs=3,
        kv_cache_memory_bytes=4 << 20,
    )
    _check_against_hf(llm, model, prompts, [10, 14, 8, 6, 12], hf_greedy)
    # Every prompt longer than the budget was split over several steps.
    assert llm.llm_engine.get_stats().num_running == 0


def test_prefix_cache_hits_match_hf(tiny_qwen2, hf_greedy, random_prompts) -> None:
    folder, model = tiny_qwen2
    vocab = model.config.vocab_size
    prefix = random_prompts([48], vocab, seed=5)[0]
    suffixes = random_prompts([1, 9, 16, 23, 30], vocab, seed=6)
    prompts = [prefix + s for s in suffixes] + [prefix[:32], list(prefix)]
    llm = LLM(
        str(folder), dtype="float32", max_num_batched_tokens=64, kv_cache_memory_bytes=4 << 20
    )
    # Warm the cache with the shared prefix, then run the batch that reuses it.
    llm.generate([[*prefix, 7]], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    before = llm.llm_engine.get_stats().prefix_cache_hits
    _check_against_hf(llm, model, prompts, [8] * len(prompts), hf_greedy)
    stats = llm.llm_engine.get_stats()
    assert stats.prefix_cache_hits - before >= 32 * len(prompts)
    assert stats.kv_cache_usage == 0.0


def test_preemption_recomputes_exactly(tiny_llama, hf_greedy, random_prompts) -> None:
    folder, model = tiny_llama
    prompts = random_prompts([20, 33, 12, 40, 27, 8], model.config.vocab_size, seed=7)
    # 512 B/token x 16 tokens = 8 KiB a block: 10 blocks for six requests of up to 4 blocks.
    llm = LLM(
        str(folder),
        dtype="float32",
        max_model_len=128,
        kv_cache_memory_bytes=10 * 8192,
        max_num_batched_tokens=64,
    )
    assert llm.llm_engine.num_blocks == 10
    _check_against_hf(llm, model, prompts, [30, 25, 40, 20, 28, 35], hf_greedy)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0
    assert stats.kv_cache_usage == 0.0


def test_greedy_n_copies_share_prompt(tiny_llama, hf_greedy, random_prompts) -> None:
    folder, model = tiny_llama
    prompt = random_prompts([40], model.config.vocab_size, seed=8)[0]
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=4 << 20)
    [out] = llm.generate([prompt], SamplingParams(n=3, max_tokens=10, **GREEDY), use_tqdm=False)
    expected = hf_greedy(model, prompt, 10)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == expected for c in out.outputs)
    # The copies after the first found the prompt's two full blocks in the prefix cache.
    assert llm.llm_engine.get_stats().prefix_cache_hits >= 2 * 32
