"""Replicas in the replay page (`pagemill simulate --replicas N --html OUT`).

A live `-dp N` server's dashboard draws one pool per engine core from a merged picture
(`dashboard.cores.merge_core_snapshots`); a simulated router's run is recorded the same way,
so the page shows its replicas' pools side by side, each request tagged with its replica.
Only imported with `--html` (it loads the dashboard's picture code).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from pagemill.scheduler import RequestUpdate, Scheduler
from pagemill.server.dashboard.cores import merge_core_snapshots
from pagemill.server.dashboard.replay import ReplayRecorder
from pagemill.server.dashboard.snapshot import snapshot_scheduler


class _Replicas:
    """The replicas as the one scheduler `ReplayRecorder` reads: summed counts, the mean KV
    use, a request found on whichever replica holds it."""

    def __init__(self, schedulers: list[Scheduler]) -> None:
        self.schedulers = schedulers

    def get_stats(self) -> SimpleNamespace:
        stats = [s.get_stats() for s in self.schedulers]
        return SimpleNamespace(
            num_running=sum(s.num_running for s in stats),
            num_waiting=sum(s.num_waiting for s in stats),
            kv_cache_usage=sum(s.kv_cache_usage for s in stats) / len(stats),
        )

    def has_unfinished_requests(self) -> bool:
        return any(s.has_unfinished_requests() for s in self.schedulers)

    def get_request(self, request_id: str) -> Any:
        for s in self.schedulers:
            req = s.get_request(request_id)
            if req is not None:
                return req
        return None


class ReplicaReplayRecorder(ReplayRecorder):
    """A `ReplicaSimulator` observer: records one router's run, every replica's pool in each
    picture."""

    def on_step(
        self,
        clock: float,
        schedulers: list[Scheduler],
        replica: int,
        updates: list[RequestUpdate],
        dt: float,
    ) -> None:
        self(clock, _Replicas(schedulers), updates, dt)

    def _take(self, clock: float, scheduler: Any) -> None:
        if not isinstance(scheduler, _Replicas):
            super()._take(clock, scheduler)
            return
        t = round(clock, 6)
        per_core = {
            k: snapshot_scheduler(s, now=t, max_grid_blocks=self.max_grid_blocks)
            for k, s in enumerate(scheduler.schedulers)
        }
        self.frames.append(merge_core_snapshots(per_core))
        if len(self.frames) > self.max_frames:
            last = self.frames[-1]
            self.frames = [*self.frames[:-1:2], last]
            self.frame_dt *= 2
        self._next_frame = clock + self.frame_dt
