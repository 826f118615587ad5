"""Iteration-level scheduler: which requests compute how many tokens in the next step.

One step = schedule() -> model runner -> update_from_output(). schedule() serves the running
requests first (decodes and unfinished prompt chunks), preempting by recompute when the KV
pool runs dry, then admits waiting requests in policy order while the token budget and
`max_num_seqs` last. `num_computed_tokens` is advanced at the end of schedule() (the
runner is assumed to compute what it was given); update_from_output() only appends
sampled tokens, applies the stop rules and frees finished requests' blocks at once.

Prefix caching is the KV cache manager's: whether it is on (`enable_caching`), the block
hasher the scheduler attaches to each request, and the hit statistics.

Block tables are the KV cache manager's alone (`KVCacheManager.req_to_blocks`): the
scheduler keeps no copy, and hands the runner only what changed in each table this step
(`ScheduledRequest.new_block_ids`: the whole table on (re)admission, else the appended
blocks).

Per step the work is O(scheduled requests + new tokens): no request's prompt or block table
is copied whole, and the waiting queue is only touched at its head.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from pagemill.blockpool import HybridKVCacheManager, KVCacheBlocks
from pagemill.scheduler.config import SchedulerConfig
from pagemill.scheduler.output import RequestUpdate, ScheduledRequest, SchedulerOutput
from pagemill.scheduler.request import Request, RequestStatus
from pagemill.scheduler.stats import SchedulerStats
from pagemill.scheduler.stopping import check_stop
from pagemill.scheduler.waiting_queue import make_waiting_queue, priority_key

if TYPE_CHECKING:
    from pagemill.blockpool import KVCacheBlock, KVCacheManager

    # Block ids a step adds to a request's table: group 0's, and every group's (or None)
    # when the manager keeps one table per KV cache group.
    _NewIds = tuple[list[int], tuple[list[int], ...] | None]

_RUNNING = RequestStatus.RUNNING
_WAITING = RequestStatus.WAITING
_PREEMPTED = RequestStatus.PREEMPTED


class Scheduler:
    """Continuous-batching scheduler over a KVCacheManager (which owns the block tables:
    only the scheduler allocates, anyone may read them from the manager)."""

    def __init__(
        self, config: SchedulerConfig, kv_cache_manager: KVCacheManager | HybridKVCacheManager
    ) -> None:
        if not isinstance(config, SchedulerConfig):
            raise TypeError(f"config must be a SchedulerConfig, got {type(config).__name__}")
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.block_size: int = kv_cache_manager.block_size
        self.num_blocks: int = kv_cache_manager.num_blocks
        # A request can never hold more tokens' KV than the whole pool: past that it is
        # capped like at max_model_len (and a prompt past it is ignored). With a sliding
        # window the manager gives back what the window left behind, so a request holds a
        # window's worth however long it is: steps are capped instead (`max_num_tokens`),
        # except that a prompt scheduled whole must still fit the pool at once.
        self._windowed: bool = kv_cache_manager.sliding_window is not None
        usable_tokens = kv_cache_manager.num_usable_blocks * self.block_size
        self.pool_capacity_tokens = (
            config.max_model_len
            if self._windowed and config.enable_chunked_prefill
            else usable_tokens
        )
        # One table per KV cache group (a model mixing full and windowed layers): steps
        # are capped like under a window, and a request holds what the manager says.
        self._hybrid = (
            kv_cache_manager if isinstance(kv_cache_manager, HybridKVCacheManager) else None
        )
        if self._hybrid is not None:
            self._windowed = True
            cap = self._hybrid.request_capacity_tokens(config.enable_chunked_prefill)
            self.pool_capacity_tokens = config.max_model_len if cap is None else cap
        self._use_prefix_cache: bool = kv_cache_manager.enable_caching

        self.requests: dict[str, Request] = {}
        self.waiting = make_waiting_queue(config.policy)
        # Admission order; under FCFS the last one is also the newest.
        self.running: list[Request] = []

        self._finished_req_ids: list[str] = []
        self._pending_updates: list[RequestUpdate] = []
        # Preempted between steps (undo_step, preempt_all_running): told to the runner by
        # the next schedule(), like preemptions made inside it.
        self._preempted_between: list[str] = []
        # Running requests whose table lost its tail to rejected drafts (`trim`), with the
        # length it kept: told to the runner when they are next scheduled.
        self._trimmed: dict[str, int] = {}
        # While restricted (`restrict_to`), only `_allowed` ids are scheduled; every other
        # live request waits aside in `_held`, in queue order.
        self._allowed: frozenset[str] | None = None
        self._held: list[Request] = []
        self._next_seq = 0

        self.num_preemptions = 0
        self.num_finished = 0
        self.num_ignored = 0

    # ------------------------------------------------------------------ requests in / out

    def add_request(self, request: Request) -> None:
        """Queue a request; one that can never run is finished as ignored right away and
        reported by the next update_from_output (and in the next finished_req_ids).

        A queued request gets the manager's block hasher and the hashes of its prompt's
        full blocks, so its tokens and their hashes grow together from here on.
        """
        if not isinstance(request, Request):
            raise TypeError(f"expected a Request, got {type(request).__name__}")
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in the scheduler")
        if (
            request.status != _WAITING
            or request.num_output_tokens
            or request.num_computed_tokens
            or request.block_hashes
        ):
            raise ValueError(
                f"request {rid!r} must be new (status WAITING, no output, nothing computed "
                "or hashed)"
            )
        request._seq = self._next_seq
        self._next_seq += 1

        reason = self._never_fits(request)
        if reason is not None:
            request.status = RequestStatus.FINISHED_IGNORED
            request.stop_reason = reason
            self.num_ignored += 1
            self.num_finished += 1
            self._finished_req_ids.append(rid)
            self._pending_updates.append(RequestUpdate(rid, [], True, "ignored", reason))
            return
        hasher = self.kv_cache_manager.block_hasher
        request.block_hasher = hasher
        if hasher is not None:
            request.block_hashes.extend(hasher(request))
        self.requests[rid] = request
        if self._allowed is not None and rid not in self._allowed:
            self._held.append(request)
        else:
            self.waiting.add(request)

    def _never_fits(self, request: Request) -> str | None:
        n = request.num_prompt_tokens
        if n > self.config.max_model_len:
            return f"prompt of {n} tokens is longer than max_model_len={self.config.max_model_len}"
        if n > self.pool_capacity_tokens:
            return (
                f"prompt of {n} tokens needs more KV blocks than the whole pool "
                f"({self.kv_cache_manager.num_usable_blocks} blocks of {self.block_size} tokens)"
            )
        return None

    def abort_requests(self, request_ids: str | Iterable[str]) -> None:
        """Abort now; unknown or already finished ids are ignored (aborts race with stops)."""
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    abort_request = abort_requests

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """End requests for a reason found outside the scheduler (a stop string, an abort).

        Their blocks are freed now and their ids go into the next finished_req_ids; no
        RequestUpdate is produced since the caller already knows.
        """
        if not RequestStatus.is_finished(status):
            raise ValueError(f"finish_requests needs a finished status, got {status!r}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        finished: set[str] = set()
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status == _RUNNING:
                finished.add(rid)
            elif self._held and req in self._held:
                self._held.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, status)
        if finished:
            self.running = [r for r in self.running if r.request_id not in finished]

    def _finish(self, req: Request, status: RequestStatus) -> None:
        """Terminal bookkeeping; the caller removes the request from the running list."""
        rid = req.request_id
        if req.status == _RUNNING:
            self.kv_cache_manager.free(rid)
            self._trimmed.pop(rid, None)
        req.status = status
        del self.requests[rid]
        self._finished_req_ids.append(rid)
        self.num_finished += 1

    # ------------------------------------------------------------------ the step

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        kv = self.kv_cache_manager
        budget = cfg.max_num_batched_tokens
        threshold = cfg.long_prefill_token_threshold
        max_model_len = cfg.max_model_len
        running = self.running
        bs = self.block_size
        windowed = self._windowed
        scheduled: dict[str, tuple[Request, ScheduledRequest]] = {}
        preempted_ids: list[str] = []

        # 1) Running requests: decodes and unfinished prompt chunks.
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            start = req.num_computed_tokens
            num_tokens = req.num_tokens
            spec = req.spec_token_ids
            n = num_tokens + len(spec) - start
            if threshold and n > threshold:
                n = threshold
            if n > budget:
                n = budget
            if start + n > max_model_len:
                n = max_model_len - start
            if windowed:
                n = min(n, kv.max_num_tokens(start) - start)
            if n <= 0:
                i += 1
                continue
            rid = req.request_id
            end = start + n
            new_ids: _NewIds | None
            if start // bs == end // bs and start < kv.num_request_blocks(rid) * bs:
                # Fast path (most decodes): the step neither needs a new block nor completes
                # one, so allocate_slots would change nothing (no growth, nothing to cache).
                new_ids = ([], None)
            else:
                new_ids = None
            while new_ids is None:
                new_ids = self._allocate(req, n)
                if new_ids is not None:
                    break
                victim_idx = self._pick_victim()
                victim = running[victim_idx]
                served = scheduled.pop(victim.request_id, None)
                if served is not None:  # already served this step (priority policy): refund
                    budget += served[1].num_tokens
                self._preempt(victim_idx)
                preempted_ids.append(victim.request_id)
                if victim_idx < i:
                    i -= 1
                if victim is req:
                    break
            if new_ids is None:  # `req` itself was preempted; running[i] is the next one
                continue
            token_ids = req.all_token_ids[start:end]
            drafts: list[int] | tuple[()] = ()
            if end > num_tokens:  # the drafts the caps left room for, verified this step
                drafts = spec[: end - num_tokens]
                token_ids += drafts
                req.spec_token_ids = []
            scheduled[rid] = (
                req,
                ScheduledRequest(
                    rid,
                    token_ids,
                    start,
                    n,
                    new_ids[0],
                    end >= num_tokens,
                    False,
                    req,
                    new_ids[1],
                    drafts,
                    self._trimmed.pop(rid, None) if self._trimmed else None,
                ),
            )
            budget -= n
            i += 1

        # 2) Admit waiting requests, unless the pool just ran dry (they would only thrash).
        if not preempted_ids:
            waiting = self.waiting
            chunked = cfg.enable_chunked_prefill
            use_cache = self._use_prefix_cache
            max_loras = cfg.max_loras
            loras = {r.lora_int_id for r in running if r.lora_int_id} if max_loras else set()
            while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
                req = waiting.peek()
                lora = req.lora_int_id
                if lora and max_loras and lora not in loras:
                    if len(loras) >= max_loras:
                        break  # every adapter slot is taken: wait, in order, for one to free
                    loras.add(lora)
                hit_blocks: list[KVCacheBlock] | KVCacheBlocks
                if use_cache and not req.skip_reading_prefix_cache:
                    hit_blocks, num_hit = kv.get_computed_blocks(req)
                else:
                    hit_blocks, num_hit = [], 0
                num_tokens = req.num_tokens
                n = num_tokens - num_hit
                if chunked:
                    if threshold and n > threshold:
                        n = threshold
                    if n > budget:
                        n = budget
                    if windowed:
                        n = min(n, kv.max_num_tokens(num_hit) - num_hit)
                elif n > budget:
                    break  # the whole prompt must go in one step; keep policy order
                table_ids = self._allocate(req, n, num_hit, hit_blocks)
                if table_ids is None:
                    break  # head-of-line: admitting a later request would jump the order
                waiting.pop()
                rid = req.request_id
                if req.status == _WAITING:  # first admission (not a return from preemption)
                    req.num_cached_tokens = num_hit
                    req.first_scheduled_time = time.monotonic()
                req.status = _RUNNING
                req.num_computed_tokens = num_hit
                running.append(req)
                scheduled[rid] = (
                    req,
                    ScheduledRequest(
                        rid,
                        req.all_token_ids[num_hit : num_hit + n],
                        num_hit,
                        n,
                        table_ids[0],
                        num_hit + n == num_tokens,
                        True,
                        req,
                        table_ids[1],
                    ),
                )
                budget -= n

        # 3) Optimistic progress: the runner computes exactly what it was given.
        total = 0
        batch: list[ScheduledRequest] = []
        for req, sched in scheduled.values():
            req.num_computed_tokens += sched.num_tokens
            total += sched.num_tokens
            batch.append(sched)

        finished_ids = self._finished_req_ids
        self._finished_req_ids = []
        if self._preempted_between:
            preempted_ids = self._preempted_between + preempted_ids
            self._preempted_between = []
        return SchedulerOutput(batch, total, preempted_ids, finished_ids)

    def _allocate(
        self,
        req: Request,
        n: int,
        num_hit: int = 0,
        hit_blocks: list[KVCacheBlock] | KVCacheBlocks | None = None,
    ) -> _NewIds | None:
        """`allocate_slots` for either manager: the ids the step adds to the table (the
        hits first), None when the pool cannot take it (nothing changed)."""
        hybrid = self._hybrid
        if hybrid is None:
            assert not isinstance(hit_blocks, KVCacheBlocks)
            assert not isinstance(self.kv_cache_manager, HybridKVCacheManager)
            got = self.kv_cache_manager.allocate_slots(req, n, num_hit, hit_blocks)
            if got is None:
                return None
            ids = [b.block_id for b in hit_blocks] if hit_blocks else []
            ids += [b.block_id for b in got]
            return ids, None
        assert not isinstance(hit_blocks, list)
        blocks = hybrid.allocate_slots(req, n, num_hit, hit_blocks)
        if blocks is None:
            return None
        groups = blocks.get_block_ids()
        if hit_blocks is not None and hit_blocks.num_blocks:
            groups = tuple(h + g for h, g in zip(hit_blocks.get_block_ids(), groups))
        return groups[0], groups

    def _pick_victim(self) -> int:
        """Index in `running` of the request to preempt: lowest priority, then newest."""
        running = self.running
        if self.config.policy == "fcfs":
            # The newest arrival, which is usually the last admitted, but not after a
            # restricted or undone step let a later arrival in first.
            return max(range(len(running)), key=lambda j: running[j]._seq)
        best = 0
        best_key = priority_key(running[0])
        for j in range(1, len(running)):
            key = priority_key(running[j])
            if key > best_key:
                best, best_key = j, key
        return best

    def _preempt(self, idx: int) -> None:
        """Recompute preemption: drop the KV, keep every token, requeue at the head."""
        req = self.running.pop(idx)
        self.kv_cache_manager.free(req.request_id)
        self._trimmed.pop(req.request_id, None)  # re-admission sends the whole table
        req.status = _PREEMPTED
        req.spec_token_ids = []
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        # While restricted, every running request is an allowed one (see restrict_to).
        self.waiting.add_front(req)

    # ------------------------------------------------------------------ failed steps

    def undo_step(self, output: SchedulerOutput) -> None:
        """Forget a step the runner did not compute (its forward or sampling raised).

        Every running request is preempted (recompute keeps every token, so nothing is
        lost but time) and the blocks this step was to fill leave the prefix index, so no
        request can hit KV that was never written. The runner hears of the preemptions
        in the next SchedulerOutput. Do not call update_from_output for an undone step.
        """
        bs = self.block_size
        kv = self.kv_cache_manager
        for sched in output.scheduled:
            if sched.request.status == _RUNNING:
                kv.forget_blocks_from(sched.request_id, sched.start_pos // bs)
        self.preempt_all_running()

    def preempt_all_running(self) -> None:
        """Preempt every running request (newest first, so the queue keeps their order)."""
        while self.running:
            rid = self.running[-1].request_id
            self._preempt(len(self.running) - 1)
            self._preempted_between.append(rid)

    def restrict_to(self, request_ids: Iterable[str] | None) -> None:
        """Schedule only these requests until called with None (e.g. to isolate a fault).

        Running requests outside the set must have been preempted first
        (`preempt_all_running`, or ValueError). Waiting ones outside it, and requests added
        meanwhile, wait aside (they still count as waiting in `get_stats`, and can be
        aborted). Every change re-queues the waiting requests in arrival order (FCFS) or
        priority order, so a lifted restriction leaves the queue as if it never happened.
        Ids that are not (or no longer) in the scheduler are allowed and ignored.
        """
        allowed = None if request_ids is None else frozenset(request_ids)
        if allowed is not None and any(r.request_id not in allowed for r in self.running):
            raise ValueError("restrict_to: preempt the running requests outside the set first")
        queued = sorted([*self.waiting, *self._held], key=lambda r: r._seq)
        self._allowed = allowed
        self.waiting = make_waiting_queue(self.config.policy)
        self._held = []
        for req in queued:
            if allowed is None or req.request_id in allowed:
                self.waiting.add(req)
            else:
                self._held.append(req)

    @property
    def restricted_to(self) -> frozenset[str] | None:
        """The ids `restrict_to` limits scheduling to; None when unrestricted."""
        return self._allowed

    # ------------------------------------------------------------------ after the forward

    def update_from_output(
        self, output: SchedulerOutput, sampled: Mapping[str, int | Sequence[int]]
    ) -> list[RequestUpdate]:
        """Append each sampled token (hashing any block it fills), apply the stop rules
        (`check_stop`), free finished requests now.

        `sampled` maps request id -> token id for every scheduled request with sample=True
        (extra entries are ignored). Requests aborted since schedule() are skipped. The
        result also carries the requests ignored at add_request since the previous call.

        A request that verified drafts this step (`ScheduledRequest.spec_token_ids`) maps
        to its accepted drafts plus one token (1 to k + 1 ids): its computed count drops by
        the rejected drafts, whose KV slots the next step overwrites; blocks that held only
        rejected drafts go back to the pool at once (`ScheduledRequest.num_kept_blocks`
        tells the runner next time). The stop rules run after each token; tokens
        after the one that stops the request are dropped.
        """
        updates = self._pending_updates
        self._pending_updates = []
        max_model_len = self.config.max_model_len
        pool_cap = self.pool_capacity_tokens
        stop = check_stop  # a local: this loop runs once per sampled token
        any_finished = False
        for sched in output.scheduled:
            if not sched.sample:
                continue
            req = sched.request
            # An abort since schedule() left the record in a terminal status (a request
            # re-added under the same id is a different record, so it is not touched).
            if req.status is not _RUNNING:
                continue
            rid = sched.request_id
            try:
                token = sampled[rid]
            except KeyError:
                raise KeyError(
                    f"no sampled token for request {rid!r}, which was scheduled with sample=True"
                ) from None
            if isinstance(token, int):
                req.append_output_token(token)
                status = stop(req, max_model_len, pool_cap)
                new_tokens = [token]
            else:
                status, new_tokens = self._append_verified(req, sched, token)
            if status is None:
                updates.append(RequestUpdate(rid, new_tokens, False, None, None))
            else:
                self._finish(req, status)
                any_finished = True
                updates.append(
                    RequestUpdate(
                        rid, new_tokens, True, RequestStatus.finish_reason(status), req.stop_reason
                    )
                )
        if any_finished:
            self.running = [r for r in self.running if r.status == _RUNNING]
        return updates

    def _append_verified(
        self, req: Request, sched: ScheduledRequest, tokens: Sequence[int]
    ) -> tuple[RequestStatus | None, list[int]]:
        """Append a speculative step's tokens (accepted drafts, then one more) up to the
        first that stops the request; roll the computed count back past the rejected drafts."""
        num_drafts = len(sched.spec_token_ids)
        if not 1 <= len(tokens) <= num_drafts + 1:
            raise ValueError(
                f"request {req.request_id!r} verified {num_drafts} drafts but got "
                f"{len(tokens)} tokens (1 to {num_drafts + 1} expected)"
            )
        rejected = num_drafts + 1 - len(tokens)
        req.num_computed_tokens -= rejected
        if rejected:
            # The blocks that held only rejected drafts go back to the pool now.
            kept = self.kv_cache_manager.trim(req.request_id, req.num_computed_tokens)
            if kept is not None:
                rid = req.request_id
                self._trimmed[rid] = min(kept, self._trimmed.get(rid, kept))
        status = None
        new_tokens: list[int] = []
        for token in tokens:
            req.append_output_token(token)
            new_tokens.append(token)
            status = check_stop(req, self.config.max_model_len, self.pool_capacity_tokens)
            if status is not None:
                break
        return status, new_tokens

    def update_draft_token_ids(self, draft_token_ids: Mapping[str, Sequence[int]]) -> None:
        """Give running requests their drafts for the next step (vLLM's name); ids no
        longer running are ignored (they finished or were preempted meanwhile)."""
        for rid, drafts in draft_token_ids.items():
            req = self.requests.get(rid)
            if req is not None and req.status == _RUNNING:
                req.spec_token_ids = list(drafts)

    # ------------------------------------------------------------------ queries

    def has_unfinished_requests(self) -> bool:
        """True while anything is queued, running, or an ignored request is still to be
        reported (so a `while has_unfinished_requests(): step()` loop delivers it)."""
        return bool(self.requests) or bool(self._pending_updates)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def iter_waiting(self) -> Iterator[Request]:
        """Waiting requests in the order they will be admitted (O(n log n) for priority)."""
        return iter(self.waiting)

    def get_stats(self) -> SchedulerStats:
        prefix = self.kv_cache_manager.prefix_cache_stats
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self._held),
            num_preemptions=self.num_preemptions,
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_finished=self.num_finished,
            num_ignored=self.num_ignored,
        )

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()
