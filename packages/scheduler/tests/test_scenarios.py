"""Hand-built scenarios with exact expected schedules: chunking, prefix hits, reuse of
freed blocks, preemption, stop rules, ignored prompts, aborts."""

from __future__ import annotations

import time

import pytest

from pagemill.blockpool import KVCacheManager, get_hash_fn, hash_block_chain
from pagemill.scheduler import (
    Request,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

EOS = 2


def make(
    num_blocks: int = 256, block_size: int = 16, enable_caching: bool = True, **cfg
) -> tuple[Scheduler, KVCacheManager]:
    """Prefix caching is the manager's setting; the scheduler reads it from there."""
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size, enable_caching=enable_caching)
    return Scheduler(SchedulerConfig(**cfg), kv), kv


def req(rid: str, prompt: list[int], **kw) -> Request:
    kw.setdefault("eos_token_id", EOS)
    return Request(rid, prompt, **kw)


def shape(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(s.request_id, s.start_pos, s.num_tokens, s.sample) for s in out.scheduled]


def step(s: Scheduler, token: int = 7):
    out = s.schedule()
    ups = s.update_from_output(out, {x.request_id: token for x in out.scheduled if x.sample})
    return out, ups


def run_until_finished(s: Scheduler, rid: str, max_steps: int = 100) -> None:
    for _ in range(max_steps):
        if s.get_request(rid) is None:
            return
        step(s, token=5)
    raise AssertionError(f"{rid} still unfinished after {max_steps} steps")


def test_three_long_prompts_chunked_400_400_224() -> None:
    s, _ = make(max_num_batched_tokens=1024, long_prefill_token_threshold=400, max_model_len=2048)
    for i in range(3):
        s.add_request(req(f"r{i}", [10 + i] * 800, max_tokens=4))
    out = s.schedule()
    assert shape(out) == [("r0", 0, 400, False), ("r1", 0, 400, False), ("r2", 0, 224, False)]
    assert out.total_num_scheduled_tokens == 1024
    assert out.scheduled[2].token_ids == [12] * 224
    assert s.update_from_output(out, {}) == []
    out = s.schedule()
    # Running first: r0, r1 finish their prompts (and sample), r2 gets the rest of the budget.
    assert shape(out) == [("r0", 400, 400, True), ("r1", 400, 400, True), ("r2", 224, 224, False)]
    s.update_from_output(out, {"r0": 5, "r1": 6})
    out = s.schedule()
    assert shape(out) == [("r0", 800, 1, True), ("r1", 800, 1, True), ("r2", 448, 352, True)]
    assert out.scheduled[0].token_ids == [5]


def test_prefix_hit_skips_exactly_the_shared_full_blocks() -> None:
    s, kv = make(block_size=4)
    shared = list(range(100, 110))  # 10 tokens: 2 full blocks of 4 + 2 tokens
    s.add_request(req("a", [*shared, 1, 1, 1], max_tokens=1))
    out_a, _ = step(s)
    a_blocks = list(out_a.scheduled[0].new_block_ids)
    assert s.get_request("a") is None  # finished after one token; its blocks stay cached
    s.add_request(req("b", [*shared, 9, 9]))
    out = s.schedule()
    (b,) = out.scheduled
    assert (b.start_pos, b.num_tokens) == (8, 4)
    assert b.token_ids == [108, 109, 9, 9]
    assert b.is_new and b.new_block_ids == kv.get_block_ids("b")
    assert b.new_block_ids[:2] == a_blocks[:2]
    assert b.new_block_ids[2] not in a_blocks[:2]
    assert s.get_request("b").num_cached_tokens == 8
    stats = s.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (13 + 12, 8)


def test_full_prompt_hit_still_recomputes_the_last_token() -> None:
    s, _ = make(block_size=4)
    s.add_request(req("a", list(range(8)), max_tokens=1))
    step(s)
    s.add_request(req("b", list(range(8))))
    (b,) = s.schedule().scheduled
    assert (b.start_pos, b.num_tokens, b.sample) == (4, 4, True)


