"""Per-group KV block tables end to end: tiny random Gemma 2 and Gemma 3 (full-attention
and sliding-window layers mixed) against transformers in fp32.

Blocks are 4 tokens and the windows 9-10, so requests run through many windows. Each
model's layers form KV cache groups (Gemma 2: one full and one windowed group; Gemma 3:
one full and two windowed), each with its own block table; the windowed groups give their
blocks back once the window has passed. Greedy tokens and logprobs must equal
transformers' with chunked prefill, prefix hits past the window and preemption; the proof
that blocks really were given back is that, in the KV budget that one table keeping every
block fills with fewer requests, the per-group tables run them all at once.
"""

from __future__ import annotations

import pytest
import torch

from pagemill.blockpool import HybridKVCacheManager, KVCacheManager
from pagemill.runtime import LLM, SamplingParams
from pagemill.runtime.model_config import FULL, SLIDING, ModelConfig
from pagemill.runtime.worker.kv_cache import bytes_per_token

GREEDY = dict(temperature=0.0, ignore_eos=True)
BLOCK = 4

MODELS = {
    "gemma2": dict(
        num_hidden_layers=4,
        head_dim=16,
        sliding_window=10,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=5.0,
        tie_word_embeddings=True,
    ),
    "gemma3": dict(
        num_hidden_layers=6,
        head_dim=16,
        sliding_window=9,
        query_pre_attn_scalar=16,
        tie_word_embeddings=True,
        layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
        rope_parameters={
            FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
            SLIDING: {"rope_type": "default", "rope_theta": 1000.0},
        },
    ),
}
# (layers, window) of each group, full first.
GROUPS = {
    "gemma2": [((1, 3), None), ((0, 2), 10)],
    "gemma3": [((2, 5), None), ((0, 1), 9), ((3, 4), 9)],
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def hybrid(request, tmp_path_factory, build_tiny_model):
    name = request.param
    folder = tmp_path_factory.mktemp(f"tiny-{name}-groups")
    model = build_tiny_model(folder, name, seed=21, **MODELS[name])
    return name, folder, model


def make_llm(folder, **kw) -> LLM:
    kw.setdefault("kv_cache_memory_bytes", 4 << 20)
    kw.setdefault("max_model_len", 256)
    return LLM(str(folder), dtype="float32", block_size=BLOCK, **kw)


def manager(llm: LLM):
    return llm.llm_engine.engine_core.kv_cache_manager


def spy(llm: LLM) -> list[tuple[int, int]]:
    """Per step: requests running, and the most blocks any request holds in a windowed
    group (the scheduler and the manager are only read)."""
    sched = llm.llm_engine.scheduler
    kv = manager(llm)
    seen: list[tuple[int, int]] = []
    schedule = sched.schedule

    def spied():
        out = schedule()
        held = 0
        if isinstance(kv, HybridKVCacheManager):
            for r in sched.running:
                for g, w in enumerate(kv.windows):
                    if w is not None:
                        held = max(held, kv.num_held_blocks(r.request_id, g))
        seen.append((len(sched.running), held))
        return out

    sched.schedule = spied
    return seen


def hf_logprobs(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


def check(llm: LLM, model, prompts, max_tokens, hf_greedy, logprobs: bool = False) -> None:
    k = 3 if logprobs else None
    params = [SamplingParams(max_tokens=m, logprobs=k, **GREEDY) for m in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, m, out in zip(prompts, max_tokens, outs):
        got = out.outputs[0]
        assert got.token_ids == hf_greedy(model, prompt, m), f"prompt of {len(prompt)} diverged"
        if logprobs:
            ref = hf_logprobs(model, prompt + got.token_ids[:-1])
            for i, (tok, entry) in enumerate(zip(got.token_ids, got.logprobs)):
                row = ref[len(prompt) - 1 + i]
                assert entry[tok] == pytest.approx(row[tok].item(), abs=1e-4)
                top = row.topk(3)
                for t, lp in zip(top.indices.tolist(), top.values.tolist()):
                    assert entry[t] == pytest.approx(lp, abs=1e-4)


def test_layers_form_groups_sharing_one_pool(hybrid) -> None:
    name, folder, _ = hybrid
    llm = make_llm(folder)
    kv = manager(llm)
    assert isinstance(kv, HybridKVCacheManager)
    assert [(g.layer_ids, g.sliding_window) for g in kv.kv_cache_groups] == GROUPS[name]
    cache = llm.llm_engine.engine_core.model_runner.kv_cache
    # One tensor pair per layer of a group: layer i of every group shares tensor i.
    tensors = {id(k) for k, _ in cache.caches}
    assert len(tensors) == len(GROUPS[name][0][0])
    del llm
    off = make_llm(folder, sliding_window_free_blocks=False)
    assert isinstance(manager(off), KVCacheManager)
    del off
    # A pool that cannot hold one max_model_len request is refused with the count it
    # needs: every block in the full group, a window plus one block in each windowed one.
    windows = [w for _, w in GROUPS[name] if w is not None]
    needed = 64 + sum(-(-(w - 1) // BLOCK) + 1 for w in windows) + 1
    with pytest.raises(ValueError, match=f"request needs {needed} blocks"):
        make_llm(folder, kv_cache_memory_bytes=16 << 10)


def test_chunked_prefill_and_decode_past_the_window_match_hf(
    hybrid, hf_greedy, random_prompts
) -> None:
    """A 16-token budget cuts prompts of up to 70 tokens into chunks that start past the
    window; decodes run far past it. Tokens and logprobs equal transformers'."""
    _, folder, model = hybrid
    prompts = random_prompts([70, 5, 33, 21], model.config.vocab_size, seed=4)
    llm = make_llm(folder, max_num_batched_tokens=16, max_num_seqs=3)
    steps = spy(llm)
    check(llm, model, prompts, [20, 40, 12, 30], hf_greedy, logprobs=True)
    window = model.config.sliding_window
    # A decode holds a window's blocks plus one; a 16-token chunk at most 16 tokens more.
    assert 0 < max(h for _, h in steps) <= -(-(window + 16) // BLOCK) + 1
    kv = manager(llm)
    assert kv.get_num_free_blocks() == kv.num_usable_blocks


def test_prefix_hits_past_the_window_match_hf(hybrid, hf_greedy, random_prompts) -> None:
    """A 48-token shared prefix: later requests hit 48 tokens; the windowed groups take
    only the blocks of the last window (the rest are null blocks)."""
    _, folder, model = hybrid
    vocab = model.config.vocab_size
    prefix = random_prompts([48], vocab, seed=5)[0]
    prompts = [prefix + s for s in random_prompts([1, 9, 20], vocab, seed=6)]
    llm = make_llm(folder, max_num_batched_tokens=64)
    llm.generate([[*prefix, 7]], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    before = llm.llm_engine.get_stats().prefix_cache_hits
    check(llm, model, prompts, [8, 8, 8], hf_greedy, logprobs=True)
    assert llm.llm_engine.get_stats().prefix_cache_hits - before >= 48 * len(prompts)


def test_preemption_recomputes_exactly(hybrid, hf_greedy, random_prompts) -> None:
    _, folder, model = hybrid
    prompts = random_prompts([20, 33, 12, 40, 27], model.config.vocab_size, seed=7)
    probe = make_llm(folder, kv_cache_memory_bytes=1 << 20)
    block_bytes = (1 << 20) // probe.llm_engine.num_blocks
    del probe
    ngroups = len(GROUPS[hybrid[0]])
    # Room for one 128-token request and little more: requests outgrow the pool together.
    num_blocks = 32 + 4 * (ngroups - 1) + 1
    llm = make_llm(
        folder,
        max_model_len=128,
        kv_cache_memory_bytes=num_blocks * block_bytes,
        max_num_batched_tokens=16,
    )
    assert llm.llm_engine.num_blocks == num_blocks
    check(llm, model, prompts, [30, 25, 40, 20, 28], hf_greedy)
    assert llm.llm_engine.get_stats().num_preemptions > 0


def test_more_long_requests_fit_the_same_budget(hybrid, hf_greedy, random_prompts) -> None:
    """Four requests of ~100 tokens in a budget where one table keeping every block
    cannot run them together: with per-group tables they all run at once."""
    _, folder, model = hybrid
    prompts = random_prompts([60, 55, 64, 58], model.config.vocab_size, seed=8)
    max_tokens = [40, 45, 36, 42]
    per_token = bytes_per_token(ModelConfig.from_pretrained(folder), torch.float32)
    # Three quarters of the 4 x 26 blocks that one table keeping every block needs.
    budget = 3 * 26 * BLOCK * per_token
    results = {}
    for release in (False, True):
        llm = make_llm(
            folder,
            kv_cache_memory_bytes=budget,
            max_num_batched_tokens=32,
            max_num_seqs=4,
            sliding_window_free_blocks=release,
        )
        steps = spy(llm)
        check(llm, model, prompts, max_tokens, hf_greedy)
        results[release] = (max(r for r, _ in steps), llm.llm_engine.get_stats().num_preemptions)
        del llm
    assert results[True] == (4, 0)
    assert results[False][1] > 0


def test_kv_events_replay_the_full_groups_index(hybrid, random_prompts) -> None:
    """The published events, applied in order, rebuild group 0's (the full group's) hash
    index, through windowed releases and evictions."""
    import socket
    import time

    import msgspec
    import zmq

    from pagemill.runtime.engine.kv_events import BlockRemoved, BlockStored, KVEventBatch

    _, folder, model = hybrid
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    llm = make_llm(
        folder,
        kv_cache_memory_bytes=64 << 10,
        max_model_len=64,
        max_num_batched_tokens=32,
        kv_events_config={
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{port}",
            "topic": "kv",
        },
    )
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.3)  # PUB drops what it sends before the subscription arrives
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    try:
        kv = manager(llm)
        assert isinstance(kv, HybridKVCacheManager)
        prompts = random_prompts([40] * 12, model.config.vocab_size, seed=9)
        llm.generate(prompts, SamplingParams(max_tokens=20, **GREEDY), use_tqdm=False)
        assert kv.block_pool.num_evictions > 0
        index: set[bytes] = set()
        removed = 0
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and index != set(kv.block_pool.group_indexes[0]):
            if not sub.poll(100):
                continue
            _, _, payload = sub.recv_multipart()
            for ev in decoder.decode(payload).events:
                if isinstance(ev, BlockStored):
                    assert not index & set(ev.block_hashes)
                    index.update(ev.block_hashes)
                elif isinstance(ev, BlockRemoved):
                    assert set(ev.block_hashes) <= index
                    index.difference_update(ev.block_hashes)
                    removed += 1
        assert index == set(kv.block_pool.group_indexes[0]) and removed
    finally:
        sub.close(linger=0)
        llm.llm_engine.engine_core.shutdown()
