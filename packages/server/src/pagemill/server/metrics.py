"""Prometheus metrics: vLLM's metric set, under the `pagemill:` prefix.

Dashboards built for vLLM read the same names with the prefix swapped. Each server gets
its own `CollectorRegistry` (several apps in one process, as in tests, must not collide).
Everything here is updated from the engine thread (prometheus-client is thread-safe), so
latencies are measured where tokens appear, not where the HTTP layer happens to notice.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "EngineMetrics", "read_engine_stats"]

# Buckets follow vLLM's so the same Grafana panels work.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)

_STAT_NAMES = ("num_running", "num_waiting", "kv_cache_usage", "num_preemptions",
               "prefix_cache_queries", "prefix_cache_hits")


def read_engine_stats(engine: Any) -> dict[str, float]:
    """The scheduler's counters, wherever the engine keeps them (EngineStats or SchedulerStats).

    Call on the engine thread. Missing figures are left out rather than guessed.
    """
    sources: list[Any] = []
    get_stats = getattr(engine, "get_stats", None)
    if callable(get_stats):
        stats = get_stats()
        sources += [stats, getattr(stats, "scheduler_stats", None), getattr(stats, "scheduler", None)]
    scheduler = getattr(engine, "scheduler", None)
    if scheduler is not None and callable(getattr(scheduler, "get_stats", None)):
        sources.append(scheduler.get_stats())
    found: dict[str, float] = {}
    for name in _STAT_NAMES:
        for src in sources:
            value = getattr(src, name, None) if src is not None else None
            if value is None and isinstance(src, dict):
                value = src.get(name)
            if isinstance(value, (int, float)):
                found[name] = float(value)
                break
    return found


class EngineMetrics:
    """The metric objects plus the engine-thread hooks that feed them (see async_engine)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"pagemill:{name}", doc, labels, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"pagemill:{name}", doc, [*labels, *extra], registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"pagemill:{name}", doc, labels, buckets=buckets, registry=r)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc",
                                    "Fraction of KV cache blocks in use (1 = full).")
        self.prefix_cache_queries = counter("prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens accepted.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter("request_success", "Requests that finished, by reason.",
                                       ("finished_reason",))
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two output tokens.",
                             _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.",
                             _LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Arrival to first scheduling.", _LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens",
                                               "Prompt length per request.", _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Generated tokens per request.", _TOKEN_BUCKETS)
        self._last_totals: dict[str, float] = {}
        # Touch every labelled child so each series is exported (at 0) from the first scrape.
        for metric in (self.num_requests_running, self.num_requests_waiting, self.kv_cache_usage,
                       self.prefix_cache_queries, self.prefix_cache_hits, self.num_preemptions,
                       self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e,
                       self.queue_time, self.request_prompt_tokens, self.request_generation_tokens):
            metric.labels(model_name)

    # -------------------------------------------------- hooks (engine thread)

    def on_added(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)

    def on_new_tokens(self, num_tokens: int, ttft: float | None, itls: list[float]) -> None:
        self.generation_tokens.labels(self.model_name).inc(num_tokens)
        if ttft is not None:
            self.ttft.labels(self.model_name).observe(ttft)
        itl = self.itl.labels(self.model_name)
        for value in itls:
            itl.observe(value)

    def on_finished(self, finish_reason: str | None, e2e: float, queue_time: float | None,
                    num_prompt_tokens: int, num_generation_tokens: int) -> None:
        self.request_success.labels(self.model_name, finish_reason or "unknown").inc()
        self.e2e.labels(self.model_name).observe(e2e)
        if queue_time is not None:
            self.queue_time.labels(self.model_name).observe(queue_time)
        self.request_prompt_tokens.labels(self.model_name).observe(num_prompt_tokens)
        self.request_generation_tokens.labels(self.model_name).observe(num_generation_tokens)

    def on_step(self, engine: Any) -> None:
        stats = read_engine_stats(engine)
        m = self.model_name
        if "num_running" in stats:
            self.num_requests_running.labels(m).set(stats["num_running"])
        if "num_waiting" in stats:
            self.num_requests_waiting.labels(m).set(stats["num_waiting"])
        if "kv_cache_usage" in stats:
            self.kv_cache_usage.labels(m).set(stats["kv_cache_usage"])
        # The engine reports running totals; Prometheus counters take increments.
        for key, metric in (("num_preemptions", self.num_preemptions),
                            ("prefix_cache_queries", self.prefix_cache_queries),
                            ("prefix_cache_hits", self.prefix_cache_hits)):
            if key in stats:
                delta = stats[key] - self._last_totals.get(key, 0.0)
                if delta > 0:
                    metric.labels(m).inc(delta)
                self._last_totals[key] = stats[key]

    def render(self) -> bytes:
        return generate_latest(self.registry)