def test_cache_salt_and_disabled_caching_prevent_hits() -> None:
    s, _ = make(block_size=4)
    s.add_request(req("a", list(range(9)), max_tokens=1, cache_salt="x"))
    step(s)
    s.add_request(req("b", list(range(9)), cache_salt="y"))
    assert s.schedule().scheduled[0].start_pos == 0

    s, _ = make(block_size=4, enable_caching=False)
    s.add_request(req("a", list(range(9)), max_tokens=1))
    step(s)
    s.add_request(req("b", list(range(9))))
    assert s.schedule().scheduled[0].start_pos == 0


def test_finished_requests_blocks_are_reused_next_step() -> None:
    # The pool holds exactly one of these requests.
    s, kv = make(num_blocks=3, block_size=4, max_model_len=12)
    s.add_request(req("a", list(range(10)), max_tokens=1))
    s.add_request(req("b", list(range(50, 60)), max_tokens=1))
    out, ups = step(s)
    assert shape(out) == [("a", 0, 10, True)]  # b does not fit beside a
    assert ups[0].finished and ups[0].finish_reason == "length"
    assert kv.get_num_free_blocks() == 3  # freed in the same step
    out = s.schedule()
    assert shape(out) == [("b", 0, 10, True)]
    assert out.finished_req_ids == ["a"]
    assert sorted(out.scheduled[0].new_block_ids) == [0, 1, 2]


def test_pool_dry_preempts_newest_and_it_resumes_with_all_tokens() -> None:
    s, kv = make(num_blocks=4, block_size=4, max_model_len=16)
    s.add_request(req("old", [1] * 7, max_tokens=8))
    s.add_request(req("new", [3] * 7, max_tokens=8))
    out, _ = step(s, token=5)  # both prompts: 2 blocks each, pool full
    assert shape(out) == [("old", 0, 7, True), ("new", 0, 7, True)]
    out, _ = step(s, token=5)  # both decode position 7, still inside block 2
    out = s.schedule()  # position 8 needs a third block for "old": "new" is preempted
    assert out.preempted_req_ids == ["new"]
    assert shape(out) == [("old", 8, 1, True)]
    new = s.get_request("new")
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert new.num_preemptions == 1 and s.get_stats().num_preemptions == 1
    assert [r.request_id for r in s.iter_waiting()] == ["new"]
    assert not kv.has_request("new")
    s.update_from_output(out, {"old": 5})
    # "old" runs to max_tokens=8 (prompt 7 + 8 = 15 tokens, 4 blocks) before "new" is back.
    while s.get_request("old") is not None:
        out, _ = step(s, token=5)
        assert [x.request_id for x in out.scheduled] == ["old"]
    out = s.schedule()
    (x,) = out.scheduled
    assert x.request_id == "new" and x.start_pos == 0
    assert x.token_ids == [3] * 7 + [5, 5]  # prompt and both generated tokens recomputed
    assert x.sample


def test_priority_preempts_lowest_priority_even_if_older() -> None:
    s, _ = make(num_blocks=4, block_size=4, max_model_len=16, policy="priority")
    s.add_request(req("low", [1] * 7, priority=5, arrival_time=1.0))
    s.add_request(req("high", [3] * 7, priority=0, arrival_time=2.0))
    out, _ = step(s)
    assert [x.request_id for x in out.scheduled] == ["high", "low"]
    step(s)
    out = s.schedule()
    assert out.preempted_req_ids == ["low"]
    assert shape(out) == [("high", 8, 1, True)]


def test_priority_victim_already_served_this_step_leaves_the_batch() -> None:
    # "high" arrives last, so it runs after "low" in the running order; when it needs a block
    # "low" (already scheduled this step) is the victim and its tokens leave the batch.
    s, _ = make(num_blocks=4, block_size=4, max_model_len=16, policy="priority")
    s.add_request(req("low", [1] * 6, priority=5))
    step(s)
    s.add_request(req("high", [3] * 8, priority=0))
    out, _ = step(s)
    assert shape(out) == [("low", 6, 1, True), ("high", 0, 8, True)]  # pool now full
    out = s.schedule()  # low fits position 7; high's position 8 needs a block: low goes
    assert out.preempted_req_ids == ["low"]
    assert shape(out) == [("high", 8, 1, True)]
    assert out.total_num_scheduled_tokens == 1


