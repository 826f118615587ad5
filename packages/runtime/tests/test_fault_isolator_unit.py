"""FaultIsolator on its own: a real Scheduler and KV cache manager, a fake model loop.

The isolator only uses the scheduler's public surface, so it is driven here exactly as the
engine core drives it — `on_step_failed` when a step raises, `on_step_done` after a good
one — with no model: a step "raises" when a poisoned token is among its input ids, and a
good step samples a token that is a function of the request's whole context, so a request
that lost or duplicated a token on the way (undo, preemption, restriction) gives itself away.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagemill.blockpool import KVCacheManager
from pagemill.runtime.engine.fault_isolation import (
    MAX_CONSECUTIVE_CULPRITS,
    EngineFaultError,
    FaultIsolator,
)
from pagemill.scheduler import Request, Scheduler, SchedulerConfig, SchedulerOutput

POISON = 1
VOCAB = 50


def _next_token(context: list[int]) -> int:
    return 2 + hash(tuple(context)) % (VOCAB - 2)


def _good(n: int, seed: int) -> list[int]:
    return [2 + (seed * 7 + i * 3) % (VOCAB - 2) for i in range(n)]


def _engine(
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 64,
    max_num_seqs: int = 8,
    prefix: bool = True,
) -> tuple[Scheduler, FaultIsolator, KVCacheManager]:
    kv = KVCacheManager(num_blocks, block_size, enable_caching=prefix, hash_algo="xxh3_128")
    cfg = SchedulerConfig(
        max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=64
    )
    sched = Scheduler(cfg, kv)
    return sched, FaultIsolator(sched), kv


def _step(
    sched: Scheduler,
    iso: FaultIsolator,
    finished: dict[str, tuple[str, list[int]]],
    errors: list[str],
) -> SchedulerOutput:
    out = sched.schedule()
    if any(POISON in s.token_ids for s in out.scheduled):
        for u in iso.on_step_failed(out, RuntimeError("boom")):
            assert u.finished and u.finish_reason == "error" and u.new_token_ids == []
            errors.append(u.request_id)
        return out
    sampled = {
        s.request_id: _next_token(s.request.all_token_ids) for s in out.scheduled if s.sample
    }
    for u in sched.update_from_output(out, sampled):
        if u.finished:
            req = next(s.request for s in out.scheduled if s.request_id == u.request_id)
            finished[u.request_id] = (u.finish_reason or "", list(req.output_token_ids))
    iso.on_step_done()
    return out


def _assert_clean(sched: Scheduler, iso: FaultIsolator, kv: KVCacheManager) -> None:
    assert not sched.has_unfinished_requests()
    assert kv.get_num_free_blocks() == kv.num_blocks and kv.req_to_blocks == {}
    assert sched.restricted_to is None and not iso.active and iso.suspects == []


def _expected(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(_next_token(tokens))
    return tokens[len(prompt) :]


def test_the_culprit_fails_alone_and_the_others_lose_nothing() -> None:
    sched, iso, kv = _engine()
    prompts = {f"r{i}": _good(5 + i, i) for i in range(7)}
    prompts["r4"][2] = POISON
    for rid, p in prompts.items():
        sched.add_request(Request(rid, p, max_tokens=5))
    finished: dict[str, tuple[str, list[int]]] = {}
    errors: list[str] = []
    out = _step(sched, iso, finished, errors)
    assert len(out.scheduled) == 7 and iso.active
    assert iso.suspects == ["r0", "r1", "r2"] and sched.restricted_to == {"r0", "r1", "r2"}
    stats = sched.get_stats()
    assert stats.num_running == 0 and stats.num_waiting == 7  # the held ones count as waiting
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        _step(sched, iso, finished, errors)
    assert errors == ["r4"] and iso.num_culprits == 1
    assert iso.num_failed_steps <= 4  # 1 + ceil(log2 7)
    for rid, p in prompts.items():
        if rid != "r4":
            assert finished[rid] == ("length", _expected(p, 5)), rid
    _assert_clean(sched, iso, kv)


def test_a_request_added_during_isolation_waits_for_it() -> None:
    sched, iso, kv = _engine()
    sched.add_request(Request("bad", [3, POISON, 4], max_tokens=2))
    sched.add_request(Request("ok", _good(6, 1), max_tokens=2))
    finished: dict[str, tuple[str, list[int]]] = {}
    errors: list[str] = []
    _step(sched, iso, finished, errors)
    assert iso.suspects == ["bad"]
    sched.add_request(Request("late", _good(4, 2), max_tokens=2))
    out = _step(sched, iso, finished, errors)  # only "bad" runs, fails alone
    assert [s.request_id for s in out.scheduled] == ["bad"] and errors == ["bad"]
    assert iso.suspects == ["ok"] and sched.restricted_to == {"ok"}
    out = _step(sched, iso, finished, errors)
    assert [s.request_id for s in out.scheduled] == ["ok"]
    while sched.has_unfinished_requests():
        _step(sched, iso, finished, errors)
    assert set(finished) == {"ok", "late"}
    _assert_clean(sched, iso, kv)


def test_an_abort_during_isolation() -> None:
    sched, iso, kv = _engine()
    for i in range(4):
        sched.add_request(Request(f"r{i}", [POISON] * (i == 0) + _good(5, i), max_tokens=3))
    finished: dict[str, tuple[str, list[int]]] = {}
    errors: list[str] = []
    _step(sched, iso, finished, errors)
    sched.abort_requests(["r1", "r3"])  # one suspect, one held aside
    while sched.has_unfinished_requests():
        _step(sched, iso, finished, errors)
    assert errors == ["r0"] and set(finished) == {"r2"}
    _assert_clean(sched, iso, kv)


def test_device_errors_and_a_broken_engine_are_not_contained() -> None:
    sched, iso, _ = _engine()
    sched.add_request(Request("a", [3, 4], max_tokens=2))
    out = sched.schedule()
    with pytest.raises(RuntimeError, match="CUDA error"):
        iso.on_step_failed(out, RuntimeError("CUDA error: an illegal memory access"))
    sched, iso, _ = _engine()
    for i in range(MAX_CONSECUTIVE_CULPRITS + 2):
        sched.add_request(Request(f"r{i}", _good(3, i), max_tokens=2))
    with pytest.raises(EngineFaultError, match="in a row"):
        for _ in range(200):
            iso.on_step_failed(sched.schedule(), RuntimeError("the weights are gone"))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(
        st.tuples(st.integers(1, 14), st.booleans(), st.integers(0, 6), st.integers(1, 4)),
        min_size=1,
        max_size=10,
    ),
    num_blocks=st.integers(8, 24),
    budget=st.integers(4, 40),
    max_num_seqs=st.integers(1, 6),
    prefix=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_isolation_finds_every_culprit_and_loses_no_token(
    reqs, num_blocks, budget, max_num_seqs, prefix, seed
) -> None:
    """Random arrivals (some during isolation), at most 3 poisoned prompts, pools small
    enough to preempt: each poisoned request, and only those, ends with "error"; every other
    one generates exactly its tokens; the pool ends empty and the restriction lifted."""
    sched, iso, kv = _engine(num_blocks, 4, budget, max_num_seqs, prefix)
    poisoned_budget = 3
    prompts: dict[str, list[int]] = {}
    arrivals: dict[int, list[tuple[str, list[int], int]]] = {}
    for i, (n, poisoned, at, max_tokens) in enumerate(reqs):
        p = _good(n, seed + i % 3)  # shared prefixes now and then
        if poisoned and poisoned_budget:
            poisoned_budget -= 1
            p[(seed + i) % n] = POISON
        rid = f"r{i}"
        prompts[rid] = p
        arrivals.setdefault(at, []).append((rid, p, max_tokens))
    finished: dict[str, tuple[str, list[int]]] = {}
    errors: list[str] = []
    max_tokens_of = {rid: m for batch in arrivals.values() for rid, _, m in batch}
    step = 0
    while sched.has_unfinished_requests() or step <= max(arrivals):
        for rid, p, m in arrivals.get(step, ()):
            sched.add_request(Request(rid, p, max_tokens=m))
        _step(sched, iso, finished, errors)
        step += 1
        assert step < 2000
    bad = {rid for rid, p in prompts.items() if POISON in p}
    assert set(errors) == bad and len(errors) == len(bad)
    assert set(finished) == set(prompts) - bad
    for rid, (reason, tokens) in finished.items():
        assert (reason, tokens) == ("length", _expected(prompts[rid], max_tokens_of[rid])), rid
    _assert_clean(sched, iso, kv)
