"""Dense bf16 weights prepacked for oneDNN give `F.linear`'s results, eager and compiled."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagemill.runtime.model_executor.layers import Linear
from pagemill.runtime.model_executor.layers import prepacked as P

pytestmark = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="needs oneDNN with bf16 on this CPU",
)


@pytest.fixture(autouse=True)
def _prepack_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(P.PREPACK_ENV, "1")  # off by default (see the module)


def test_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(P.PREPACK_ENV)
    assert P.prepack_dense_weights(_layers()) == 0


def _layers(seed: int = 0) -> torch.nn.Sequential:
    g = torch.Generator().manual_seed(seed)
    layers = [Linear(64, 96, True, torch.bfloat16), Linear(96, 48, False, torch.bfloat16)]
    with torch.no_grad():
        for layer in layers:
            assert layer.weight is not None
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=g))
            if layer.bias is not None:
                layer.bias.copy_(torch.randn(layer.bias.shape, generator=g))
            layer.finalize()
    return torch.nn.Sequential(*layers)


def _reference(model: torch.nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    for layer in model:
        x = F.linear(x, layer.weight, layer.bias)
    return x


def test_eager_matches_f_linear_and_uses_the_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _layers()
    assert P.prepack_dense_weights(model) == (64 * 96 + 96 * 48) * 2
    assert all(layer.prepacked for layer in model)
    hits: list[bool] = []
    twin = P._twin
    monkeypatch.setattr(P, "_twin", lambda w: hits.append(twin(w) is not None) or twin(w))
    for rows in (1, 16, 33):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        torch.testing.assert_close(model(x), _reference(model, x), rtol=1.6e-2, atol=1e-2)
    assert hits and all(hits)


def test_compiled_graph_calls_the_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _layers(1)
    P.prepack_dense_weights(model)
    for layer in model:
        layer.opaque_packed = True  # as the compile cache compiles (no freezing)
    hits: list[bool] = []
    twin = P._twin
    monkeypatch.setattr(P, "_twin", lambda w: hits.append(twin(w) is not None) or twin(w))
    compiled = torch.compile(model, dynamic=True, fullgraph=True)
    with torch.inference_mode():
        for rows in (5, 40):
            x = torch.randn(rows, 64, dtype=torch.bfloat16)
            torch.testing.assert_close(compiled(x), _reference(model, x), rtol=1.6e-2, atol=1e-2)
    assert len(hits) == 4 and all(hits)  # the twin, not F.linear's fallback


def test_a_weight_written_in_place_is_not_served_stale() -> None:
    model = _layers(2)
    P.prepack_dense_weights(model)
    with torch.no_grad():
        model[0].weight.mul_(-1)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(model(x), _reference(model, x), rtol=1.6e-2, atol=1e-2)


def test_env_turns_it_off_and_refuses_typos(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(P.PREPACK_ENV, "0")
    model = _layers()
    assert P.prepack_dense_weights(model) == 0
    assert not any(layer.prepacked for layer in model)
    monkeypatch.setenv(P.PREPACK_ENV, "off")
    with pytest.raises(ValueError, match=P.PREPACK_ENV):
        P.prepack_dense_weights(model)


def test_no_twins_past_the_memory_share() -> None:
    model = _layers()
    assert P.prepack_dense_weights(model, memory_bytes=4 * (64 * 96 + 96 * 48) * 2 - 1) == 0
    assert not any(layer.prepacked for layer in model)
    assert P.prepack_dense_weights(model, memory_bytes=4 * (64 * 96 + 96 * 48) * 2) > 0


def test_fp32_weights_are_left_alone() -> None:
    layer = Linear(16, 16, False, torch.float32)
    layer.finalize()
    assert P.prepack_dense_weights(torch.nn.Sequential(layer)) == 0
    assert not layer.prepacked