def _priority_trio(budget: int, prompts: tuple[int, int, int], prios: tuple[int, int, int]):
    """Three requests arriving one step apart in a 6-block pool of 2-token blocks."""
    s, _ = make(
        num_blocks=6,
        block_size=2,
        max_model_len=12,
        max_num_batched_tokens=budget,
        policy="priority",
        enable_caching=False,
    )
    shapes = []
    for i, (n, p) in enumerate(zip(prompts, prios)):
        s.add_request(req(f"r{i}", [1] * n, priority=p, arrival_time=float(i)))
        shapes.append(shape(step(s)[0]))
    return s, shapes


def test_priority_victim_already_served_refunds_its_budget() -> None:
    s, shapes = _priority_trio(3, (5, 1, 4), (3, 1, 1))
    assert shapes[-1] == [("r0", 5, 1, True), ("r1", 1, 1, True), ("r2", 0, 1, False)]
    out = s.schedule()  # r0 gets its 6th block, then r1 needs one: r0 is evicted from the batch
    assert out.preempted_req_ids == ["r0"]
    # r0's token returns to the budget, so r2's chunk is 2 tokens, not 1.
    assert shape(out) == [("r1", 2, 1, True), ("r2", 1, 2, False)]


def test_priority_victim_before_the_cursor_does_not_skip_the_next_request() -> None:
    s, shapes = _priority_trio(5, (2, 1, 3), (3, 2, 0))
    assert shapes[-1] == [("r0", 3, 1, True), ("r1", 1, 1, True), ("r2", 0, 3, True)]
    out = s.schedule()
    assert out.preempted_req_ids == ["r0"]
    assert shape(out) == [("r1", 2, 1, True), ("r2", 3, 1, True)]


def test_request_preempting_itself_moves_on_and_nothing_is_admitted() -> None:
    s, kv = make(num_blocks=4, block_size=4, max_model_len=16)
    s.add_request(req("a", [1] * 8, max_tokens=8))
    s.add_request(req("b", [2] * 8, max_tokens=8))
    step(s)
    s.add_request(req("c", [3]))
    out = s.schedule()  # a needs block 3: b preempted; b would need one too but is gone
    assert out.preempted_req_ids == ["b"]
    assert [x.request_id for x in out.scheduled] == ["a"]  # c not admitted in this step
    assert [r.request_id for r in s.iter_waiting()] == ["b", "c"]
    assert kv.get_num_free_blocks() == 1


def test_prompt_that_never_fits_is_ignored_and_does_not_block() -> None:
    s, _ = make(num_blocks=4, block_size=4, max_model_len=20)
    s.add_request(req("too_long", [1] * 21))
    s.add_request(req("too_big", [1] * 17))  # under max_model_len but over the 16-token pool
    s.add_request(req("ok", [1] * 3, max_tokens=1))
    assert s.get_request("too_long") is None
    out = s.schedule()
    assert shape(out) == [("ok", 0, 3, True)]
    assert out.finished_req_ids == ["too_long", "too_big"]
    ups = s.update_from_output(out, {"ok": 9})
    assert [(u.request_id, u.finished, u.finish_reason) for u in ups] == [
        ("too_long", True, "ignored"),
        ("too_big", True, "ignored"),
        ("ok", True, "length"),
    ]
    assert "max_model_len" in ups[0].stop_reason and "pool" in ups[1].stop_reason
    assert s.get_stats().num_ignored == 2


def test_ignored_request_alone_is_still_reported() -> None:
    s, _ = make(max_model_len=8, max_num_batched_tokens=8)
    s.add_request(req("x", [1] * 9))
    assert s.has_unfinished_requests()
    out = s.schedule()
    assert out.is_empty()
    (u,) = s.update_from_output(out, {})
    assert u.finish_reason == "ignored"
    assert not s.has_unfinished_requests()


