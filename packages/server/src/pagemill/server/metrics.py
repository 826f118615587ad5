"""Prometheus metrics: vLLM's metric set, under the `pagemill:` prefix and under vLLM's own
`vllm:` names (always both: vLLM's Grafana dashboard and the inference gateway work
unchanged). Each server gets its own `CollectorRegistry` (several apps in one process, as in
tests, must not collide).
Everything here is updated from the engine's figures after every step (prometheus-client is
thread-safe): on the engine thread in-process, or on the client's reader thread from what
the engine process sent. Latencies are measured where tokens appear, not where the HTTP
layer happens to notice.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

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


# pagemill series -> the vLLM names it is also exported under. vLLM's older names that
# dashboards and the gateway still read come along: gpu_cache_usage_perc (before 0.9) and
# time_per_output_token_seconds (the per-token gap, as inter_token_latency_seconds).
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "num_requests_running": ("num_requests_running",),
    "num_requests_waiting": ("num_requests_waiting",),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "prefix_cache_queries": ("prefix_cache_queries",),
    "prefix_cache_hits": ("prefix_cache_hits",),
    "num_preemptions": ("num_preemptions",),
    "prompt_tokens": ("prompt_tokens",),
    "generation_tokens": ("generation_tokens",),
    "request_success": ("request_success",),
    "time_to_first_token_seconds": ("time_to_first_token_seconds",),
    "inter_token_latency_seconds": (
        "inter_token_latency_seconds",
        "time_per_output_token_seconds",
    ),
    "e2e_request_latency_seconds": ("e2e_request_latency_seconds",),
    "request_queue_time_seconds": ("request_queue_time_seconds",),
    "request_prompt_tokens": ("request_prompt_tokens",),
    "request_generation_tokens": ("request_generation_tokens",),
    "spec_decode_num_drafts": ("spec_decode_num_drafts",),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens",),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens",),
    "spec_decode_num_accepted_tokens_per_pos": ("spec_decode_num_accepted_tokens_per_pos",),
}


class VllmNames(Collector):
    """vLLM's names for pagemill's series, made at scrape time from the same values.

    Each `pagemill:<name>` family is copied as `vllm:<alias>` with vLLM's labels:
    `model_name` plus `engine`. With one engine core that is `engine="0"` on the totals.
    With several (`-dp N`, or the replicas behind the Ray Serve ingress) each core's
    series carries its own `engine="i"`, as vLLM's do, copied from the per-core family
    (`per_engine`: the `pagemill:engine_*` series, and the front end's figures kept per
    core); a sum over `engine` gives the totals. Nothing is recorded twice with one core.
    """

    def __init__(self, metrics: dict[str, Any], per_engine: dict[str, Any] | None = None) -> None:
        self.metrics = metrics  # pagemill name (no prefix) -> its metric object
        self.per_engine = per_engine or {}  # the same name -> its per-core metric object

    def _source(self, name: str) -> tuple[list[Metric], bool]:
        """The families to copy, and whether they carry their own `engine` label."""
        per = self.per_engine.get(name)
        if per is not None:
            families = list(per.collect())
            if any(f.samples for f in families):
                return families, True
        return list(self.metrics[name].collect()), False

    def collect(self) -> Iterator[Metric]:
        for name in self.metrics:
            families, per_core = self._source(name)
            for family in families:
                source = family.name  # e.g. "pagemill:prompt_tokens"
                for alias in VLLM_NAMES[name]:
                    target = "vllm:" + alias
                    copy = Metric(target, family.documentation, family.type, family.unit)
                    for sample in family.samples:
                        labels = sample.labels if per_core else {**sample.labels, "engine": "0"}
                        copy.add_sample(
                            target + sample.name[len(source) :],
                            labels,
                            sample.value,
                            sample.timestamp,
                            sample.exemplar,
                        )
                    yield copy


# The front end's figures (tokens, latencies, finished requests, speculative decoding) also
# kept per core when there are several, for vLLM's per-engine series only (their
# `pagemill:` series stay the totals): name -> (kind, documentation, extra labels, buckets).
_PER_CORE_FRONT_END: dict[str, tuple[str, str, tuple[str, ...], tuple[float, ...]]] = {
    "prompt_tokens": ("counter", "Prompt tokens accepted.", (), ()),
    "generation_tokens": ("counter", "Tokens generated.", (), ()),
    "request_success": ("counter", "Requests that finished.", ("finished_reason",), ()),
    "time_to_first_token_seconds": ("histogram", "Time to first token.", (), _TTFT_BUCKETS),
    "inter_token_latency_seconds": ("histogram", "Time between tokens.", (), _ITL_BUCKETS),
    "e2e_request_latency_seconds": ("histogram", "Arrival to last.", (), _LATENCY_BUCKETS),
    "request_queue_time_seconds": ("histogram", "Arrival to scheduled.", (), _LATENCY_BUCKETS),
    "request_prompt_tokens": ("histogram", "Prompt length.", (), _TOKEN_BUCKETS),
    "request_generation_tokens": ("histogram", "Generated tokens.", (), _TOKEN_BUCKETS),
    "spec_decode_num_drafts": ("counter", "Drafts verified.", (), ()),
    "spec_decode_num_draft_tokens": ("counter", "Draft tokens verified.", (), ()),
    "spec_decode_num_accepted_tokens": ("counter", "Draft tokens accepted.", (), ()),
    "spec_decode_num_accepted_tokens_per_pos": (
        "counter",
        "Draft tokens accepted, by position.",
        ("position",),
        (),
    ),
}


_ITERATION_SERIES = (
    "prompt_tokens",
    "generation_tokens",
    "request_success",
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
)


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
        self.num_requests_waiting = gauge(
            "num_requests_waiting", "Requests waiting to be scheduled."
        )
        self.kv_cache_usage = gauge(
            "kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full)."
        )
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.grammar_cache_bytes = gauge(
            "grammar_cache_bytes",
            "Bytes held by compiled grammars (structured output), "
            "bounded by --structured-outputs-cache-bytes.",
        )
        self.compile_graphs_pending = gauge(
            "compile_graphs_pending",
            "Graphs of the model's forward still compiling in the background "
            "(a cold start serves eagerly until 0).",
        )
        self.num_preemptions = counter("num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens accepted.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter(
            "request_success", "Requests that finished, by reason.", ("finished_reason",)
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between two output tokens.", _ITL_BUCKETS
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
        # Speculative decoding (--speculative-config): vLLM's counters, and two gauges of
        # pagemill's own over the totals since start.
        self.spec_num_drafts = counter(
            "spec_decode_num_drafts", "Draft proposals verified (one per request and step)."
        )
        self.spec_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Draft tokens verified."
        )
        self.spec_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted."
        )
        self.spec_accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position in the draft.",
            ("position",),
        )
        self.spec_acceptance_rate = gauge(
            "spec_decode_acceptance_rate", "Accepted / verified draft tokens since start."
        )
        self.spec_mean_accepted_length = gauge(
            "spec_decode_mean_accepted_length",
            "Tokens per verified draft since start: 1 + accepted / drafts.",
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
        # Data parallel: each core's own figures, by an `engine` label (the series above
        # stay the totals over all cores).
        per = [*labels, "engine"]
        self.engine_running = Gauge(
            "pagemill:engine_num_requests_running", "Running requests of one core.", per, registry=r
        )
        self.engine_waiting = Gauge(
            "pagemill:engine_num_requests_waiting", "Waiting requests of one core.", per, registry=r
        )
        self.engine_kv_usage = Gauge(
            "pagemill:engine_kv_cache_usage_perc", "KV cache use of one core.", per, registry=r
        )
        self.engine_prefix_queries = Counter(
            "pagemill:engine_prefix_cache_queries",
            "Prompt tokens looked up in one core's prefix cache.",
            per,
            registry=r,
        )
        self.engine_prefix_hits = Counter(
            "pagemill:engine_prefix_cache_hits",
            "Prompt tokens found in one core's prefix cache.",
            per,
            registry=r,
        )
        self.engine_preemptions = Counter(
            "pagemill:engine_num_preemptions",
            "Requests one core preempted (their blocks freed, recomputed later).",
            per,
            registry=r,
        )
        self._last_engine_totals: dict[tuple[str, int], float] = {}
        self._last_totals: dict[str, float] = {}
        self._last_iteration: Any = None
        # Touch every labelled child so each series is exported (at 0) from the first scrape.
        for metric in (
            self.num_requests_running,
            self.num_requests_waiting,
            self.kv_cache_usage,
            self.grammar_cache_bytes,
            self.compile_graphs_pending,
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
        twins = {
            name: getattr(self, attr)
            for name, attr in (
                ("num_requests_running", "num_requests_running"),
                ("num_requests_waiting", "num_requests_waiting"),
                ("kv_cache_usage_perc", "kv_cache_usage"),
                ("prefix_cache_queries", "prefix_cache_queries"),
                ("prefix_cache_hits", "prefix_cache_hits"),
                ("num_preemptions", "num_preemptions"),
                ("prompt_tokens", "prompt_tokens"),
                ("generation_tokens", "generation_tokens"),
                ("request_success", "request_success"),
                ("time_to_first_token_seconds", "ttft"),
                ("inter_token_latency_seconds", "itl"),
                ("e2e_request_latency_seconds", "e2e"),
                ("request_queue_time_seconds", "queue_time"),
                ("request_prompt_tokens", "request_prompt_tokens"),
                ("request_generation_tokens", "request_generation_tokens"),
                ("spec_decode_num_drafts", "spec_num_drafts"),
                ("spec_decode_num_draft_tokens", "spec_num_draft_tokens"),
                ("spec_decode_num_accepted_tokens", "spec_num_accepted_tokens"),
                ("spec_decode_num_accepted_tokens_per_pos", "spec_accepted_per_pos"),
            )
        }
        # Per core (several cores only): the scheduler's figures are the `pagemill:engine_*`
        # series above; the front end's are kept here, outside the registry.
        per = [*labels, "engine"]
        self._engine_twins: dict[str, Any] = {}
        for name, (kind, doc, extra, buckets) in _PER_CORE_FRONT_END.items():
            if kind == "counter":
                self._engine_twins[name] = Counter(
                    f"pagemill:{name}", doc, [*per, *extra], registry=None
                )
            else:
                self._engine_twins[name] = Histogram(
                    f"pagemill:{name}", doc, [*per, *extra], buckets=buckets, registry=None
                )
        per_engine = {
            "num_requests_running": self.engine_running,
            "num_requests_waiting": self.engine_waiting,
            "kv_cache_usage_perc": self.engine_kv_usage,
            "prefix_cache_queries": self.engine_prefix_queries,
            "prefix_cache_hits": self.engine_prefix_hits,
            "num_preemptions": self.engine_preemptions,
            **self._engine_twins,
        }
        r.register(VllmNames(twins, per_engine))

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
        self.compile_graphs_pending.labels(m).set(getattr(stats, "compile_graphs_pending", 0))
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
        if getattr(stats, "spec_num_drafts", 0):
            self._spec(stats)
        per_engine = getattr(engine, "per_engine", None)
        if per_engine:
            self._per_engine(per_engine)
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
        self._fold(
            it,
            (m,),
            self.prompt_tokens,
            self.generation_tokens,
            self.request_success,
            self.ttft,
            self.itl,
            self.e2e,
            self.queue_time,
            self.request_prompt_tokens,
            self.request_generation_tokens,
        )
        if per_engine:  # several cores: each output is one core's (its `engine_index`)
            e = self._engine_twins
            self._fold(
                it,
                (m, str(getattr(engine, "engine_index", 0))),
                *(e[name] for name in _ITERATION_SERIES),
            )

    @staticmethod
    def _fold(
        it: Any,
        key: tuple[str, ...],
        prompt_tokens: Any,
        generation_tokens: Any,
        request_success: Any,
        ttft: Any,
        itl: Any,
        e2e: Any,
        queue_time: Any,
        request_prompt_tokens: Any,
        request_generation_tokens: Any,
    ) -> None:
        """One output's increments into one set of series, labelled `key`."""
        if it.num_prompt_tokens:
            prompt_tokens.labels(*key).inc(it.num_prompt_tokens)
        if it.num_generation_tokens:
            generation_tokens.labels(*key).inc(it.num_generation_tokens)
        for value in it.time_to_first_tokens:
            ttft.labels(*key).observe(value)
        itl_child = itl.labels(*key)
        for value in it.inter_token_latencies:
            itl_child.observe(value)
        for f in it.finished_requests:
            request_success.labels(*key, f.finish_reason).inc()
            e2e.labels(*key).observe(f.e2e_latency)
            if f.queue_time is not None:
                queue_time.labels(*key).observe(f.queue_time)
            request_prompt_tokens.labels(*key).observe(f.num_prompt_tokens)
            request_generation_tokens.labels(*key).observe(f.num_generation_tokens)

    def _spec(self, stats: Any) -> None:
        """Speculative decoding's totals folded in as counter increments."""
        m = self.model_name
        for key, metric in (
            ("spec_num_drafts", self.spec_num_drafts),
            ("spec_num_draft_tokens", self.spec_num_draft_tokens),
            ("spec_num_accepted_tokens", self.spec_num_accepted_tokens),
        ):
            total = float(getattr(stats, key))
            delta = total - self._last_totals.get(key, 0.0)
            if delta > 0:
                metric.labels(m).inc(delta)
            self._last_totals[key] = total
        for pos, value in enumerate(stats.spec_accepted_per_pos):
            key = f"spec_accepted_pos_{pos}"
            delta = float(value) - self._last_totals.get(key, 0.0)
            child = self.spec_accepted_per_pos.labels(m, str(pos))
            if delta > 0:
                child.inc(delta)
            self._last_totals[key] = float(value)
        drafts, draft_tokens = stats.spec_num_drafts, stats.spec_num_draft_tokens
        accepted = stats.spec_num_accepted_tokens
        self.spec_acceptance_rate.labels(m).set(accepted / draft_tokens if draft_tokens else 0.0)
        self.spec_mean_accepted_length.labels(m).set(1.0 + accepted / drafts if drafts else 0.0)

    def _per_engine(self, per_engine: Any) -> None:
        m = self.model_name
        for k, s in enumerate(per_engine):
            e = str(k)
            self.engine_running.labels(m, e).set(s.num_running)
            self.engine_waiting.labels(m, e).set(s.num_waiting)
            self.engine_kv_usage.labels(m, e).set(s.kv_cache_usage)
            for key, metric in (
                ("prefix_cache_queries", self.engine_prefix_queries),
                ("prefix_cache_hits", self.engine_prefix_hits),
                ("num_preemptions", self.engine_preemptions),
            ):
                total = float(getattr(s, key))
                delta = total - self._last_engine_totals.get((key, k), 0.0)
                metric.labels(m, e).inc(max(0.0, delta))
                self._last_engine_totals[(key, k)] = total
            if getattr(s, "spec_num_drafts", 0):
                self._engine_spec(k, s)

    def _engine_spec(self, k: int, s: Any) -> None:
        """One core's speculative-decoding totals, as increments of its vLLM series."""
        m, e, twins = self.model_name, str(k), self._engine_twins
        totals: list[tuple[str, Any, tuple[str, ...], float]] = [
            (key, twins[name], (), float(getattr(s, key)))
            for key, name in (
                ("spec_num_drafts", "spec_decode_num_drafts"),
                ("spec_num_draft_tokens", "spec_decode_num_draft_tokens"),
                ("spec_num_accepted_tokens", "spec_decode_num_accepted_tokens"),
            )
        ]
        per_pos = twins["spec_decode_num_accepted_tokens_per_pos"]
        totals += [
            (f"spec_accepted_pos_{pos}", per_pos, (str(pos),), float(v))
            for pos, v in enumerate(s.spec_accepted_per_pos)
        ]
        for key, metric, extra, total in totals:
            delta = total - self._last_engine_totals.get((key, k), 0.0)
            metric.labels(m, e, *extra).inc(max(0.0, delta))
            self._last_engine_totals[(key, k)] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)
