"""Packed vs dense hand-over points measured at start-up: the plumbing, not the timings.

The timer is replaced by one whose answer the test chooses, so what is checked is how a
measurement becomes each layer's `packed_max_tokens`, how it is kept and read back, and
when it is not made at all.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
import torch

from pagemill.runtime.config import ModelConfig
from pagemill.runtime.model_executor.layers import Linear, packed_row_limits
from pagemill.runtime.model_executor.loader import load_model
from pagemill.runtime.model_executor.quantization import (
    LM_HEAD_PACKED_MAX_TOKENS,
    PACKED_MAX_TOKENS,
    plan_weights,
)
from pagemill.runtime.model_executor.quantization.crossover import (
    PACKED_LIMITS_ENV,
    crossover,
    layer_kind,
    measure_packed_limits,
    time_layers,
)


def _hybrid(folder, **kwargs) -> torch.nn.Module:
    config = ModelConfig.from_pretrained(folder)
    return load_model(
        folder,
        config,
        torch.bfloat16,
        torch.device("cpu"),
        128,
        quantization="int8",
        dense_fallback=True,
        **kwargs,
    )


def _packed(model: torch.nn.Module) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear) and m.has_dense_fallback]


def _fake_timer(dense_from: dict[int, int], calls: list[tuple[int, int]]):
    """Packed is faster below `dense_from[out_features]` rows, slower from there on."""

    def timer(layers: Sequence[Linear], rows: int) -> tuple[float, float]:
        calls.append((layers[0].out_features, rows))
        edge = dense_from.get(layers[0].out_features, 10**9)
        return (2.0, 1.0) if rows >= edge else (1.0, 2.0)

    return timer


def test_crossover_is_the_last_row_count_packed_wins() -> None:
    rows = [1, 2, 4, 8]
    assert crossover(rows, [1, 1, 1, 1], [2, 2, 2, 2]) == 8
    assert crossover(rows, [1, 1, 3, 1], [2, 2, 2, 2]) == 2  # the first loss ends it
    assert crossover(rows, [3, 1, 1, 1], [2, 2, 2, 2]) == 0  # dense from one row
    assert crossover(rows, [2, 2, 2, 2], [2, 2, 2, 2]) == 8  # a tie keeps the smaller weight


def test_measured_limits_reach_the_layers_and_are_kept(tiny_llama, tmp_path, monkeypatch) -> None:
    folder, _ = tiny_llama
    model = _hybrid(folder)  # the suite runs with the table: nothing measured yet
    layers = _packed(model)
    table = {*PACKED_MAX_TOKENS.values(), LM_HEAD_PACKED_MAX_TOKENS}
    assert layers and {m.packed_max_tokens for m in layers} <= table
    monkeypatch.setenv(PACKED_LIMITS_ENV, "measure")
    path = tmp_path / "limits.json"
    shapes = sorted({m.out_features for m in layers})
    edges = {out: 2 ** (i % 4) for i, out in enumerate(shapes)}  # 1, 2, 4, 8, 1, ...
    calls: list[tuple[int, int]] = []
    limits = measure_packed_limits(model, path, _fake_timer(edges, calls), rows=(1, 2, 4, 8, 16))
    assert limits is not None and set(limits) == {layer_kind(m) for m in layers}
    for m in layers:
        assert m.packed_max_tokens == edges[m.out_features] // 2, layer_kind(m)
    assert set(packed_row_limits(model)) <= {edges[out] // 2 for out in shapes}
    # One measurement per kind and row count, not per layer.
    assert len(calls) == 5 * len(limits)
    saved = json.loads(path.read_text())
    assert {k: v["limit"] for k, v in saved.items()} == limits

    # A second start reads the file: nothing is timed, the same limits are set.
    fresh = _hybrid(folder)

    def no_timer(layers, rows):
        raise AssertionError("measured again although the file had the answer")

    assert measure_packed_limits(fresh, path, no_timer) == limits
    assert [m.packed_max_tokens for m in _packed(fresh)] == [m.packed_max_tokens for m in layers]


def test_unreadable_file_is_measured_again(tiny_llama, tmp_path, monkeypatch) -> None:
    folder, _ = tiny_llama
    model = _hybrid(folder)
    monkeypatch.setenv(PACKED_LIMITS_ENV, "measure")
    path = tmp_path / "limits.json"
    path.write_text('{"int8:64x64": {"lim')  # truncated
    calls: list[tuple[int, int]] = []
    limits = measure_packed_limits(model, path, _fake_timer({}, calls), rows=(1, 2))
    assert limits is not None and set(limits.values()) == {2} and calls
    assert {k: v["limit"] for k, v in json.loads(path.read_text()).items()} == limits


def test_table_mode_and_fixed_limits_are_not_measured(tiny_llama, tmp_path, monkeypatch) -> None:
    folder, _ = tiny_llama

    def no_timer(layers, rows):
        raise AssertionError("measured although measuring is off")

    model = _hybrid(folder)
    before = [m.packed_max_tokens for m in _packed(model)]
    monkeypatch.setenv(PACKED_LIMITS_ENV, "table")
    assert measure_packed_limits(model, tmp_path / "l.json", no_timer) is None
    assert [m.packed_max_tokens for m in _packed(model)] == before
    assert not (tmp_path / "l.json").exists()

    # A limit the caller fixed (plan_weights' packed_max_tokens) is honoured, not measured.
    monkeypatch.setenv(PACKED_LIMITS_ENV, "measure")
    plan = plan_weights(
        "int8",
        gguf=False,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
        dense_fallback=True,
        packed_max_tokens=3,
    )
    assert not plan.linear.measure_packed_limit and not plan.lm_head.measure_packed_limit
    auto = plan_weights(
        "int8", gguf=False, dtype=torch.bfloat16, device=torch.device("cpu"), dense_fallback=True
    )
    assert auto.linear.measure_packed_limit and auto.lm_head.measure_packed_limit
    monkeypatch.setenv(PACKED_LIMITS_ENV, "bogus")
    with pytest.raises(ValueError, match=PACKED_LIMITS_ENV):
        measure_packed_limits(model, tmp_path / "l.json", no_timer)


def test_loading_measures_once_into_the_cache_folder(tiny_llama, tmp_path, monkeypatch) -> None:
    """load_model measures (with the real timer) and keeps the result under the cache."""
    folder, _ = tiny_llama
    monkeypatch.setenv(PACKED_LIMITS_ENV, "measure")
    monkeypatch.setenv("PAGEMILL_CACHE_DIR", str(tmp_path))
    model = _hybrid(folder)
    files = list((tmp_path / "compiled").glob("packed-limits-*.json"))
    assert len(files) == 1
    saved = json.loads(files[0].read_text())
    for m in _packed(model):
        entry = saved[layer_kind(m)]
        assert m.packed_max_tokens == entry["limit"]
        assert len(entry["packed_ms"]) == len(entry["rows"]) and min(entry["packed_ms"]) > 0


def test_real_timer_times_both_paths(tiny_llama) -> None:
    folder, _ = tiny_llama
    layers = _packed(_hybrid(folder))[:2]
    packed, dense = time_layers(layers, 4, budget_s=0.01)
    assert packed > 0 and dense > 0
