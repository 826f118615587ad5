"""Prometheus metrics: vLLM's metric set, under the `pagemill:` prefix and under vLLM's own
`vllm:` names (always both: dashboards and gateways built for vLLM work unchanged). Each
server gets its own `CollectorRegistry` (several apps in one process, as in tests, must not
collide).
Everything here is updated from the engine's figures after every step (prometheus-client is
thread-safe): on the engine thread in-process, or on the client's reader thread from what
the engine process sent. Latencies are measured where tokens appear, not where the HTTP
layer happens to notice.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "EngineMetrics"]

# Buckets are vLLM's (vllm/v1/metrics/loggers.py) so the same Grafana panels work.
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
_STEP_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class _Twin:
    """One figure exported under two names: `pagemill:<name>{model_name}` and vLLM's
    `vllm:<name>{model_name, engine}` (engine "0": pagemill runs one engine core), plus
    any of vLLM's older names for the same figure."""

    def __init__(self, *metrics: Any) -> None:
        self.metrics = metrics

    def labels(self, model_name: str, *extra: str) -> _TwinChild:
        first, *rest = self.metrics
        return _TwinChild(
            first.labels(model_name, *extra), *(m.labels(model_name, "0", *extra) for m in rest)
        )


class _TwinChild:
    def __init__(self, *children: Any) -> None:
        self.children = children

    def set(self, value: float) -> None:
        for c in self.children:
            c.set(value)

    def inc(self, amount: float = 1) -> None:
        for c in self.children:
            c.inc(amount)

    def observe(self, value: float) -> None:
        for c in self.children:
            c.observe(value)


class EngineMetrics:
    """The metric objects plus the engine-thread hooks that feed them (see async_engine).

    Every figure of vLLM's set is exported twice, always: as `pagemill:<name>` and as
    vLLM's own `vllm:<name>` with vLLM's labels (model_name, engine), so vLLM's Grafana
    dashboard and the inference gateway's endpoint picker (which reads
    vllm:num_requests_waiting and vllm:kv_cache_usage_perc / vllm:gpu_cache_usage_perc)
    work against pagemill with no flag.
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        vllm_labels = ["model_name", "engine"]
        r = self.registry

        def gauge(name: str, doc: str, *old: str) -> _Twin:
            return _Twin(
                Gauge(f"pagemill:{name}", doc, labels, registry=r),
                *(Gauge(f"vllm:{n}", doc, vllm_labels, registry=r) for n in (name, *old)),
            )

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> _Twin:
            return _Twin(
                Counter(f"pagemill:{name}", doc, [*labels, *extra], registry=r),
                Counter(f"vllm:{name}", doc, [*vllm_labels, *extra], registry=r),
            )

        def histogram(name: str, doc: str, buckets: tuple[float, ...], *old: str) -> _Twin:
            return _Twin(
                Histogram(f"pagemill:{name}", doc, labels, buckets=buckets, registry=r),
                *(
                    Histogram(f"vllm:{n}", doc, vllm_labels, buckets=buckets, registry=r)
                    for n in (name, *old)
                ),
            )

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge(
            "num_requests_waiting", "Requests waiting to be scheduled."
        )
        # vllm:gpu_cache_usage_perc is vLLM's name before 0.9, still read by gateways.
        self.kv_cache_usage = gauge(
            "kv_cache_usage_perc",
            "Fraction of KV cache blocks in use (1 = full).",
            "gpu_cache_usage_perc",
        )
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.grammar_cache_bytes = Gauge(
            "pagemill:grammar_cache_bytes",
            "Bytes held by compiled grammars (structured output), "
            "bounded by --structured-outputs-cache-bytes.",
            labels,
            registry=r,
        )
        self.num_preemptions = counter("num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens accepted.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter(
            "request_success", "Requests that finished, by reason.", ("finished_reason",)
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        # vLLM exports the same per-token gaps under its older name too.
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Time between two output tokens.",
            _ITL_BUCKETS,
            "time_per_output_token_seconds",
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Arrival to last token.", _LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduling.", _LATENCY_BUCKETS
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt length per request.", _TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request.", _TOKEN_BUCKETS
        )
        # Not in vLLM's set: the engine's own time per step, the yardstick for the latency a
        # streaming client sees (a "decode" step completed no prompt; "prefill" ones did).
        self.step_time = Histogram(
            "pagemill:engine_step_seconds",
            "Wall time of one engine step (LLMEngine.step).",
            [*labels, "phase"],
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self._last_totals: dict[str, float] = {}
        self._last_iteration: Any = None
        # Touch every labelled child so each series is exported (at 0) from the first scrape.
        for metric in (
            self.num_requests_running,
            self.num_requests_waiting,
            self.kv_cache_usage,
            self.grammar_cache_bytes,
            self.prefix_cache_queries,
            self.prefix_cache_hits,
            self.num_preemptions,
            self.prompt_tokens,
            self.generation_tokens,
            self.ttft,
            self.itl,
            self.e2e,
            self.queue_time,
            self.request_prompt_tokens,
            self.request_generation_tokens,
        ):
            metric.labels(model_name)
        for phase in ("decode", "prefill"):
            self.step_time.labels(model_name, phase)

    # -------------------------------------------------- the hook (engine thread)

    def on_step(self, engine: Any, step_seconds: float | None = None) -> None:
        """Fold in one step: gauges from `engine.get_stats()`, increments from
        `engine.iteration_stats` (tokens, latencies and the requests that finished), and the
        step's duration when it ran one (None after an idle batch of commands)."""
        m = self.model_name
        stats = engine.get_stats()
        self.num_requests_running.labels(m).set(stats.num_running)
        self.num_requests_waiting.labels(m).set(stats.num_waiting)
        self.kv_cache_usage.labels(m).set(stats.kv_cache_usage)
        self.grammar_cache_bytes.labels(m).set(getattr(stats, "grammar_cache_bytes", 0))
        # The engine reports running totals; Prometheus counters take increments.
        for key, metric in (
            ("num_preemptions", self.num_preemptions),
            ("prefix_cache_queries", self.prefix_cache_queries),
            ("prefix_cache_hits", self.prefix_cache_hits),
        ):
            total = float(getattr(stats, key))
            delta = total - self._last_totals.get(key, 0.0)
            if delta > 0:
                metric.labels(m).inc(delta)
            self._last_totals[key] = total
        it = getattr(engine, "iteration_stats", None)
        if step_seconds is not None:
            # A step that completed a prompt (or sampled nothing: a prompt chunk) is prefill.
            prefill = it is not None and (
                bool(it.num_prompt_tokens) or not it.num_generation_tokens
            )
            self.step_time.labels(m, "prefill" if prefill else "decode").observe(step_seconds)
        # Called after idle command batches too: a step's increments are folded in once.
        if it is None or it is self._last_iteration:
            return
        self._last_iteration = it
        if it.num_prompt_tokens:
            self.prompt_tokens.labels(m).inc(it.num_prompt_tokens)
        if it.num_generation_tokens:
            self.generation_tokens.labels(m).inc(it.num_generation_tokens)
        for value in it.time_to_first_tokens:
            self.ttft.labels(m).observe(value)
        itl = self.itl.labels(m)
        for value in it.inter_token_latencies:
            itl.observe(value)
        for f in it.finished_requests:
            self.request_success.labels(m, f.finish_reason).inc()
            self.e2e.labels(m).observe(f.e2e_latency)
            if f.queue_time is not None:
                self.queue_time.labels(m).observe(f.queue_time)
            self.request_prompt_tokens.labels(m).observe(f.num_prompt_tokens)
            self.request_generation_tokens.labels(m).observe(f.num_generation_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