@pytest.mark.parametrize(
    ("kw", "tokens", "n_out", "reason", "stop_reason"),
    [
        ({}, [5, EOS], 2, "stop", None),
        ({"ignore_eos": True, "max_tokens": 3}, [EOS, EOS, EOS], 3, "length", None),
        ({"min_tokens": 2}, [EOS, 5, EOS], 3, "stop", None),
        ({"stop_token_ids": [42]}, [5, 42], 2, "stop", 42),
        ({"max_tokens": 2}, [5, 6], 2, "length", None),
        ({"max_tokens": 2}, [5, EOS], 2, "stop", None),  # a natural stop wins over the cap
        ({}, [5, 6, 7, 8, 9, 10], 4, "length", None),  # max_model_len = 8, prompt 4
    ],
)
def test_stop_rules(kw, tokens, n_out, reason, stop_reason) -> None:
    s, _ = make(max_model_len=8, max_num_batched_tokens=8)
    s.add_request(req("r", [1, 1, 1, 1], **kw))
    seen = []
    for t in tokens:
        out = s.schedule()
        ups = s.update_from_output(out, {"r": t})
        seen.extend(ups)
        if ups[-1].finished:
            break
    assert len(seen) == n_out
    last = seen[-1]
    assert (last.finished, last.finish_reason, last.stop_reason) == (True, reason, stop_reason)
    assert all(not u.finished for u in seen[:-1])


def test_abort_frees_blocks_now_and_reports_next_step() -> None:
    s, kv = make(num_blocks=8, block_size=4)
    s.add_request(req("a", [1] * 6))
    s.add_request(req("b", [2] * 6))
    step(s)
    s.add_request(req("w", [3] * 6))
    s.abort_requests(["a", "w", "unknown"])
    assert kv.get_num_free_blocks() == 6
    assert s.get_request("a") is None and s.get_request("w") is None
    out = s.schedule()
    assert out.finished_req_ids == ["a", "w"]
    assert [x.request_id for x in out.scheduled] == ["b"]


def test_abort_between_schedule_and_update_is_skipped() -> None:
    s, _ = make()
    s.add_request(req("a", [1] * 4))
    s.add_request(req("b", [1] * 4))
    out = s.schedule()
    s.abort_request("a")
    ups = s.update_from_output(out, {"a": 5, "b": 5})
    assert [u.request_id for u in ups] == ["b"]


def test_finish_requests_for_stop_strings() -> None:
    s, kv = make()
    s.add_request(req("a", [1] * 4))
    step(s)
    s.finish_requests("a", RequestStatus.FINISHED_STOPPED)
    assert not s.has_unfinished_requests() and kv.get_num_free_blocks() == 256
    with pytest.raises(ValueError, match="finished status"):
        s.finish_requests("a", RequestStatus.RUNNING)


def test_missing_sampled_token_is_a_clear_error() -> None:
    s, _ = make()
    s.add_request(req("a", [1] * 4))
    out = s.schedule()
    with pytest.raises(KeyError, match="no sampled token for request 'a'"):
        s.update_from_output(out, {})


def test_without_chunked_prefill_prompts_go_whole_and_in_order() -> None:
    s, _ = make(enable_chunked_prefill=False, max_num_batched_tokens=16, max_model_len=16)
    s.add_request(req("a", [1] * 10))
    s.add_request(req("b", [2] * 10))  # does not fit the 6 tokens left: waits, no chunk
    s.add_request(req("c", [3] * 2))  # would fit, but must not jump over b
    out = s.schedule()
    assert shape(out) == [("a", 0, 10, True)]
    s.update_from_output(out, {"a": 5})
    out = s.schedule()
    assert shape(out) == [("a", 10, 1, True), ("b", 0, 10, True), ("c", 0, 2, True)]


def test_max_num_seqs_and_fcfs_admission_order() -> None:
    s, _ = make(max_num_seqs=2)
    for rid in "abc":
        s.add_request(req(rid, [1, 2, 3]))
    out = s.schedule()
    assert [x.request_id for x in out.scheduled] == ["a", "b"]
    assert s.get_stats().num_running == 2 and s.get_stats().num_waiting == 1


def test_priority_admission_order() -> None:
    s, _ = make(policy="priority", max_num_seqs=3)
    s.add_request(req("late_low", [1], priority=3, arrival_time=1.0))
    s.add_request(req("b", [1], priority=1, arrival_time=3.0))
    s.add_request(req("a", [1], priority=1, arrival_time=2.0))
    s.add_request(req("urgent", [1], priority=0, arrival_time=9.0))
    out = s.schedule()
    assert [x.request_id for x in out.scheduled] == ["urgent", "a", "b"]


