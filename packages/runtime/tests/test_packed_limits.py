"""Packed vs dense hand-over points measured at start-up: the plumbing, not the timings.

The timer is replaced by one whose answer the test chooses, so what is checked is how a
measurement becomes each layer's `packed_max_tokens`, how it is kept and read back, and
when it is not made at all.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

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
    BUSY_ATTEMPTS,
    PACKED_LIMITS_ENV,
    PASSES,
    crossover,
    layer_kind,
    measure_packed_limits,
    running_min,
    time_layers,
)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch) -> None:
    """Loading with measuring on writes under the cache folder: never the user's."""
    monkeypatch.setenv("PAGEMILL_CACHE_DIR", str(tmp_path / "cache"))


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


def _fake_timer(dense_from, calls: list[tuple[int, int]]):
    """Packed is faster below `dense_from(layer)` rows, slower from there on."""

    def timer(layers: Sequence[Linear], rows: int) -> tuple[float, float]:
        calls.append((layers[0].out_features, rows))
        return (2.0, 1.0) if rows >= dense_from(layers[0]) else (1.0, 2.0)

    return timer


def test_crossover_is_the_last_row_count_packed_wins() -> None:
    rows = [1, 2, 4, 8]
    assert crossover(rows, [1, 1, 1, 1], [2, 2, 2, 2]) == 8
    assert crossover(rows, [1, 1, 3, 1], [2, 2, 2, 2]) == 2  # the first loss ends it
    assert crossover(rows, [3, 1, 1, 1], [2, 2, 2, 2]) == 0  # dense from one row
    assert crossover(rows, [2, 2, 2, 2], [2, 2, 2, 2]) == 8  # a tie keeps the smaller weight


def test_running_min_lowers_a_time_above_a_later_one() -> None:
    assert running_min([1.0, 5.0, 2.0, 3.0]) == [1.0, 2.0, 2.0, 3.0]
    assert running_min([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert running_min([]) == []


def test_a_burst_of_other_work_does_not_move_the_limit(tiny_llama, tmp_path, monkeypatch) -> None:
    """A first start shares the machine with the server's other processes starting: a burst
    that slows the packed path at a few row counts in one pass, at one row count in every
    pass while more rows time clean, or at the limit's own row count in both passes, must
    not hand those rows to the dense copies for good."""
    folder, _ = tiny_llama
    model = _hybrid(folder)
    monkeypatch.setenv(PACKED_LIMITS_ENV, "measure")
    rows = (1, 2, 4, 8, 16)

    def timer_with(burst):
        seen: dict[tuple[str, int], int] = {}

        def timer(layers, n):
            key = (layer_kind(layers[0]), n)
            seen[key] = seen.get(key, 0) + 1
            packed = (1.0 if n <= 8 else 3.0) * n  # packed wins up to 8 rows
            dense = 2.0 * n
            if burst(n, seen[key]):
                packed *= 10.0
            return packed, dense

        return timer

    clean = measure_packed_limits(model, tmp_path / "a.json", timer_with(lambda n, k: False), rows)
    assert clean == {"lm_head": 8, "int8": 8}
    # In the first pass only, at 2 and 4 rows: the other pass's times decide.
    once = measure_packed_limits(
        _hybrid(folder), tmp_path / "b.json", timer_with(lambda n, k: k == 1 and n in (2, 4)), rows
    )
    assert once == clean
    # At 4 rows in every pass, while 8 rows times clean: 4 rows cannot take longer than 8.
    always = measure_packed_limits(
        _hybrid(folder), tmp_path / "c.json", timer_with(lambda n, k: n == 4), rows
    )
    assert always == clean
    # At 8 rows, the last packed wins, in both passes: the row counts the limit stands
    # between are timed once more.
    both = measure_packed_limits(
        _hybrid(folder),
        tmp_path / "d.json",
        timer_with(lambda n, k: n == 8 and k <= PASSES),
        rows,
    )
    assert both == clean


def test_measured_limits_reach_the_layers_and_are_kept(tiny_llama, tmp_path, monkeypatch) -> None:
    folder, _ = tiny_llama
    model = _hybrid(folder)  # the suite runs with the table: nothing measured yet
    layers = _packed(model)
    table = {*PACKED_MAX_TOKENS.values(), LM_HEAD_PACKED_MAX_TOKENS}
    assert layers and {m.packed_max_tokens for m in layers} <= table
    head = model.logits_proj
    assert head in layers
    monkeypatch.setenv(PACKED_LIMITS_ENV, "measure")
    path = tmp_path / "limits.json"
    calls: list[tuple[int, int]] = []
    timer = _fake_timer(lambda m: 16 if m is head else 4, calls)
    limits = measure_packed_limits(model, path, timer, rows=(1, 2, 4, 8, 16))
    # The LM head decides alone; the forward's layers share one limit per format.
    assert limits == {"lm_head": 8, "int8": 2}
    for m in layers:
        assert m.packed_max_tokens == (8 if m is head else 2)
    assert packed_row_limits(model) == [2]  # the head is outside the compiled forward
    # One measurement per layer kind and row count in each pass, not per layer; then one
    # more of each kind at the two row counts its group's limit stands between.
    kinds = {layer_kind(m) for m in layers}
    passes, confirm = calls[: PASSES * 5 * len(kinds)], calls[PASSES * 5 * len(kinds) :]
    head_kind = layer_kind(head)
    outs = {k: int(k.split(":")[1].split("x")[0]) for k in kinds}
    assert sorted(passes) == sorted(
        PASSES * [(outs[k], n) for k in kinds for n in (1, 2, 4, 8, 16)]
    )
    assert sorted(confirm) == sorted(
        [(outs[k], n) for k in kinds for n in ((8, 16) if k == head_kind else (2, 4))]
    )
    assert set(json.loads(path.read_text())) == kinds

    # A second start reads the file: nothing is timed, the same limits are set.
    fresh = _hybrid(folder)

    def no_timer(layers, rows):
        raise AssertionError("measured again although the file had the answer")

    assert measure_packed_limits(fresh, path, no_timer, rows=(1, 2, 4, 8, 16)) == limits
    assert [m.packed_max_tokens for m in _packed(fresh)] == [m.packed_max_tokens for m in layers]


def test_a_format_decides_on_its_summed_step_time(tiny_llama, tmp_path, monkeypatch) -> None:
    """One kind gains a lot from packing at 2 rows, another loses a little: packed stays."""
    folder, _ = tiny_llama
    model = _hybrid(folder)
    head = model.logits_proj
    body = sorted({layer_kind(m) for m in _packed(model) if m is not head})
    assert len(body) >= 2
    monkeypatch.setenv(PACKED_LIMITS_ENV, "measure")

    def timer(layers, rows):
        if layers[0] is head:
            return 1.0, 2.0
        if layer_kind(layers[0]) == body[0]:
            return (1.0, 10.0) if rows <= 2 else (30.0, 11.0)
        return 1.1, 1.0  # packed always a little slower

    limits = measure_packed_limits(model, tmp_path / "l.json", timer, rows=(1, 2, 4))
    assert limits is not None and limits["int8"] == 2


def test_int8_activation_layers_are_timed_at_large_batches(
    tiny_llama, tmp_path, monkeypatch
) -> None:
    """A packed path of integer dot products (`gemv_q4`) may beat the dense copy at any
    batch: its kinds are timed past ROW_COUNTS too, and keep packed as far as it wins."""
    folder, _ = tiny_llama
    model = _hybrid(folder)
    head = model.logits_proj
    for m in _packed(model):
        if m is not head:
            m.int8_act = 1  # as `Linear` sets it for int4 rows served by gemv_q4
    monkeypatch.setenv(PACKED_LIMITS_ENV, "measure")
    calls: list[tuple[int, int]] = []
    path = tmp_path / "l.json"
    timer = _fake_timer(lambda m: 99 if m is head else 128, calls)
    limits = measure_packed_limits(model, path, timer, rows=(1, 2), large_rows=(64, 128, 256))
    assert limits == {"lm_head": 2, "int8": 64}
    body = {layer_kind(m) for m in _packed(model) if m is not head}
    assert all(kind.endswith(":int8x1") for kind in body)  # not another path's timings
    outs = [int(k.split(":")[1].split("x")[0]) for k in body]
    passes = PASSES * (
        [(head.out_features, n) for n in (1, 2)]
        + [(out, n) for out in outs for n in (1, 2, 64, 128, 256)]
    )
    # Then the limits' two row counts again: the head packed throughout (2 rows), the
    # rest between 64 and 128.
    confirm = [(head.out_features, 2)] + [(out, n) for out in outs for n in (64, 128)]
    assert sorted(calls) == sorted(passes + confirm)
    assert json.loads(path.read_text())[min(body)]["rows"] == [1, 2, 64, 128, 256]


def test_a_busy_machine_keeps_the_table(tiny_llama, tmp_path, monkeypatch) -> None:
    folder, _ = tiny_llama
    model = _hybrid(folder)
    before = [m.packed_max_tokens for m in _packed(model)]
    monkeypatch.setenv(PACKED_LIMITS_ENV, "measure")
    calls: list[tuple[int, int]] = []
    path = tmp_path / "l.json"
    limits = measure_packed_limits(model, path, _fake_timer(lambda m: 1, calls), budget_s=0.0)
    assert limits == {}
    assert [m.packed_max_tokens for m in _packed(model)] == before

    # Busy again at the next starts: measured again each time, until BUSY_ATTEMPTS busy
    # starts, then the table is kept for good.
    for attempt in range(2, BUSY_ATTEMPTS + 1):
        busy = measure_packed_limits(
            _hybrid(folder), path, _fake_timer(lambda m: 1, calls), budget_s=0.0
        )
        assert busy == {}, attempt
        assert {v["busy_starts"] for v in json.loads(path.read_text()).values()} == {attempt}

    def no_timer(layers, rows):
        raise AssertionError("measured again after BUSY_ATTEMPTS busy starts")

    assert measure_packed_limits(_hybrid(folder), path, no_timer) == {}


def test_a_quiet_start_after_a_busy_one_measures(tiny_llama, tmp_path, monkeypatch) -> None:
    folder, _ = tiny_llama
    monkeypatch.setenv(PACKED_LIMITS_ENV, "measure")
    path = tmp_path / "l.json"
    calls: list[tuple[int, int]] = []
    assert (
        measure_packed_limits(_hybrid(folder), path, _fake_timer(lambda m: 1, calls), budget_s=0.0)
        == {}
    )
    # A file from before the count (busy, no busy_starts) counts as one busy start.
    saved = json.loads(path.read_text())
    for v in saved.values():
        del v["busy_starts"]
    path.write_text(json.dumps(saved))
    calls.clear()
    limits = measure_packed_limits(
        _hybrid(folder), path, _fake_timer(lambda m: 99, calls), rows=(1, 2)
    )
    assert calls and limits
    assert not any(v.get("busy") for v in json.loads(path.read_text()).values())


def test_unreadable_file_is_measured_again(tiny_llama, tmp_path, monkeypatch) -> None:
    folder, _ = tiny_llama
    model = _hybrid(folder)
    monkeypatch.setenv(PACKED_LIMITS_ENV, "measure")
    path = tmp_path / "limits.json"
    path.write_text('{"int8:64x64": {"lim')  # truncated
    calls: list[tuple[int, int]] = []
    limits = measure_packed_limits(model, path, _fake_timer(lambda m: 99, calls), rows=(1, 2))
    assert limits is not None and set(limits.values()) == {2} and calls
    assert set(json.loads(path.read_text())) == {layer_kind(m) for m in _packed(model)}


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


def test_loading_measures_once_into_the_cache_folder(
    tiny_llama, tmp_path, monkeypatch, caplog
) -> None:
    """load_model measures (with the real timer) and keeps the result under the cache."""
    folder, _ = tiny_llama
    monkeypatch.setenv(PACKED_LIMITS_ENV, "measure")
    monkeypatch.setenv("PAGEMILL_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.INFO):
        model = _hybrid(folder)
    files = list((tmp_path / "compiled").glob("packed-limits-*.json"))
    assert len(files) == 1
    saved = json.loads(files[0].read_text())
    if any(v.get("busy") for v in saved.values()):  # a CI box too loaded for the budget
        assert "too busy" in caplog.text
        return
    assert "measured" in caplog.text
    for m in _packed(model):
        entry = saved[layer_kind(m)]
        assert m.packed_max_tokens in entry["rows"] or m.packed_max_tokens == 0
        assert len(entry["packed_ms"]) == len(entry["rows"]) and min(entry["packed_ms"]) > 0


def test_real_timer_times_both_paths(tiny_llama) -> None:
    folder, _ = tiny_llama
    layers = _packed(_hybrid(folder))[:2]
    packed, dense = time_layers(layers, 4)
    assert packed > 0 and dense > 0


def test_limits_are_keyed_by_the_native_kernels(tmp_path, monkeypatch) -> None:
    """Limits timed with one build of the kernels are not read back with another: a new
    kernel source or a switch between kernel paths gives another file."""
    import pagemill.kernels
    from pagemill.runtime.model_executor.quantization import crossover as xo

    monkeypatch.delenv("PAGEMILL_CPU_GEMV_AMX", raising=False)
    base = xo.machine_key()
    assert xo.machine_key() == base
    monkeypatch.setenv("PAGEMILL_CPU_GEMV_AMX", "0")
    assert xo.machine_key() != base
    monkeypatch.delenv("PAGEMILL_CPU_GEMV_AMX")

    fake = tmp_path / "kernels"
    (fake / "csrc").mkdir(parents=True)
    for f in (Path(pagemill.kernels.__file__).parent / "csrc").glob("*.[ch]*"):
        (fake / "csrc" / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(pagemill.kernels, "__file__", str(fake / "__init__.py"))
    assert xo.machine_key() == base
    (fake / "csrc" / "gemv_q4_cpu.cpp").write_text("// another kernel\n")
    assert xo.machine_key() != base
    changed = xo.machine_key()
    (fake / "csrc" / "amx_tiles.h").write_text("// another header\n")
    assert xo.machine_key() != changed
