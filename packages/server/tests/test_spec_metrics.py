"""Speculative decoding's counters under vLLM's names (vllm/v1/spec_decode/metrics.py:
`vllm:spec_decode_num_drafts` etc., per-position acceptance labelled `position`), folded in
from the engine's running totals, and pagemill's own acceptance gauges."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from pagemill.server.metrics import EngineMetrics


def engine(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> SimpleNamespace:
    stats = SimpleNamespace(
        num_running=1,
        num_waiting=0,
        kv_cache_usage=0.1,
        grammar_cache_bytes=0,
        num_preemptions=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        spec_num_drafts=drafts,
        spec_num_draft_tokens=draft_tokens,
        spec_num_accepted_tokens=accepted,
        spec_accepted_per_pos=per_pos,
    )
    return SimpleNamespace(get_stats=lambda: stats, iteration_stats=None)


def test_spec_decode_counters_follow_the_engine_totals() -> None:
    metrics = EngineMetrics("m")
    metrics.on_step(engine(2, 6, 3, [2, 1, 0]), 0.01)
    metrics.on_step(engine(5, 15, 9, [5, 3, 1]), 0.01)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }
    vllm = (("engine", "0"), ("model_name", "m"))
    assert samples[("vllm:spec_decode_num_drafts_total", vllm)] == 5
    assert samples[("vllm:spec_decode_num_draft_tokens_total", vllm)] == 15
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", vllm)] == 9
    for pos, value in enumerate([5, 3, 1]):
        key = (
            "vllm:spec_decode_num_accepted_tokens_per_pos_total",
            (("engine", "0"), ("model_name", "m"), ("position", str(pos))),
        )
        assert samples[key] == value
    own = (("model_name", "m"),)
    assert samples[("pagemill:spec_decode_num_drafts_total", own)] == 5
    assert samples[("pagemill:spec_decode_acceptance_rate", own)] == 9 / 15
    assert samples[("pagemill:spec_decode_mean_accepted_length", own)] == 1 + 9 / 5


def test_dashboard_series_shows_acceptance_per_bucket() -> None:
    from pagemill.server.dashboard.series import SeriesRecorder

    rec = SeriesRecorder(bucket_s=1.0, clock=lambda: 0.0)
    rec.add_step(engine(0, 0, 0, []).get_stats(), None, 0.01, now=0.1)
    rec.add_step(engine(2, 8, 2, [2]).get_stats(), None, 0.01, now=0.5)
    [first] = rec.add_step(engine(4, 16, 8, [4, 2]).get_stats(), None, 0.01, now=1.2)
    assert first["spec_accept"] == 25.0  # 2 of 8 drafted in the first second
    [second] = rec.flush(now=2.1)
    assert second["spec_accept"] == 75.0  # 6 of the next 8


def test_speculative_config_flag_reaches_the_engine_config() -> None:
    import pytest

    from pagemill.server import cli

    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    args = cli.parse_args(["serve", "some/model", "--speculative-config", spec])
    assert cli.engine_config(args).speculative_config == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 3,
    }
    medusa = '{"method": "medusa", "model": "x", "num_speculative_tokens": 3}'
    args = cli.parse_args(["serve", "some/model", "--speculative-config", medusa])
    with pytest.raises(ValueError, match="'medusa' is not supported yet"):
        cli.engine_config(args)
