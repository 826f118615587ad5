"""N engine replicas behind the real router: `pagemill simulate --replicas N --router ...`.

Each replica is what `PagedSimulator` models, a real `Scheduler` on its own real
`KVCacheManager`; in front of them sits the real `DPRouter`, the very policy object that
routes `pagemill serve -dp N` and the Ray Serve replicas. It is told what it is told there:
a request is `route`d when it arrives, `finish`ed when its replica finishes it, and after
every step of a replica that replica's KV events (the pool's own, in their wire classes)
and KV usage, as a core's outputs carry them to `DPClient`.

The replicas run side by side on one virtual clock: each takes its own steps, a step lasting
what the cost model charges for what it scheduled, so a busy replica falls behind while an
idle one waits for work. At equal times a step's end is handled before an arrival (the
router sees the freshest events), and an arrival before a replica starts its next step.

`benchmarks/dp_prefix_routing.py --simulate` runs the same loop with every step costing one
tick, which makes the replicas advance in lockstep.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagemill.blockpool import KVCacheManager
from pagemill.runtime.config import DP_ROUTING_POLICIES
from pagemill.scheduler import (
    Request,
    RequestStatus,
    RequestUpdate,
    Scheduler,
    SchedulerOutput,
)
from pagemill.scheduler.config import SchedulerConfig
from pagemill.server.sim.hardware import Deployment
from pagemill.server.sim.metrics import RunRecorder, RunResult
from pagemill.server.sim.paged_sim import fake_token, step_figures
from pagemill.server.sim.workload import SimRequest

# The routers `--router` accepts: `-dp`'s routing policies (`--data-parallel-routing`).
ROUTERS = DP_ROUTING_POLICIES

# Told after every step of a replica: (clock, every replica's scheduler, the replica that
# stepped, its updates, the step's duration).
ReplicaObserver = Callable[[float, list[Scheduler], int, list[RequestUpdate], float], None]


@dataclass
class ReplicaRun:
    """One router's run: the totals over all replicas, each replica's own figures (its
    `num_finished` is the requests it served), and how many requests the router sent where."""

    router: str
    total: RunResult
    replicas: list[RunResult]
    routed: list[int]
    prefix_queries: list[int] = field(default_factory=list)
    prefix_hits: list[int] = field(default_factory=list)

    @property
    def prefill_tokens_computed(self) -> int:
        """Prompt tokens the prefix caches did not cover (what prefill had to compute, before
        any recomputation after preemption)."""
        return sum(self.prefix_queries) - sum(self.prefix_hits)

    def summary(self) -> dict[str, Any]:
        return {
            "router": self.router,
            "routed": list(self.routed),
            "prefix_queries": list(self.prefix_queries),
            "prefix_hits": list(self.prefix_hits),
            "total": self.total.summary(),
            "replicas": [r.summary() for r in self.replicas],
        }


class ReplicaSimulator:
    """One run of N replicas behind one router (see the module docstring).

    ``step_time`` is the cost model: the duration of a step given each scheduled request's
    (tokens, context end). After `run`, ``schedulers`` and ``router`` are left for
    inspection (a finished run leaves every block of every pool free).
    """

    def __init__(
        self,
        num_replicas: int,
        router: str,
        *,
        num_blocks: int,
        block_size: int,
        scheduler_config: SchedulerConfig,
        step_time: Callable[[list[tuple[int, int]]], float],
        hash_algo: str = "sha256",
        observer: ReplicaObserver | None = None,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"need at least one replica, got {num_replicas}")
        if router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {router!r}")
        # The engine's router, imported here so that `pagemill plan` and the one-engine
        # studies never load the engine package (it is torch-free, but not small).
        from pagemill.runtime.engine.dp_router import DPRouter

        self.router_name = router
        self.router = DPRouter(router, num_replicas, block_size, hash_algo)
        self.step_time = step_time
        self.observer = observer
        self.schedulers: list[Scheduler] = []
        for _ in range(num_replicas):
            kv = KVCacheManager(
                num_blocks, block_size=block_size, enable_caching=True, hash_algo=hash_algo
            )
            kv.block_pool.enable_kv_cache_events(block_size)
            self.schedulers.append(Scheduler(scheduler_config, kv))

    @classmethod
    def for_deployment(
        cls,
        deployment: Deployment,
        num_replicas: int,
        router: str,
        observer: ReplicaObserver | None = None,
    ) -> ReplicaSimulator:
        """N copies of one simulated deployment (its pool, scheduler limits and step cost)."""
        return cls(
            num_replicas,
            router,
            num_blocks=deployment.pool_blocks,
            block_size=deployment.block_size,
            scheduler_config=deployment.scheduler_config,
            step_time=deployment.cost_model.step_time,
            hash_algo=deployment.cache_config.prefix_caching_hash_algo,
            observer=observer,
        )

    def run(self, requests: Sequence[SimRequest]) -> ReplicaRun:
        from pagemill.runtime.engine.kv_events import to_wire

        router, scheds = self.router, self.schedulers
        n = len(scheds)
        by_id = {r.request_id: r for r in requests}
        if len(by_id) != len(requests):
            raise ValueError("request ids must be unique")
        total = RunRecorder(self.router_name)
        recs = [RunRecorder(f"{self.router_name} · replica {k}") for k in range(n)]
        # Requests that may be sent: (time they are sent, index, request). A chat's later
        # turn joins when the turn before it finishes.
        ready: list[tuple[float, int, SimRequest]] = []
        blocked: dict[str, list[SimRequest]] = {}
        for r in requests:
            if r.after is None:
                ready.append((r.arrival_time, r.index, r))
            elif r.after not in by_id:
                raise ValueError(f"{r.request_id} follows {r.after}, which is not in the workload")
            else:
                blocked.setdefault(r.after, []).append(r)
        heapq.heapify(ready)
        live: dict[str, Request] = {}
        holding: list[dict[str, Request]] = [{} for _ in range(n)]
        # The step each replica is running: (end time, its output, its duration).
        running: list[tuple[float, SchedulerOutput, float] | None] = [None] * n
        finished = 0
        clock = 0.0

        def complete(k: int, out: SchedulerOutput, dt: float) -> None:
            nonlocal finished
            sched = scheds[k]
            sampled = {
                s.request_id: fake_token(by_id[s.request_id].index, s.start_pos + s.num_tokens)
                for s in out.scheduled
                if s.sample
            }
            updates = sched.update_from_output(out, sampled)
            for u in updates:
                if u.new_token_ids:
                    total.token(u.request_id, clock, len(u.new_token_ids))
                    recs[k].token(u.request_id, clock, len(u.new_token_ids))
                if u.finished:
                    finished += 1
                    holding[k].pop(u.request_id, None)
                    live.pop(u.request_id, None)
                    ignored = u.finish_reason == "ignored"
                    total.finish(u.request_id, clock, ignored=ignored)
                    recs[k].finish(u.request_id, clock, ignored=ignored)
                    router.finish(u.request_id)
                    for nxt in blocked.pop(u.request_id, ()):
                        heapq.heappush(ready, (max(nxt.arrival_time, clock), nxt.index, nxt))
            kv = sched.kv_cache_manager
            router.apply_events(k, to_wire(kv.block_pool.take_kv_events()))
            router.kv_usage[k] = kv.usage
            if self.observer is not None:
                self.observer(clock, scheds, k, updates, dt)
            if not out.scheduled and not updates:
                raise RuntimeError(
                    f"replica {k} made no progress with {len(sched.running)} running and "
                    f"{len(sched.waiting)} waiting (pool of {kv.num_blocks} blocks)"
                )

        while True:
            for k in range(n):
                step = running[k]
                if step is not None and step[0] <= clock:
                    running[k] = None
                    complete(k, step[1], step[2])
            while ready and ready[0][0] <= clock:
                _, _, r = heapq.heappop(ready)
                k = router.route(r.request_id, r.prompt_token_ids)
                req = Request(
                    r.request_id,
                    list(r.prompt_token_ids),
                    max_tokens=r.output_len,
                    ignore_eos=True,
                    arrival_time=clock,
                )
                live[r.request_id] = req
                total.arrive(r.request_id, clock, r.prompt_len)
                recs[k].arrive(r.request_id, clock, r.prompt_len)
                scheds[k].add_request(req)
            for k, sched in enumerate(scheds):
                # A step that scheduled nothing but ended requests (refused ones) takes no
                # time: the replica tries again at once (`complete` raises on no progress).
                while running[k] is None and sched.has_unfinished_requests():
                    out = sched.schedule()
                    for rid in out.preempted_req_ids:
                        holding[k].pop(rid, None)
                    if not out.scheduled:
                        complete(k, out, 0.0)
                        continue
                    figures = step_figures(out, live, holding[k], sched.kv_cache_manager)
                    dt = self.step_time(figures.chunks)
                    for rec in (total, recs[k]):
                        rec.step(
                            clock + dt,
                            dt,
                            len(out.scheduled),
                            out.total_num_scheduled_tokens,
                            figures.prompt_tokens,
                            figures.reserved_slots,
                            figures.real_slots,
                        )
                    running[k] = (clock + dt, out, dt)
            ends = [step[0] for step in running if step is not None]
            if ready:
                ends.append(ready[0][0])
            if not ends:
                break
            clock = max(clock, min(ends))
        if blocked or finished != len(requests):
            stuck = [r for r in live.values() if not RequestStatus.is_finished(r.status)]
            raise RuntimeError(
                f"the run ended with {len(requests) - finished} requests unfinished "
                f"({len(stuck)} admitted, {sum(map(len, blocked.values()))} never sent)"
            )
        stats = [s.get_stats() for s in scheds]
        replicas = [
            rec.result(
                num_preemptions=st.num_preemptions, prefix_cache_hit_rate=st.prefix_cache_hit_rate
            )
            for rec, st in zip(recs, stats, strict=True)
        ]
        queries = [st.prefix_cache_queries for st in stats]
        hits = [st.prefix_cache_hits for st in stats]
        return ReplicaRun(
            self.router_name,
            total.result(
                num_preemptions=sum(st.num_preemptions for st in stats),
                prefix_cache_hit_rate=sum(hits) / sum(queries) if sum(queries) else math.nan,
            ),
            replicas,
            list(router.routed),
            queries,
            hits,
        )


def compare_routers(
    deployment: Deployment,
    requests: Sequence[SimRequest],
    num_replicas: int,
    routers: Sequence[str] = ROUTERS,
    observe: Callable[[str], ReplicaObserver | None] | None = None,
) -> list[ReplicaRun]:
    """Each router on the same requests over `num_replicas` copies of `deployment`."""
    return [
        ReplicaSimulator.for_deployment(
            deployment, num_replicas, name, observe(name) if observe is not None else None
        ).run(requests)
        for name in routers
    ]