def test_block_table_is_the_managers_and_steps_report_new_blocks() -> None:
    s, kv = make(block_size=4)
    s.add_request(req("a", [1] * 4))
    out, _ = step(s)
    (x,) = out.scheduled
    assert x.num_new_blocks == 1 and x.new_block_ids == kv.get_block_ids("a")
    out = s.schedule()  # position 4 opens block 2
    (y,) = out.scheduled
    assert y.num_new_blocks == 1 and not y.is_new
    assert x.new_block_ids + y.new_block_ids == kv.get_block_ids("a")
    assert kv.num_request_blocks("a") == 2 and len(x.new_block_ids) == 1


def test_duplicate_and_reused_requests_are_rejected() -> None:
    s, _ = make()
    r = req("a", [1], max_tokens=1)
    s.add_request(r)
    with pytest.raises(ValueError, match="already in the scheduler"):
        s.add_request(req("a", [2]))
    step(s)
    with pytest.raises(ValueError, match="must be new"):
        s.add_request(r)
    with pytest.raises(TypeError):
        s.add_request("a")  # type: ignore[arg-type]


def test_request_capped_at_pool_capacity_when_the_pool_is_the_limit() -> None:
    # 2 blocks of 4 = 8 KV slots, far below max_model_len: the 9th token could never be
    # computed, so the request ends with "length" right after sampling it.
    s, kv = make(num_blocks=2, block_size=4, max_model_len=64)
    s.add_request(req("r", [1] * 6))
    s.add_request(req("full", [1] * 8, max_tokens=1))  # exactly the pool: accepted
    ups = []
    while s.has_unfinished_requests():
        ups += step(s, token=5)[1]
    r_ups = [u for u in ups if u.request_id == "r"]
    assert len(r_ups) == 3 and r_ups[-1].finish_reason == "length"
    assert [u.finish_reason for u in ups if u.request_id == "full"] == ["length"]
    assert kv.get_num_free_blocks() == 2


def test_block_completed_by_a_decode_is_hittable_at_once() -> None:
    s, _ = make(block_size=4)
    s.add_request(req("a", [11, 12, 13], max_tokens=8))
    step(s, token=14)  # prompt computed, token 14 sampled
    step(s, token=15)  # position 3 computed: block 0 = [11, 12, 13, 14] is full
    s.add_request(req("b", [11, 12, 13, 14, 99]))
    out = s.schedule()
    assert shape(out)[-1] == ("b", 4, 1, True)


def test_blocked_head_is_counted_once_in_prefix_cache_stats() -> None:
    """The head of the queue is looked up every step while it does not fit. Only its
    admission counts, and the scheduler reports the manager's figures (one owner): the old
    manager counted every lookup, so its figures and the scheduler's disagreed."""
    s, kv = make(num_blocks=5, block_size=4, max_model_len=16)
    s.add_request(req("a", [1] * 8 + [7], max_tokens=1))
    step(s)  # a finished; its two full blocks stay cached (and are never evicted below)
    s.add_request(req("hog", [2] * 7, max_tokens=5))
    step(s)  # hog: 2 blocks now, a 3rd from position 8, done at 12 tokens
    s.add_request(req("b", [1] * 8 + [3] * 5))  # hits 8 tokens, then needs 2 more blocks
    steps = 0
    while steps < 10 and s.get_request("b").status == RequestStatus.WAITING:
        out, _ = step(s)
        steps += 1
    assert steps == 5  # looked up and refused 4 times, admitted the 5th
    assert out.scheduled[-1].request_id == "b" and out.scheduled[-1].start_pos == 8
    totals = kv.prefix_cache_stats
    assert (totals.requests, totals.queries, totals.hits) == (3, 9 + 7 + 13, 8)
    stats = s.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (29, 8)
    interval = kv.make_prefix_cache_stats()
    assert (interval.requests, interval.queries, interval.hits) == (3, 29, 8)
    assert s.get_stats().prefix_cache_queries == 29  # per-interval reads leave the totals


def test_readmission_after_preemption_counts_as_an_admission() -> None:
    s, kv = make(num_blocks=4, block_size=4, max_model_len=16)
    s.add_request(req("old", [1] * 7, max_tokens=8))
    s.add_request(req("new", [3] * 7, max_tokens=8))
    step(s, token=5)
    step(s, token=5)
    out = s.schedule()
    assert out.preempted_req_ids == ["new"]
    assert kv.prefix_cache_stats.requests == 2
    s.update_from_output(out, {"old": 5})
    run_until_finished(s, "old")
    out = s.schedule()
    (x,) = out.scheduled
    assert x.request_id == "new" and x.is_new
    totals = kv.prefix_cache_stats
    assert totals.requests == 3 and totals.queries == 7 + 7 + 9


