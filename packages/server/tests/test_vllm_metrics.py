"""/metrics under vLLM's names: every `vllm:*` series vLLM's dashboard and the inference
gateway read, with vLLM's labels and bucket edges, equal to pagemill's own series."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pagemill.server.metrics import EngineMetrics

# Names, label sets and bucket edges as vLLM's PrometheusStatLogger declares them
# (vllm/v1/metrics/loggers.py), written out from vLLM's source.
VLLM_TTFT = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
VLLM_TPOT = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
]  # fmt: skip
VLLM_LATENCY = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip
VLLM_GAUGES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
]
VLLM_COUNTERS = [
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:num_preemptions",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:request_success",
]
VLLM_HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": VLLM_TTFT,
    "vllm:inter_token_latency_seconds": VLLM_TPOT,
    "vllm:time_per_output_token_seconds": VLLM_TPOT,
    "vllm:e2e_request_latency_seconds": VLLM_LATENCY,
    "vllm:request_queue_time_seconds": VLLM_LATENCY,
}


def fake_engine(step: int) -> SimpleNamespace:
    stats = SimpleNamespace(
        num_running=3,
        num_waiting=2,
        kv_cache_usage=0.25,
        grammar_cache_bytes=0,
        num_preemptions=step,
        prefix_cache_queries=40 * step,
        prefix_cache_hits=16 * step,
    )
    finished = SimpleNamespace(
        finish_reason="stop",
        e2e_latency=1.2,
        queue_time=0.05,
        num_prompt_tokens=40,
        num_generation_tokens=9,
    )
    it = SimpleNamespace(
        num_prompt_tokens=40,
        num_generation_tokens=3,
        time_to_first_tokens=[0.07],
        inter_token_latencies=[0.02, 0.03],
        finished_requests=[finished],
    )
    return SimpleNamespace(get_stats=lambda: stats, iteration_stats=it)


def scrape(metrics: EngineMetrics) -> dict[str, Any]:
    return {
        family.name: family for family in text_string_to_metric_families(metrics.render().decode())
    }


def test_vllm_names_labels_and_buckets() -> None:
    metrics = EngineMetrics("my-model")
    for step in (1, 2):
        metrics.on_step(fake_engine(step), 0.01)
    families = scrape(metrics)
    labels = {"model_name": "my-model", "engine": "0"}
    for name in VLLM_GAUGES:
        assert families[name].type == "gauge", name
        [sample] = families[name].samples
        assert sample.labels == labels
    assert families["vllm:num_requests_waiting"].samples[0].value == 2
    assert families["vllm:gpu_cache_usage_perc"].samples[0].value == 0.25
    for name in VLLM_COUNTERS:
        assert families[name].type == "counter", name
    totals = {
        name: next(s.value for s in families[name].samples if s.name.endswith("_total"))
        for name in VLLM_COUNTERS
    }
    assert totals == {
        "vllm:prompt_tokens": 80,
        "vllm:generation_tokens": 6,
        "vllm:num_preemptions": 2,
        "vllm:prefix_cache_queries": 80,
        "vllm:prefix_cache_hits": 32,
        "vllm:request_success": 2,
    }
    [success] = [s for s in families["vllm:request_success"].samples if s.name.endswith("_total")]
    assert success.labels == {**labels, "finished_reason": "stop"}
    for name, edges in VLLM_HISTOGRAMS.items():
        family = families[name]
        assert family.type == "histogram", name
        buckets = [s for s in family.samples if s.name == name + "_bucket"]
        assert [float(s.labels["le"]) for s in buckets] == [*edges, float("inf")], name
        assert all({k: v for k, v in s.labels.items() if k != "le"} == labels for s in buckets)
    count = {
        name: next(s.value for s in families[name].samples if s.name == name + "_count")
        for name in VLLM_HISTOGRAMS
    }
    assert count["vllm:time_to_first_token_seconds"] == 2
    assert count["vllm:inter_token_latency_seconds"] == 4
    assert count["vllm:time_per_output_token_seconds"] == 4
    assert count["vllm:e2e_request_latency_seconds"] == 2


def test_every_vllm_series_equals_its_pagemill_twin() -> None:
    metrics = EngineMetrics("m")
    metrics.on_step(fake_engine(1), 0.01)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in scrape(metrics).values()
        for s in family.samples
    }
    renamed = {"vllm:gpu_cache_usage_perc": "kv_cache_usage_perc"}
    renamed_prefix = {"vllm:time_per_output_token_seconds": "inter_token_latency_seconds"}
    checked = 0
    for (name, labels), value in samples.items():
        if not name.startswith("vllm:"):
            continue
        base = name.removeprefix("vllm:")
        for old, new in (*renamed.items(), *renamed_prefix.items()):
            if name.startswith(old):
                base = new + name.removeprefix(old)
        ours = tuple((k, v) for k, v in labels if k != "engine")
        assert samples[("pagemill:" + base, ours)] == value, name
        checked += 1
    assert checked > 100


def _core(running: int, waiting: int, kv: float, queries: int, hits: int) -> SimpleNamespace:
    return SimpleNamespace(
        num_running=running,
        num_waiting=waiting,
        kv_cache_usage=kv,
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        num_preemptions=0,
        spec_num_drafts=0,
    )


def _dp_output(engine: int, cores: list[SimpleNamespace], prompt: int, ttfts: list[float]):
    stats = SimpleNamespace(
        num_running=sum(c.num_running for c in cores),
        num_waiting=sum(c.num_waiting for c in cores),
        kv_cache_usage=sum(c.kv_cache_usage for c in cores) / len(cores),
        grammar_cache_bytes=0,
        num_preemptions=0,
        prefix_cache_queries=sum(c.prefix_cache_queries for c in cores),
        prefix_cache_hits=sum(c.prefix_cache_hits for c in cores),
    )
    it = SimpleNamespace(
        num_prompt_tokens=prompt,
        num_generation_tokens=len(ttfts),
        time_to_first_tokens=ttfts,
        inter_token_latencies=[],
        finished_requests=[],
    )
    return SimpleNamespace(
        get_stats=lambda: stats, iteration_stats=it, per_engine=cores, engine_index=engine
    )


def test_data_parallel_vllm_series_carry_each_cores_engine_label() -> None:
    """-dp 2 (or two Ray Serve replicas): every vllm: series is per core, `engine="i"`,
    with that core's own figures, as vLLM labels them; summed over `engine` they are the
    pagemill: totals."""
    metrics = EngineMetrics("m")
    a, b = _core(3, 1, 0.5, 100, 40), _core(1, 0, 0.25, 60, 0)
    metrics.on_step(_dp_output(0, [a, b], prompt=30, ttfts=[0.1, 0.2]), 0.01)
    a2 = _core(2, 0, 0.75, 160, 88)
    metrics.on_step(_dp_output(1, [a2, b], prompt=12, ttfts=[0.3]), 0.01)
    families = scrape(metrics)

    def by_engine(name: str, suffix: str = "") -> dict[str, float]:
        samples = [s for s in families[name].samples if s.name == name + suffix]
        assert all(set(s.labels) >= {"model_name", "engine"} for s in samples)
        values = {s.labels["engine"]: s.value for s in samples}
        assert len(values) == len(samples)  # one series per core, no unlabelled total
        return values

    want_cores = {"0": a2, "1": b}
    for name, attr in (
        ("vllm:num_requests_running", "num_running"),
        ("vllm:num_requests_waiting", "num_waiting"),
        ("vllm:kv_cache_usage_perc", "kv_cache_usage"),
        ("vllm:gpu_cache_usage_perc", "kv_cache_usage"),
    ):
        assert by_engine(name) == {k: getattr(c, attr) for k, c in want_cores.items()}, name
    for name, attr in (
        ("vllm:prefix_cache_queries", "prefix_cache_queries"),
        ("vllm:prefix_cache_hits", "prefix_cache_hits"),
    ):
        got = by_engine(name, "_total")
        assert got == {k: getattr(c, attr) for k, c in want_cores.items()}, name
        total = families[name.replace("vllm:", "pagemill:")].samples[0].value
        assert sum(got.values()) == total
    # The front end's figures follow the core each output came from.
    assert by_engine("vllm:prompt_tokens", "_total") == {"0": 30, "1": 12}
    assert by_engine("vllm:generation_tokens", "_total") == {"0": 2, "1": 1}
    ttft = by_engine("vllm:time_to_first_token_seconds", "_count")
    assert ttft == {"0": 2, "1": 1}
    ours = families["pagemill:time_to_first_token_seconds"].samples
    [count] = [s.value for s in ours if s.name.endswith("_count")]
    assert sum(ttft.values()) == count == 3


def test_data_parallel_spec_decode_series_are_per_core() -> None:
    metrics = EngineMetrics("m")
    a, b = _core(1, 0, 0.1, 0, 0), _core(1, 0, 0.1, 0, 0)
    for core, (drafts, tokens, accepted, per_pos) in (
        (a, (4, 12, 7, [4, 2, 1])),
        (b, (2, 6, 1, [1])),
    ):
        core.spec_num_drafts, core.spec_num_draft_tokens = drafts, tokens
        core.spec_num_accepted_tokens, core.spec_accepted_per_pos = accepted, per_pos
    metrics.on_step(_dp_output(0, [a, b], prompt=0, ttfts=[]), 0.01)
    families = scrape(metrics)

    def total(name: str, **labels: str) -> float:
        return sum(
            s.value
            for s in families[name].samples
            if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in labels.items())
        )

    for name, want in (
        ("vllm:spec_decode_num_drafts", (4, 2)),
        ("vllm:spec_decode_num_draft_tokens", (12, 6)),
        ("vllm:spec_decode_num_accepted_tokens", (7, 1)),
    ):
        assert (total(name, engine="0"), total(name, engine="1")) == want, name
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos"
    assert total(per_pos, engine="0", position="2") == 1
    assert total(per_pos, engine="1", position="0") == 1
    assert total(per_pos, engine="1", position="1") == 0
