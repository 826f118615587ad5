"""Discrete-event simulation of paged continuous batching, on the real scheduler and block pool.

Nothing of the scheduler's logic is re-implemented here: the loop feeds requests to
``pagemill.scheduler.Scheduler`` at their virtual arrival times, asks it for each step, charges
the step the roofline time of exactly what it scheduled, and hands back one fake sampled token
per sampling request. The only clock is the virtual one, so a run is a pure function of its
inputs: the same workload and seed give bit-identical results on any machine.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from pagemill.blockpool import HybridKVCacheManager, KVCacheManager
from pagemill.scheduler import Request, RequestStatus, RequestUpdate, Scheduler, SchedulerOutput
from pagemill.server.sim.hardware import Deployment
from pagemill.server.sim.metrics import RunRecorder, RunResult
from pagemill.server.sim.workload import SimRequest


def fake_token(index: int, position: int) -> int:
    """A deterministic 'sampled' token; requests run with ignore_eos so its value never stops
    one."""
    return 1 + (index * 7919 + position * 104729) % 30011


@dataclass(frozen=True)
class StepFigures:
    """What one scheduled step costs and holds: ``chunks`` (tokens, context end) per request
    for the cost model, the prompt tokens it computes, and the KV slots reserved vs holding
    real tokens once it ran."""

    chunks: list[tuple[int, int]]
    prompt_tokens: int
    reserved_slots: int
    real_slots: int


def step_figures(
    out: SchedulerOutput,
    requests: dict[str, Request],
    holding: dict[str, Request],
    kv: KVCacheManager | HybridKVCacheManager,
) -> StepFigures:
    """The figures of a step just scheduled; adds its requests to ``holding`` (those whose
    block tables count, until they finish or are preempted)."""
    block_size = kv.block_size
    chunks = []
    prompt_tokens = 0
    for s in out.scheduled:
        end = s.start_pos + s.num_tokens
        chunks.append((s.num_tokens, end))
        holding[s.request_id] = requests[s.request_id]
        p = requests[s.request_id].num_prompt_tokens
        if s.start_pos < p:
            prompt_tokens += min(end, p) - s.start_pos
    # Reserved = blocks in use in the real pool (a shared prefix block counts once);
    # real = reserved minus each table's unfilled tail (only full blocks are shared).
    reserved = (kv.num_blocks - kv.get_num_free_blocks()) * block_size
    slack = sum(
        kv.num_request_blocks(rid) * block_size - q.num_computed_tokens
        for rid, q in holding.items()
    )
    return StepFigures(chunks, prompt_tokens, reserved, reserved - slack)


# Told after every simulated step: (virtual clock, scheduler, the step's updates, step time).
StepObserver = Callable[[float, Scheduler, list[RequestUpdate], float], None]


class PagedSimulator:
    """One run; after :meth:`run`, ``kv_cache_manager`` and ``scheduler`` are left for
    inspection (a finished run must leave every block free). ``observer`` watches every
    step (``pagemill simulate --html`` records the run for the dashboard's replay)."""

    def __init__(
        self,
        deployment: Deployment,
        *,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        max_num_batched_tokens: int | None = None,
        long_prefill_token_threshold: int = 0,
        name: str = "paged",
        observer: StepObserver | None = None,
    ) -> None:
        self.deployment = deployment
        self.name = name
        self.observer = observer
        self.config = replace(
            deployment.scheduler_config,
            max_num_batched_tokens=max_num_batched_tokens or deployment.max_num_batched_tokens,
            long_prefill_token_threshold=long_prefill_token_threshold,
            enable_chunked_prefill=enable_chunked_prefill,
        )
        self.cache_config = replace(
            deployment.cache_config, enable_prefix_caching=enable_prefix_caching
        )
        self.kv_cache_manager = KVCacheManager(
            deployment.pool_blocks,
            block_size=self.cache_config.block_size,
            enable_caching=self.cache_config.enable_prefix_caching,
            hash_algo=self.cache_config.prefix_caching_hash_algo,
        )
        self.scheduler = Scheduler(self.config, self.kv_cache_manager)

    def run(self, requests: Sequence[SimRequest]) -> RunResult:
        sched = self.scheduler
        kv = self.kv_cache_manager
        cost = self.deployment.cost_model
        rec = RunRecorder(self.name)
        reqs = sorted(requests, key=lambda r: (r.arrival_time, r.index))
        by_id = {r.request_id: r for r in reqs}
        if len(by_id) != len(reqs):
            raise ValueError("request ids must be unique")
        # Requests holding blocks (their tables are the KV cache manager's).
        holding: dict[str, Request] = {}
        sim_reqs: dict[str, Request] = {}
        clock = 0.0
        nxt = 0
        while True:
            while nxt < len(reqs) and reqs[nxt].arrival_time <= clock:
                r = reqs[nxt]
                req = Request(
                    r.request_id,
                    list(r.prompt_token_ids),
                    max_tokens=r.output_len,
                    ignore_eos=True,
                    arrival_time=r.arrival_time,
                )
                sim_reqs[r.request_id] = req
                rec.arrive(r.request_id, r.arrival_time, r.prompt_len)
                sched.add_request(req)
                nxt += 1
            if not sched.has_unfinished_requests():
                if nxt >= len(reqs):
                    break
                clock = max(clock, reqs[nxt].arrival_time)
                continue

            out = sched.schedule()
            for rid in out.preempted_req_ids:
                holding.pop(rid, None)
            dt = 0.0
            if out.scheduled:
                figures = step_figures(out, sim_reqs, holding, kv)
                dt = cost.step_time(figures.chunks)
                clock += dt
                rec.step(
                    clock,
                    dt,
                    len(out.scheduled),
                    out.total_num_scheduled_tokens,
                    figures.prompt_tokens,
                    figures.reserved_slots,
                    figures.real_slots,
                )
            sampled = {
                s.request_id: fake_token(by_id[s.request_id].index, s.start_pos + s.num_tokens)
                for s in out.scheduled
                if s.sample
            }
            updates = sched.update_from_output(out, sampled)
            if self.observer is not None:
                self.observer(clock, sched, updates, dt)
            for u in updates:
                if u.new_token_ids:
                    rec.token(u.request_id, clock, len(u.new_token_ids))
                if u.finished:
                    holding.pop(u.request_id, None)
                    rec.finish(u.request_id, clock, ignored=u.finish_reason == "ignored")
            if not out.scheduled and not updates:
                if nxt < len(reqs):
                    clock = max(clock, reqs[nxt].arrival_time)
                    continue
                stuck = [r for r in sim_reqs.values() if not RequestStatus.is_finished(r.status)]
                raise RuntimeError(
                    f"scheduler made no progress with {len(stuck)} requests unfinished "
                    f"(pool of {kv.num_blocks} blocks)"
                )
        stats = sched.get_stats()
        hit_rate = stats.prefix_cache_hit_rate if kv.enable_caching else math.nan
        return rec.result(num_preemptions=stats.num_preemptions, prefix_cache_hit_rate=hit_rate)