def test_scheduled_request_carries_the_record_and_says_when_it_is_new() -> None:
    s, kv = make(num_blocks=4, block_size=4, max_model_len=16)
    s.add_request(req("old", [1] * 7, max_tokens=8))
    s.add_request(req("new", [3] * 7, max_tokens=8))
    out, _ = step(s, token=5)
    assert [
        (x.is_new, x.num_new_blocks, kv.num_request_blocks(x.request_id)) for x in out.scheduled
    ] == [(True, 2, 2), (True, 2, 2)]
    assert [x.request for x in out.scheduled] == [s.get_request("old"), s.get_request("new")]
    out, _ = step(s, token=5)  # decodes inside the second block: nothing new
    assert [(x.is_new, x.num_new_blocks) for x in out.scheduled] == [(False, 0), (False, 0)]
    out = s.schedule()  # old opens its third block, new is preempted
    (x,) = out.scheduled
    assert (x.request_id, x.is_new, x.num_new_blocks) == ("old", False, 1)
    assert x.new_block_ids == kv.get_block_ids("old")[-1:]
    s.update_from_output(out, {"old": 5})
    new = s.get_request("new")
    first_time = new.first_scheduled_time
    run_until_finished(s, "old")
    (x,) = s.schedule().scheduled
    # Re-admitted: a new table (whatever the runner had for it is stale), same record.
    assert (x.request_id, x.is_new, x.num_new_blocks) == ("new", True, kv.num_request_blocks("new"))
    assert x.request is new and new.first_scheduled_time == first_time


def test_first_scheduled_time_is_the_first_admission_on_the_monotonic_clock() -> None:
    s, _ = make(max_num_seqs=1)
    s.add_request(req("a", [1, 2, 3], max_tokens=2))
    s.add_request(req("b", [1, 2, 3]))
    before = time.monotonic()
    step(s)
    a, b = s.get_request("a"), s.get_request("b")
    assert before <= a.first_scheduled_time <= time.monotonic()
    assert b.first_scheduled_time is None  # still waiting: max_num_seqs=1
    assert a.first_scheduled_time >= a.arrival_time


def test_add_request_attaches_the_managers_hasher_and_hashes_the_prompt() -> None:
    s, kv = make(block_size=4)
    r = req("a", list(range(10)), cache_salt="t")
    s.add_request(r)
    chain = hash_block_chain(get_hash_fn(), list(range(10)), 4, ("t",))
    assert r.block_hasher is kv.block_hasher and r.block_hashes == chain
    out = s.schedule()
    s.update_from_output(out, {"a": 10})
    s.update_from_output(s.schedule(), {"a": 11})  # 12 tokens: the third block is full
    assert r.block_hashes == hash_block_chain(get_hash_fn(), list(range(12)), 4, ("t",))

    s, _ = make(block_size=4, enable_caching=False)
    r = req("a", list(range(10)))
    s.add_request(r)
    assert r.block_hasher is None and r.block_hashes == []


def test_a_request_with_hashes_from_elsewhere_is_not_new() -> None:
    s, kv = make(block_size=4)
    r = req("a", list(range(8)))
    assert kv.block_hasher is not None
    r.block_hashes.extend(kv.block_hasher(r))
    with pytest.raises(ValueError, match="must be new"):
        s.add_request(r)


def test_undo_step_preempts_everything_and_uncaches_the_steps_blocks() -> None:
    s, kv = make(block_size=4)
    s.add_request(req("a", [9] * 9, max_tokens=4))
    step(s)  # a computed 9 tokens (2 full blocks cached) and sampled one
    s.add_request(req("b", [8] * 8, max_tokens=4))
    out = s.schedule()
    assert shape(out) == [("a", 9, 1, True), ("b", 0, 8, True)]
    s.undo_step(out)  # the step's forward raised: nothing it was to compute is
    a, b = s.get_request("a"), s.get_request("b")
    assert a.status == b.status == RequestStatus.PREEMPTED
    assert a.num_computed_tokens == b.num_computed_tokens == 0 and a.num_tokens == 10
    assert kv.get_num_free_blocks() == kv.num_blocks
    # a's first 2 blocks were written by an earlier step: still hit-able. b's were not.
    assert kv.get_computed_blocks(a)[1] == 8 and kv.get_computed_blocks(b)[1] == 0
    out = s.schedule()  # the runner hears of the preemptions, then both come back
    assert out.preempted_req_ids == ["b", "a"]  # newest first
    assert shape(out) == [("a", 8, 2, True), ("b", 0, 8, True)]
    assert all(x.is_new for x in out.scheduled)


