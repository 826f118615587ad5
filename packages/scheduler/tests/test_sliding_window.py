"""Scheduling over a sliding-window KV cache manager: long requests share a pool that could
not hold their whole contexts, steps are capped so one request always fits alone, and a
prompt scheduled whole still has to fit the pool at once."""

from __future__ import annotations

from pagemill.blockpool import KVCacheManager
from pagemill.scheduler import Request, Scheduler, SchedulerConfig


def make(window: int | None, num_blocks: int, block_size: int = 4, **cfg) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, sliding_window=window)
    return Scheduler(SchedulerConfig(**cfg), kv)


def run(s: Scheduler, max_steps: int = 10_000) -> tuple[int, int, dict[str, list[int]]]:
    """Drive to completion; (most requests running at once, preemptions, outputs)."""
    outputs: dict[str, list[int]] = {}
    peak = 0
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return peak, s.num_preemptions, outputs
        out = s.schedule()
        peak = max(peak, len(s.running))
        kv = s.kv_cache_manager
        for sched in out.scheduled:
            # The step's own positions must be real blocks of the request's table.
            kv.slot_mapping(sched.request_id, sched.start_pos, sched.start_pos + sched.num_tokens)
        sampled = {x.request_id: 5 for x in out.scheduled if x.sample}
        for up in s.update_from_output(out, sampled):
            outputs.setdefault(up.request_id, []).extend(up.new_token_ids)
    raise AssertionError("did not finish")


def add_long(s: Scheduler, n: int, prompt_len: int, max_tokens: int) -> None:
    for i in range(n):
        s.add_request(
            Request(f"r{i}", [10 + i] * prompt_len, max_tokens=max_tokens, ignore_eos=True)
        )


def test_long_requests_run_together_in_a_pool_smaller_than_their_contexts() -> None:
    """Four 80-token requests (320 tokens of context) in a pool of 80 tokens: with the
    window they all run at once and never preempt; without it they cannot."""
    cfg = dict(max_num_batched_tokens=32, max_model_len=256)
    windowed = make(8, 21, **cfg)  # 20 usable blocks + the null block
    add_long(windowed, 4, 40, 40)
    peak, preemptions, outputs = run(windowed)
    assert peak == 4 and preemptions == 0
    assert all(len(outputs[f"r{i}"]) == 40 for i in range(4))
    assert windowed.kv_cache_manager.get_num_free_blocks() == 20

    full = make(None, 20, **cfg)
    add_long(full, 4, 40, 40)
    peak_full, preemptions_full, outputs_full = run(full)
    assert preemptions_full > 0 and peak_full < 4
    assert outputs_full == outputs


def test_a_request_longer_than_the_pool_is_served_in_capped_steps() -> None:
    s = make(6, 5, max_num_batched_tokens=64, max_model_len=512)  # 4 usable blocks: 16 tokens
    s.add_request(Request("r", [3] * 100, max_tokens=60, ignore_eos=True))
    kv = s.kv_cache_manager
    steps = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        for sched in out.scheduled:
            assert sched.start_pos + sched.num_tokens <= kv.max_num_tokens(sched.start_pos)
        s.update_from_output(out, {x.request_id: 5 for x in out.scheduled if x.sample})
        steps += 1
        assert steps < 1000
    assert s.num_preemptions == 0 and s.num_finished == 1 and s.num_ignored == 0


def test_whole_prompts_still_have_to_fit_the_pool() -> None:
    """Without chunked prefill a prompt is computed in one step: all its blocks at once."""
    s = make(6, 5, enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=64)
    s.add_request(Request("big", [3] * 17, max_tokens=2))
    s.add_request(Request("ok", [3] * 16, max_tokens=30, ignore_eos=True))
    _, preemptions, outputs = run(s)
    assert s.num_ignored == 1 and outputs.get("big", []) == []
    # A running request is capped where a recompute of its whole sequence would not fit.
    assert len(outputs["ok"]) == 1 and preemptions == 0
