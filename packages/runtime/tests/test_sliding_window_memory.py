"""Sliding-window memory end to end: a tiny random Mistral (every layer windowed) whose KV
blocks leave the pool once the window has passed them, against transformers in fp32.

Blocks are 4 tokens and the window 10, so requests run through many windows and the pool
holds far fewer blocks than their contexts need. The proofs that blocks really were given
back are what the pool could not do otherwise: a request longer than the whole pool
generates to its end (with the release switched off that pool is refused), and four requests whose
contexts are twice the pool run side by side without a preemption. Chunked prefill, window
prefix hits (the blocks before the window come back as null blocks) and preemption with
recompute are each compared token for token with `generate`.
"""

from __future__ import annotations

import pytest
import torch

from pagemill.runtime import LLM, SamplingParams
from pagemill.runtime.model_config import ModelConfig
from pagemill.runtime.worker.kv_cache import bytes_per_token

GREEDY = dict(temperature=0.0, ignore_eos=True)
BLOCK = 4
WINDOW = 10


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, build_tiny_model):
    folder = tmp_path_factory.mktemp("tiny-mistral-window")
    model = build_tiny_model(folder, "mistral", seed=13, sliding_window=WINDOW)
    return folder, model


def pool_bytes(folder, num_blocks: int) -> int:
    config = ModelConfig.from_pretrained(folder)
    return num_blocks * BLOCK * bytes_per_token(config, torch.float32)


def make_llm(folder, num_blocks: int, **kw) -> LLM:
    llm = LLM(
        str(folder),
        dtype="float32",
        block_size=BLOCK,
        kv_cache_memory_bytes=pool_bytes(folder, num_blocks),
        max_model_len=256,
        **kw,
    )
    assert llm.llm_engine.num_blocks == num_blocks
    return llm


def spy_on_running(llm: LLM) -> list[int]:
    """Record how many requests run in each step (the scheduler is only read)."""
    sched = llm.llm_engine.scheduler
    seen: list[int] = []
    schedule = sched.schedule

    def spied():
        out = schedule()
        seen.append(len(sched.running))
        return out

    sched.schedule = spied
    return seen


def generate(llm: LLM, prompts, max_tokens):
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens]
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_a_request_longer_than_the_pool_matches_hf(mistral, hf_greedy, random_prompts) -> None:
    folder, model = mistral
    (prompt,) = random_prompts([30], model.config.vocab_size, seed=1)
    # 12 blocks: 11 usable (one is the null block) = 44 tokens, the request reaches 90.
    llm = make_llm(folder, 12, max_num_batched_tokens=16)
    assert llm.llm_engine.engine_core.kv_cache_manager.sliding_window == WINDOW
    (out,) = generate(llm, [prompt], [60])
    assert out.token_ids == hf_greedy(model, prompt, 60)
    assert llm.llm_engine.get_stats().num_preemptions == 0
    assert out.finish_reason == "length" and len(out.token_ids) == 60
    del llm
    # Switched off, every block is kept: the same pool cannot hold one such request.
    with pytest.raises(ValueError, match="one max_model_len=256 request needs 64 blocks"):
        make_llm(folder, 12, max_num_batched_tokens=16, sliding_window_free_blocks=False)


def test_concurrent_requests_past_the_pool_match_hf(mistral, hf_greedy, random_prompts) -> None:
    """Contexts of 253 tokens in all over a 116-token pool, chunked by a 16-token budget."""
    folder, model = mistral
    prompts = random_prompts([26, 19, 33, 22], model.config.vocab_size, seed=2)
    max_tokens = [40, 45, 30, 38]
    num_blocks = 30
    assert sum(map(len, prompts)) + sum(max_tokens) > 2 * (num_blocks - 1) * BLOCK
    llm = make_llm(folder, num_blocks, max_num_batched_tokens=16, max_num_seqs=4)
    running = spy_on_running(llm)
    outs = generate(llm, prompts, max_tokens)
    for prompt, m, out in zip(prompts, max_tokens, outs):
        assert out.token_ids == hf_greedy(model, prompt, m)
    assert max(running) == 4
    assert llm.llm_engine.get_stats().num_preemptions == 0


def test_window_prefix_hits_match_hf(mistral, hf_greedy, random_prompts) -> None:
    """A 41-token shared prefix: the next requests hit 40 tokens but hold only the
    window's blocks of it (the first ones are null)."""
    folder, model = mistral
    vocab = model.config.vocab_size
    prefix = random_prompts([41], vocab, seed=3)[0]
    prompts = [prefix + s for s in random_prompts([1, 6, 13], vocab, seed=4)]
    llm = make_llm(folder, 40, max_num_batched_tokens=64)
    generate(llm, [prefix], [2])
    before = llm.llm_engine.get_stats().prefix_cache_hits
    outs = generate(llm, prompts, [12, 12, 12])
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model, prompt, 12)
    assert llm.llm_engine.get_stats().prefix_cache_hits - before >= 40 * len(prompts)


def test_preemption_with_window_release_matches_hf(mistral, hf_greedy, random_prompts) -> None:
    folder, model = mistral
    prompts = random_prompts([20, 33, 12, 27], model.config.vocab_size, seed=5)
    max_tokens = [30, 25, 40, 28]
    # 8 usable blocks (32 tokens) and 8-token prefill chunks: requests are admitted
    # while small and outgrow the pool together until their windows have passed.
    llm = make_llm(folder, 9, max_num_batched_tokens=8)
    outs = generate(llm, prompts, max_tokens)
    for prompt, m, out in zip(prompts, max_tokens, outs):
        assert out.token_ids == hf_greedy(model, prompt, m)
    assert llm.llm_engine.get_stats().num_preemptions > 0


def test_runner_mirror_points_dropped_entries_at_the_null_block() -> None:
    """The runner's table rows stop naming blocks the manager may have handed on."""
    from pagemill.runtime.worker.input_batch import CachedRequestState, InputBatch
    from pagemill.scheduler import Request

    batch = InputBatch(4, 16, torch.device("cpu"))
    for rid, ids in (("a", [5, 6, 7, 8, 9]), ("b", [10, 11, 12])):
        batch.add(CachedRequestState.create(Request(rid, [1, 2]), torch.device("cpu")), ids)
    # A query at 17 with a window of 10 reads keys 8.. : blocks 0 and 1 (0..7) are dead.
    batch.drop_blocks_before(0, 17 - WINDOW + 1, BLOCK)
    assert batch.block_table[0, :5].tolist() == [0, 0, 7, 8, 9]
    batch.drop_blocks_before(1, 3, BLOCK)  # nothing wholly before position 3
    assert batch.block_table[1, :3].tolist() == [10, 11, 12]
    batch.drop_blocks_before(1, 8, BLOCK)
    batch.remove("a")  # rows close up with their dropped counts
    assert batch.block_table[0, :3].tolist() == [0, 0, 12] and batch.num_dropped[0] == 2
