"""Property test: a fake model loop drives the scheduler through random arrivals (shared
prefixes, priorities, salts), random EOS, aborts and pools small enough to preempt.

The test keeps its own record of every request (tokens, computed length) and a fake KV
cache: each slot written holds (salt, every token up to that position), which is what the
real KV of that position depends on. Reading a request's whole context back through its
block table after each step therefore checks block tables, prefix sharing and recompute
after preemption together, independent of how the scheduler decided.

The request record is checked against the same independent view: its block hashes are
always the chain over its full blocks, and the prefix-cache stats count each admission once.

One block table per request: the KV cache manager's. The test keeps the table a model runner
would mirror, built only from each step's `new_block_ids` (the whole table when `is_new`, the
appended blocks otherwise), reads and writes its fake KV through that mirror, and checks it
equals the manager's table after every step.

Failed steps and restrictions (what the engine's fault isolation does through the
scheduler's public surface) are rules too: a step whose forward "raises" writes garbage
into the slots it was given and is undone (`undo_step`), and `restrict_to` limits
scheduling to a random subset of the live requests until lifted. No request may ever read
the garbage back, lose a token, or be scheduled outside the subset.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pagemill.blockpool import KVCacheManager, get_hash_fn, hash_block_chain
from pagemill.scheduler import (
    Request,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

EOS = 0
STOP = 1
VOCAB = 12


@dataclass
class Tracked:
    """The test's independent view of one request."""

    req: Request
    tokens: list[int]
    prompt_len: int
    max_tokens: int | None
    min_tokens: int
    ignore_eos: bool
    salt: str | None
    key: tuple[int, float, int]  # (priority, arrival time, arrival order)
    computed: int = 0
    running: bool = False
    finished: bool = False
    table: tuple[int, ...] = ()  # the block table as of the last step that scheduled it
    first_scheduled_time: float | None = None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([2, 4]),
        max_model_len=st.integers(6, 24),
        extra_blocks=st.integers(0, 4),
        budget=st.integers(1, 24),
        max_num_seqs=st.integers(1, 5),
        threshold=st.sampled_from([0, 0, 3, 5]),
        chunked=st.booleans(),
        prefix=st.booleans(),
        policy=st.sampled_from(["fcfs", "priority"]),
        seed=st.integers(0, 2**32 - 1),
    )
    def setup(
        self,
        block_size,
        max_model_len,
        extra_blocks,
        budget,
        max_num_seqs,
        threshold,
        chunked,
        prefix,
        policy,
        seed,
    ) -> None:
        if not chunked:
            budget = max(budget, max_model_len)
            threshold = 0
        # The pool always holds one max-length request (the liveness premise).
        self.num_blocks = cdiv(max_model_len, block_size) + extra_blocks
        self.bs = block_size
        self.cfg = SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            long_prefill_token_threshold=threshold,
            enable_chunked_prefill=chunked,
            policy=policy,
        )
        self.prefix = prefix
        self.kv = KVCacheManager(
            self.num_blocks, block_size, enable_caching=prefix, hash_algo="xxh3_128"
        )
        self.hash_fn = get_hash_fn("xxh3_128")
        self.sched = Scheduler(self.cfg, self.kv)
        self.expected_prefix_stats = [0, 0, 0]  # admissions, queried tokens, hit tokens
        self.rng = random.Random(seed)
        self.prefixes = [[self.rng.randrange(2, VOCAB) for _ in range(n)] for n in (3, 5, 9)]
        self.tracked: dict[str, Tracked] = {}
        self.expect_ignored: list[str] = []
        self.expect_finished_ids: set[str] = set()
        self.kv_slots: dict[int, tuple] = {}
        self.expect_preempted: list[str] = []  # preempted between steps, for the next output
        self.next_id = 0
        self.clock = 0.0
        self.consistent = True

    # ------------------------------------------------------------------ rules

    @rule(
        prefix_idx=st.integers(-1, 2),
        suffix_len=st.integers(0, 10),
        priority=st.integers(0, 3),
        max_tokens=st.one_of(st.none(), st.integers(1, 8)),
        min_tokens=st.integers(0, 3),
        ignore_eos=st.booleans(),
        salt=st.sampled_from([None, None, "s"]),
    )
    def add(
        self, prefix_idx, suffix_len, priority, max_tokens, min_tokens, ignore_eos, salt
    ) -> None:
        prompt = list(self.prefixes[prefix_idx]) if prefix_idx >= 0 else []
        prompt += [self.rng.randrange(2, VOCAB) for _ in range(suffix_len)]
        del prompt[self.cfg.max_model_len - 2 :]  # leave room to generate a little
        if self.rng.random() < 0.08:  # now and then a prompt that can never run
            prompt += [3] * (self.cfg.max_model_len + 1)
        if not prompt:
            prompt = [5]
        if max_tokens is not None:
            min_tokens = min(min_tokens, max_tokens)
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.clock += self.rng.choice([0.0, 1.0])  # equal arrival times exercise the tie-break
        r = Request(
            rid,
            prompt,
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            eos_token_id=EOS,
            stop_token_ids=[STOP],
            ignore_eos=ignore_eos,
            priority=priority,
            arrival_time=self.clock,
            cache_salt=salt,
        )
        self.sched.add_request(r)
        if len(prompt) > min(self.cfg.max_model_len, self.num_blocks * self.bs):
            assert r.status == RequestStatus.FINISHED_IGNORED
            self.expect_ignored.append(rid)
            self.expect_finished_ids.add(rid)
            return
        assert r.block_hasher is self.kv.block_hasher
        self.tracked[rid] = Tracked(
            r,
            list(prompt),
            len(prompt),
            max_tokens,
            min_tokens,
            ignore_eos,
            salt,
            (priority, self.clock, self.next_id),
        )

    @precondition(lambda self: any(not t.finished for t in self.tracked.values()))
    @rule(data=st.data())
    def abort(self, data) -> None:
        rid = data.draw(
            st.sampled_from(sorted(r for r, t in self.tracked.items() if not t.finished))
        )
        self._abort(rid)

    @rule(abort_mid=st.booleans())
    def step(self, abort_mid: bool) -> None:
        self._step(abort_mid)

    @rule()
    def drain(self) -> None:
        self._drain()

    @rule()
    def failed_step(self) -> None:
        """The step's forward raises after writing part of its KV: the step is undone."""
        self.consistent = False
        sched, bs = self.sched, self.bs
        waiting_before = [r.request_id for r in sched.iter_waiting()]
        running_before = {r.request_id for r in sched.running}
        out = sched.schedule()
        self._check_output(out, waiting_before, running_before)
        for s in out.scheduled:
            t = self.tracked[s.request_id]
            for p in range(s.start_pos, s.start_pos + s.num_tokens):
                self.kv_slots[t.table[p // bs] * bs + p % bs] = ("garbage",)
        order = [r.request_id for r in reversed(sched.running)]
        sched.undo_step(out)
        self._after_preempt_all(order)
        self.consistent = True

    @precondition(lambda self: any(not t.finished for t in self.tracked.values()))
    @rule(data=st.data())
    def restrict(self, data) -> None:
        live = sorted(r for r, t in self.tracked.items() if not t.finished)
        subset = data.draw(st.lists(st.sampled_from(live), unique=True))
        order = [r.request_id for r in reversed(self.sched.running)]
        self.sched.preempt_all_running()
        self._after_preempt_all(order)
        self.sched.restrict_to(subset)
        assert self.sched.restricted_to == set(subset)

    @rule()
    def lift(self) -> None:
        self.sched.restrict_to(None)
        assert self.sched.restricted_to is None

    def teardown(self) -> None:
        # After a failed check the test's record is stale: draining would only add a
        # second, misleading failure (and slow the shrinking down).
        if hasattr(self, "sched") and self.consistent:
            self._drain()

    # ------------------------------------------------------------------ helpers

    def _abort(self, rid: str) -> None:
        t = self.tracked[rid]
        was_consistent, self.consistent = self.consistent, False
        self.sched.abort_requests([rid])
        t.finished, t.running = True, False
        assert self.sched.get_request(rid) is None
        assert t.req.status == RequestStatus.FINISHED_ABORTED
        assert not self.kv.has_request(rid)
        self.expect_finished_ids.add(rid)
        self.consistent = was_consistent

    def _after_preempt_all(self, order: list[str]) -> None:
        assert not self.sched.running
        for rid in order:
            t = self.tracked[rid]
            assert t.req.status == RequestStatus.PREEMPTED and t.req.num_computed_tokens == 0
            assert not self.kv.has_request(rid)
            t.running, t.computed, t.table = False, 0, ()
        self.expect_preempted += order

    def _live(self) -> list[Tracked]:
        return [t for t in self.tracked.values() if not t.finished]

    def _drain(self) -> None:
        # Liveness: with arrivals stopped every request finishes. Each step computes at
        # least one token; a life is at most max_model_len tokens. Drains measured on
        # thousands of runs stay under 1 * max_model_len * (live + 1) steps; the bound leaves
        # 4x headroom for recomputation after preemption, and fails a livelock fast.
        self.sched.restrict_to(None)
        bound = 4 * self.cfg.max_model_len * (len(self._live()) + 1) + 20
        for _ in range(bound):
            if not self.sched.has_unfinished_requests():
                break
            self._step(False)
        else:
            self.consistent = False
            raise AssertionError(f"not drained after {bound} steps: {self.sched.requests}")
        assert not self._live()
        assert self.kv.get_num_free_blocks() == self.num_blocks
        assert self.kv.usage == 0.0
        assert not self.sched.running and not self.sched.waiting
        stats = self.sched.get_stats()
        assert (stats.num_running, stats.num_waiting) == (0, 0)

    def _step(self, abort_mid: bool) -> None:
        self.consistent = False
        sched, bs = self.sched, self.bs
        waiting_before = [r.request_id for r in sched.iter_waiting()]
        running_before = {r.request_id for r in sched.running}
        out = sched.schedule()
        self._check_output(out, waiting_before, running_before)

        # Fake forward: write the KV of every scheduled position, then read every
        # request's whole context back through its block table.
        for s in out.scheduled:
            t = self.tracked[s.request_id]
            for p in range(s.start_pos, s.start_pos + s.num_tokens):
                slot = t.table[p // bs] * bs + p % bs
                self.kv_slots[slot] = (t.salt, tuple(t.tokens[: p + 1]))
        for s in out.scheduled:
            t = self.tracked[s.request_id]
            for p in range(s.start_pos + s.num_tokens):
                slot = t.table[p // bs] * bs + p % bs
                assert self.kv_slots.get(slot) == (t.salt, tuple(t.tokens[: p + 1])), (
                    f"{s.request_id}: wrong KV at position {p}"
                )

        if abort_mid and out.scheduled:
            self._abort(self.rng.choice(out.scheduled).request_id)

        sampled: dict[str, int] = {}
        for s in out.scheduled:
            if s.sample:
                x = self.rng.random()
                sampled[s.request_id] = (
                    EOS if x < 0.12 else STOP if x < 0.16 else (self.rng.randrange(2, VOCAB))
                )
        updates = sched.update_from_output(out, sampled)
        self._check_updates(out, sampled, updates)
        self.consistent = True

    def _check_output(
        self, out: SchedulerOutput, waiting_before: list[str], running_before: set[str]
    ) -> None:
        sched, cfg, bs = self.sched, self.cfg, self.bs
        total = sum(s.num_tokens for s in out.scheduled)
        assert total == out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(sched.running) <= cfg.max_num_seqs
        ids = [s.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids))
        assert set(out.finished_req_ids) == self.expect_finished_ids
        self.expect_finished_ids = set()

        # Preemption: victims are requeued with nothing computed and no blocks; they were
        # the lowest-priority / newest of what ran, and the step admitted nobody.
        admitted = [rid for rid in ids if rid not in running_before]
        running_keys = [self.tracked[r.request_id].key for r in sched.running]
        # Preempted between steps (undo_step, preempt_all_running) come first, in order.
        between = self.expect_preempted
        self.expect_preempted = []
        assert out.preempted_req_ids[: len(between)] == between
        in_step = out.preempted_req_ids[len(between) :]
        for rid in in_step:
            t = self.tracked[rid]
            assert rid in running_before and rid not in ids
            assert t.req.status == RequestStatus.PREEMPTED and t.req.num_computed_tokens == 0
            assert not self.kv.has_request(rid)
            if cfg.policy == "fcfs":
                assert all(t.key[2] > k[2] for k in running_keys)
            else:
                assert all(t.key > k for k in running_keys)
            t.running, t.computed, t.table = False, 0, ()
        if in_step:
            assert not admitted
        # Admission follows policy order: the admitted are the head of the waiting queue.
        assert admitted == waiting_before[: len(admitted)]

        for s in out.scheduled:
            t = self.tracked[s.request_id]
            assert not t.finished and t.req.status == RequestStatus.RUNNING
            assert s.num_tokens == len(s.token_ids) > 0
            assert s.token_ids == t.tokens[s.start_pos : s.start_pos + s.num_tokens]
            end = s.start_pos + s.num_tokens
            assert end <= len(t.tokens) and end <= cfg.max_model_len
            assert s.sample == (end == len(t.tokens))
            if cfg.long_prefill_token_threshold:
                assert s.num_tokens <= cfg.long_prefill_token_threshold
            if not cfg.enable_chunked_prefill:
                assert s.sample  # whole prompts only
            assert s.request is t.req
            assert s.is_new == (s.request_id not in running_before)
            if s.request_id in running_before:
                assert s.start_pos == t.computed
                # The table only grew, by exactly the blocks reported as new.
                t.table = t.table + tuple(s.new_block_ids)
                assert t.req.first_scheduled_time == t.first_scheduled_time
            else:  # (re)admitted: any skipped prefix is whole cached blocks
                assert s.start_pos % bs == 0 and s.start_pos < len(t.tokens)
                t.table = tuple(s.new_block_ids)
                if not self.prefix:
                    assert s.start_pos == 0
                else:
                    self.expected_prefix_stats[0] += 1
                    self.expected_prefix_stats[1] += len(t.tokens)
                    self.expected_prefix_stats[2] += s.start_pos
                assert t.req.first_scheduled_time is not None
                if t.first_scheduled_time is None:  # the first admission, not a return
                    t.first_scheduled_time = t.req.first_scheduled_time
                    assert t.req.num_cached_tokens == s.start_pos
                else:
                    assert t.req.first_scheduled_time == t.first_scheduled_time
                t.running = True
            # The runner's mirror is the manager's table, and covers computed + scheduled.
            assert list(t.table) == self.kv.get_block_ids(s.request_id)
            assert s.num_new_blocks == len(s.new_block_ids)
            assert len(t.table) * bs >= end
            t.computed = end
            assert t.req.num_computed_tokens == end

        # Queues: no request both running and waiting; FCFS waiting stays in arrival order.
        running_ids = [r.request_id for r in sched.running]
        waiting = list(sched.iter_waiting())
        waiting_ids = [r.request_id for r in waiting]
        assert not set(running_ids) & set(waiting_ids)
        live = {t.req.request_id for t in self._live()}
        assert len(running_ids) + len(waiting_ids) == len(set(running_ids) | set(waiting_ids))
        allowed = sched.restricted_to
        if allowed is None:
            assert set(running_ids) | set(waiting_ids) == live
        else:  # the others wait aside
            assert set(running_ids) | set(waiting_ids) == live & allowed
            assert set(ids) <= allowed
        for r in sched.running:
            assert r.status == RequestStatus.RUNNING and self.tracked[r.request_id].running
            # Running but not scheduled this step: its table did not change either.
            assert list(self.tracked[r.request_id].table) == self.kv.get_block_ids(r.request_id)
            assert len(self.kv.get_block_ids(r.request_id)) * bs >= r.num_computed_tokens
        for r in waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert r.num_computed_tokens == 0 and not self.kv.has_request(r.request_id)
        keys = [self.tracked[rid].key for rid in waiting_ids]
        if cfg.policy == "fcfs":
            assert [k[2] for k in keys] == sorted(k[2] for k in keys)
        else:
            assert keys == sorted(keys)
        # No leak: exactly the blocks of running requests are in use.
        in_use = {b for rid in running_ids for b in self.kv.get_block_ids(rid)}
        assert self.kv.get_num_free_blocks() == self.num_blocks - len(in_use)

    def _check_updates(self, out, sampled, updates) -> None:
        cfg = self.cfg
        ignored, rest = updates[: len(self.expect_ignored)], updates[len(self.expect_ignored) :]
        assert [u.request_id for u in ignored] == self.expect_ignored
        assert all(
            u.finished and u.finish_reason == "ignored" and not u.new_token_ids for u in ignored
        )
        self.expect_ignored = []
        expected_ids = [
            s.request_id
            for s in out.scheduled
            if s.sample and not self.tracked[s.request_id].finished
        ]
        assert [u.request_id for u in rest] == expected_ids
        cap = min(cfg.max_model_len, self.num_blocks * self.bs + 1)
        for u in rest:
            t = self.tracked[u.request_id]
            tok = sampled[u.request_id]
            assert u.new_token_ids == [tok]
            t.tokens.append(tok)
            n_out = len(t.tokens) - t.prompt_len
            reason, stop_reason = None, None
            if n_out >= t.min_tokens and ((tok == EOS and not t.ignore_eos) or tok == STOP):
                reason, stop_reason = "stop", (STOP if tok == STOP else None)
            elif (t.max_tokens is not None and n_out >= t.max_tokens) or len(t.tokens) >= cap:
                reason = "length"
            assert (u.finished, u.finish_reason, u.stop_reason) == (
                reason is not None,
                reason,
                stop_reason,
            )
            assert t.req.all_token_ids == t.tokens
            assert t.req.output_token_ids == t.tokens[t.prompt_len :]
            assert t.req.prompt_token_ids == t.tokens[: t.prompt_len]
            if reason is not None:
                t.finished, t.running = True, False
                self.expect_finished_ids.add(u.request_id)
                assert self.sched.get_request(u.request_id) is None
                assert not self.kv.has_request(u.request_id)

    @invariant()
    def stats_match(self) -> None:
        if not hasattr(self, "sched"):
            return
        stats = self.sched.get_stats()
        assert stats.num_running == len(self.sched.running)
        live = sum(1 for t in self.tracked.values() if not t.finished)
        assert stats.num_waiting == live - len(self.sched.running)
        assert 0 <= stats.prefix_cache_hits <= stats.prefix_cache_queries
        # One owner, one count per admission: a head of the queue retried while the pool is
        # full must not add to either figure.
        totals = self.kv.prefix_cache_stats
        assert [totals.requests, totals.queries, totals.hits] == self.expected_prefix_stats
        assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (
            totals.queries,
            totals.hits,
        )

    @invariant()
    def block_hashes_follow_the_tokens(self) -> None:
        if not hasattr(self, "sched"):
            return
        for t in self._live():
            if self.prefix:
                extra = () if t.salt is None else (t.salt,)
                assert t.req.block_hashes == hash_block_chain(
                    self.hash_fn, t.tokens, self.bs, extra
                )
            else:
                assert t.req.block_hasher is None and t.req.block_hashes == []


SchedulerMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_scheduler_state_machine = SchedulerMachine.TestCase