def test_restrict_to_schedules_only_the_subset_and_holds_the_rest_in_order() -> None:
    s, _ = make(max_num_seqs=8)
    for rid in "abc":
        s.add_request(req(rid, [5, 6], max_tokens=8))
    step(s)
    with pytest.raises(ValueError, match="preempt the running requests"):
        s.restrict_to(["b"])
    s.preempt_all_running()
    s.restrict_to(["b"])
    assert s.restricted_to == {"b"}
    s.add_request(req("d", [5], max_tokens=8))  # arrives while restricted: held
    out, _ = step(s)
    assert out.preempted_req_ids == ["c", "b", "a"] and shape(out) == [("b", 0, 3, True)]
    stats = s.get_stats()
    assert (stats.num_running, stats.num_waiting) == (1, 3)
    assert [r.request_id for r in s.iter_waiting()] == []
    s.abort_requests("c")  # a held request can be aborted
    s.preempt_all_running()
    s.restrict_to(None)
    assert s.restricted_to is None
    assert [r.request_id for r in s.iter_waiting()] == ["a", "b", "d"]  # arrival order
    out, _ = step(s)
    assert [x.request_id for x in out.scheduled] == ["a", "b", "d"]
    assert out.finished_req_ids == ["c"]


def test_fcfs_after_a_restricted_step_preempts_the_newest_and_requeues_in_arrival_order() -> None:
    """A restricted step can run a later arrival ("c") while earlier ones are held; once they
    run together, the pool running dry must still preempt the newest arrival and put it back
    behind the older request still waiting (found by the state machine)."""
    s, _ = make(num_blocks=4, block_size=4, max_model_len=16, max_num_seqs=8)
    for rid in "abc":
        s.add_request(req(rid, [ord(rid)] * 7, max_tokens=8))
    s.restrict_to(["c"])
    out, _ = step(s, token=5)
    assert shape(out) == [("c", 0, 7, True)]
    s.restrict_to(None)
    out, _ = step(s, token=5)  # "a" joins (the pool is then full); "b" waits
    assert [x.request_id for x in out.scheduled] == ["c", "a"]
    out = s.schedule()  # "c" needs a third block: the newest arrival, "c" itself, goes
    assert out.preempted_req_ids == ["c"] and shape(out) == [("a", 7, 1, True)]
    assert [r.request_id for r in s.iter_waiting()] == ["b", "c"]


def test_max_loras_bounds_the_distinct_adapters_running_together() -> None:
    """Two adapter slots: a third adapter waits (in order) until one's requests finish;
    base-model requests and requests of a running adapter are never held back."""
    s, _ = make(max_loras=2)
    s.add_request(req("a", [1] * 5, max_tokens=2, lora_int_id=1))
    s.add_request(req("b", [1] * 5, max_tokens=5, lora_int_id=2))
    s.add_request(req("c", [1] * 5, max_tokens=2, lora_int_id=3))
    s.add_request(req("d", [1] * 5, max_tokens=2))
    out, _ = step(s)
    assert [x.request_id for x in out.scheduled] == ["a", "b"]  # c waits, d behind it (FCFS)
    run_until_finished(s, "a")
    out, _ = step(s)  # a's slot is free: c (then d) come in next to b
    assert [x.request_id for x in out.scheduled] == ["b", "c", "d"]


def test_lora_requests_hash_their_blocks_apart() -> None:
    """The same prompt under two adapters (and the base) shares no cached block."""
    s, _ = make()
    prompt = list(range(3, 40))
    for i, lora in enumerate((0, 1, 2, 1)):
        r = req(f"r{i}", prompt, max_tokens=1, lora_int_id=lora)
        s.add_request(r)
        out, _ = step(s)
        assert out.scheduled[0].start_pos == (32 if i == 3 else 0), i  # only r3 hits (r1's)
        run_until_finished(s, f"r{i}")
