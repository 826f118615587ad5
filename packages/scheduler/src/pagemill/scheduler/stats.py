"""A snapshot of the scheduler for metrics and logs (Prometheus gauges, `/metrics`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Counts now, plus totals since the scheduler started.

    Prefix-cache figures are the KV cache manager's totals (it is their one owner), in
    tokens, counted once per successful admission (a head of the queue that is retried while
    blocked is not counted again), so the hit rate is the share of admitted tokens the cache
    saved from recomputation.
    """

    num_running: int
    num_waiting: int
    num_preemptions: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_finished: int = 0
    num_ignored: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries
