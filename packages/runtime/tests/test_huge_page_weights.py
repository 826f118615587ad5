"""Packed CPU weights moved into one huge-page mapping after loading: same bytes, same
results, one mapping, ties kept; `PAGEMILL_HUGE_PAGE_WEIGHTS=0` leaves them alone."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from pagemill.blockpool.host_memory import huge_page_size
from pagemill.runtime.config import ModelConfig
from pagemill.runtime.model_executor import huge_page_weights
from pagemill.runtime.model_executor.huge_page_weights import (
    HUGE_PAGE_WEIGHTS_ENV,
    PACKED_BUFFERS,
    place_packed_weights,
)
from pagemill.runtime.model_executor.layers import Linear
from pagemill.runtime.model_executor.loader import load_model
from pagemill.runtime.model_executor.quantization import weight_report

CPU = torch.device("cpu")


def _packed(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        f"{mod_name}.{name}": t
        for mod_name, module in model.named_modules()
        for name, t in module._buffers.items()
        if name in PACKED_BUFFERS and t is not None
    }


def _load(folder, monkeypatch, enabled: str):
    monkeypatch.setenv(HUGE_PAGE_WEIGHTS_ENV, enabled)
    config = ModelConfig.from_pretrained(folder)
    return load_model(folder, config, torch.bfloat16, CPU, 256, quantization="int4")


def test_loaded_packed_weights_share_one_mapping_and_compute_the_same(
    tiny_llama, monkeypatch, caplog
) -> None:
    folder, _ = tiny_llama
    before = _load(folder, monkeypatch, "0")
    with caplog.at_level(logging.INFO, logger="pagemill.runtime.model_executor.loader"):
        after = _load(folder, monkeypatch, "1")
    old, new = _packed(before), _packed(after)
    assert new and old.keys() == new.keys()
    assert len({t.untyped_storage().data_ptr() for t in old.values()}) > 1
    storages = {t.untyped_storage().data_ptr() for t in new.values()}
    assert len(storages) == 1  # every packed buffer is a view of the one mapping
    assert min(t.data_ptr() for t in new.values()) % huge_page_size() == 0
    for name, t in new.items():
        assert t.dtype == old[name].dtype and t.shape == old[name].shape
        assert t.is_contiguous() and t.data_ptr() % 128 == 0
        assert torch.equal(t, old[name]), name
    report_before, report_after = weight_report(before), weight_report(after)
    assert report_after.packed_bytes == report_before.packed_bytes > 0
    assert report_after.step_bytes == report_before.step_bytes
    assert report_after.total_bytes == report_before.total_bytes
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("packed weights:")]
    assert len(lines) == 1 and f"{len(new)} packed tensors" in lines[0]
    layers_before = {n: m for n, m in before.named_modules() if isinstance(m, Linear)}
    packed_after = [
        (n, m) for n, m in after.named_modules() if isinstance(m, Linear) and m.qweight is not None
    ]
    assert packed_after
    g = torch.Generator().manual_seed(0)
    for name, layer in packed_after:
        for rows in (1, 5):
            x = torch.randn(rows, layer.in_features, generator=g).to(torch.bfloat16)
            assert torch.equal(layer(x), layers_before[name](x)), name


def test_off_leaves_the_weights_where_loading_put_them(tiny_llama, monkeypatch, caplog) -> None:
    folder, _ = tiny_llama
    with caplog.at_level(logging.INFO, logger="pagemill.runtime.model_executor.loader"):
        model = _load(folder, monkeypatch, "0")
    assert len({t.untyped_storage().data_ptr() for t in _packed(model).values()}) > 1
    assert not any(r.getMessage().startswith("packed weights:") for r in caplog.records)


class _Holder(nn.Module):
    def __init__(self, **buffers: torch.Tensor | None) -> None:
        super().__init__()
        for name, t in buffers.items():
            self.register_buffer(name, t)


def test_a_shared_tensor_stays_shared_and_odd_ones_stay_put(monkeypatch) -> None:
    monkeypatch.delenv(HUGE_PAGE_WEIGHTS_ENV, raising=False)  # unset: on
    shared = torch.arange(1000, dtype=torch.int32)
    strided = torch.arange(64, dtype=torch.uint8).view(8, 8).t()  # not contiguous
    other = torch.randn(3, 5).to(torch.bfloat16)
    model = nn.Sequential(
        _Holder(qweight=shared, scales=other, zeros=None),
        _Holder(qweight=shared, scales_and_zeros=strided),
        _Holder(weight=torch.ones(4)),  # not a packed buffer: not moved
    )
    dense = model[2].weight
    placed = place_packed_weights(model)
    assert placed is not None and placed.tensors == 2
    assert placed.nbytes == 4096 + 128  # each tensor rounded up to 128 bytes
    assert model[0].qweight is model[1].qweight
    assert model[0].qweight.data_ptr() != shared.data_ptr()
    assert torch.equal(model[0].qweight, shared) and torch.equal(model[0].scales, other)
    assert model[1].scales_and_zeros is strided and model[0].zeros is None
    assert model[2].weight is dense
    assert "2 packed tensors" in placed.summary()


def test_nothing_to_move_or_turned_off_gives_none(monkeypatch) -> None:
    assert place_packed_weights(nn.Linear(4, 4)) is None
    monkeypatch.setenv(HUGE_PAGE_WEIGHTS_ENV, "0")
    assert place_packed_weights(_Holder(qweight=torch.ones(8))) is None


def test_a_bad_switch_value_is_refused(monkeypatch) -> None:
    monkeypatch.setenv(HUGE_PAGE_WEIGHTS_ENV, "yes")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        huge_page_weights.huge_page_weights_enabled()


def test_the_originals_are_freed_once_moved(monkeypatch) -> None:
    import weakref

    monkeypatch.setenv(HUGE_PAGE_WEIGHTS_ENV, "1")
    model = nn.Sequential(_Holder(qweight=torch.ones(1 << 16)), _Holder(scales=torch.ones(64)))
    refs = [weakref.ref(model[0].qweight), weakref.ref(model[1].scales)]
    placed = place_packed_weights(model)
    assert placed is not None and placed.tensors == 2
    assert all(r() is None for r in refs)  # nothing kept them once the modules let go
    assert torch.equal(model[0].qweight, torch.ones(1 << 16))
