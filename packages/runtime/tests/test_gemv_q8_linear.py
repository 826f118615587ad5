"""Q8_0 linears (SmolLM2's LM head) served by the int8-activation kernel (`gemv_q8`),
against the `gguf` package's own dequantization of the same Q8_0 bytes, and the switch back
to two int4 planes on PyTorch's kernel."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

from pagemill.kernels import cpu_native, gemv_q8_cpu
from pagemill.runtime.model_executor.layers import Linear
from pagemill.runtime.model_executor.quantization import WeightScheme
from pagemill.runtime.model_executor.quantization.formats import dequantize
from pagemill.runtime.model_executor.quantization.gguf_blocks import decode_q8_0

pytestmark = pytest.mark.skipif(not gemv_q8_cpu.available(), reason="no C++ compiler")
Q8_0 = gguf.GGMLQuantizationType.Q8_0


@pytest.fixture(autouse=True)
def _int8_activations_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Linear, "int8_activations", 2)  # whatever the environment says


def _q8_0(n: int, k: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """(raw Q8_0 bytes, gguf's fp32 dequantization of them)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    raw = gguf.quants.quantize(w, Q8_0)
    dense = gguf.quants.dequantize(raw, Q8_0).astype(np.float32)
    return raw, torch.from_numpy(dense.reshape(n, k))


def _layer(raw: np.ndarray, n: int, k: int, dtype=torch.bfloat16, **scheme) -> Linear:
    layer = Linear(k, n, False, dtype)
    layer.scheme = WeightScheme("native", **scheme)
    # Two pieces, as a fused layer loads them: the tiles are cut across them.
    rows = n // 2 + 3
    layer.load_rows(0, decode_q8_0(raw[:rows], rows, k))
    layer.load_rows(rows, decode_q8_0(raw[rows:], n - rows, k))
    return layer


@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_q8_0_layer_against_gguf_dequantization(monkeypatch, dtype, planes) -> None:
    monkeypatch.setattr(Linear, "int8_activations", planes)
    n, k = 96, 320
    raw, w = _q8_0(n, k)
    layer = _layer(raw, n, k, dtype)
    assert layer.weight_format == "q8_0" and layer.int8_act == planes and layer.weight is None
    assert "int8 activations" in repr(layer)
    # GGUF's fp16 scales fit the tiles exactly: the weights are gguf's, bit for bit.
    assert layer.qweight is not None
    assert torch.equal(gemv_q8_cpu.dequantize_q8_blocks(layer.qweight, n), w)
    x = torch.randn(3, k, dtype=dtype)
    with torch.no_grad():
        got = layer(x).float()
    exact = x.float() @ w.T
    # Each x is off by at most half its block's step (/ 254 more with two planes).
    dx = x.float().view(3, k // 32, 32).abs().amax(-1) / 127
    bound = 0.5 * dx.repeat_interleave(32, 1) @ w.abs().T / (254 if planes == 2 else 1)
    slack = 0.01 if dtype == torch.bfloat16 else 1e-5  # bf16 output rounding
    assert ((got - exact).abs() <= bound * 1.001 + slack * exact.abs() + 1e-5).all()
    twin = gemv_q8_cpu.gemv_q8_torch(x, layer.qweight, n, planes).float()
    # Summation order only; in bf16 that can flip the output's last rounding: one ulp.
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, twin, rtol=ulp, atol=1e-5)


def test_switch_off_keeps_int4x2(monkeypatch) -> None:
    n, k = 48, 128
    raw, w = _q8_0(n, k, seed=1)
    monkeypatch.setattr(Linear, "int8_activations", 0)
    layer = _layer(raw, n, k)
    assert layer.weight_format == "int4x2" and not layer.int8_act
    # fp32 kernels are the exact check: never rounded activations.
    monkeypatch.setattr(Linear, "int8_activations", 2)
    exact = _layer(raw, n, k, torch.float32, kernel_dtype=torch.float32)
    assert exact.weight_format == "int4x2" and not exact.int8_act
    x = torch.randn(2, k)
    with torch.no_grad():
        torch.testing.assert_close(exact(x), x @ w.T, rtol=1e-5, atol=1e-5)


def test_without_the_kernel_int4x2_serves(monkeypatch) -> None:
    monkeypatch.setattr(gemv_q8_cpu, "available", lambda: False)
    raw, _ = _q8_0(32, 64)
    assert _layer(raw, 32, 64).weight_format == "int4x2"


def test_rows_with_zero_points_are_not_q8_0() -> None:
    """Q5_1-like int8 blocks (with zero points) keep the int4x2 form."""
    from pagemill.runtime.model_executor.quantization.formats import Int8Blocks

    n, k = 32, 64
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-16, 16, (n, k), generator=gen, dtype=torch.int8)
    d = (torch.rand(n, 2, generator=gen) * 0.01).half().float()
    layer = Linear(k, n, False, torch.bfloat16)
    layer.scheme = WeightScheme("native")
    layer.load_rows(0, Int8Blocks(q, d, 32, "Q5_1", zeros=d * 0.5))
    assert layer.weight_format == "int4x2"


def test_dense_copy_above_the_limit(monkeypatch) -> None:
    """With a dense fallback, both sides serve gguf's weights."""
    monkeypatch.setattr(Linear, "amx_packed", False)  # a dense copy even where AMX could serve
    n, k = 64, 192
    raw, w = _q8_0(n, k, seed=2)
    layer = _layer(raw, n, k, dense_fallback=True, packed_max_tokens=4)
    assert layer.int8_act and layer.has_dense_fallback and layer.packed_max_tokens == 4
    torch.testing.assert_close(layer.weight.float(), w, rtol=4e-3, atol=1e-6)  # bf16 of w
    x = torch.randn(8, k, dtype=torch.bfloat16)
    with torch.no_grad():
        packed = torch.cat([layer(x[:4]), layer(x[4:])]).float()
        dense = layer(x).float()
    torch.testing.assert_close(packed, dense, rtol=3e-2, atol=3e-2)


def test_crossover_times_the_native_kernel(monkeypatch) -> None:
    """The packed/dense crossover measures what a Q8_0 head serves with: `gemv_q8`."""
    from pagemill.runtime.model_executor.quantization.crossover import layer_kind, time_layers

    raw, _ = _q8_0(64, 128, seed=5)
    layer = _layer(raw, 64, 128, dense_fallback=True)
    calls: list[int] = []
    real = Linear._gemv_q8

    def counted(self, x):
        calls.append(x.shape[0])
        return real(self, x)

    monkeypatch.setattr(Linear, "_gemv_q8", counted)
    packed_s, dense_s = time_layers([layer], 2)
    assert packed_s > 0 and dense_s > 0 and calls and set(calls) == {2}
    assert layer_kind(layer).startswith("q8_0:64x128:g32")


# ---- large batches on the AMX-BF16 tiles from the packed tiles (`gemm_q8_amx`) ----------------

needs_amx = pytest.mark.skipif(
    not gemv_q8_cpu.gemm_amx_available() or not cpu_native.load_gemv_ops(),
    reason="no AMX-BF16 (or no C++ operators) here",
)


@needs_amx
@pytest.mark.parametrize("dense_fallback", [True, False])
def test_amx_serves_large_batches_without_a_dense_copy(monkeypatch, dense_fallback) -> None:
    n, k = 112, 576  # an odd number of tiles of 16 (the kernel pairs them)
    raw, w = _q8_0(n, k, seed=6)
    monkeypatch.setattr(Linear, "amx_packed", True)
    layer = _layer(raw, n, k, dense_fallback=dense_fallback, packed_max_tokens=4)
    assert layer.amx_large_rows and layer.weight is None and layer.has_dense_fallback
    assert "AMX above 4 rows" in repr(layer)
    calls: list[int] = []
    real = layer._amx
    monkeypatch.setattr(layer, "_amx", lambda t: calls.append(t.shape[0]) or real(t))
    x = torch.randn(37, k, dtype=torch.bfloat16)
    with torch.no_grad():
        got = layer(x)
        small = layer(x[:4])
    assert calls == [37] and got.dtype == torch.bfloat16 and got.shape == (37, n)
    # The dense bf16 product: gguf's weights rounded to bf16, fp32 sums.
    want = x.float() @ w.to(torch.bfloat16).float().T
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(small.float(), want[:4], rtol=3e-2, atol=3e-2)
    # A dense copy asked for, or the switch off: today's dense copy (or none).
    asked = _layer(raw, n, k, dense_fallback=True, keep_dense_copy=True)
    assert not asked.amx_large_rows and asked.weight is not None
    monkeypatch.setattr(Linear, "amx_packed", False)
    plain = _layer(raw, n, k, dense_fallback=dense_fallback)
    assert not plain.amx_large_rows and (plain.weight is not None) == dense_fallback


@needs_amx
def test_a_dense_weight_with_exact_scales_keeps_them(monkeypatch) -> None:
    # A shared weight made with the fp16 scales exact (as a dense copy from the tiles is):
    # the AMX side makes the same values.
    monkeypatch.setattr(Linear, "amx_packed", True)
    raw, w = _q8_0(64, 192, seed=13)
    layer = _layer(raw, 64, 192, dense_fallback=True, packed_max_tokens=4)
    layer.use_dense_weight(w.to(torch.bfloat16))
    assert layer.amx_large_rows and not layer.amx_bf16_scales
    x = torch.randn(9, 192, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), layer._onednn(x), rtol=1e-2, atol=1e-2)


def test_fp32_models_keep_their_exact_dense_copy(monkeypatch) -> None:
    monkeypatch.setattr(Linear, "amx_packed", True)
    raw, w = _q8_0(64, 192, seed=12)
    layer = _layer(raw, 64, 192, torch.float32, dense_fallback=True, packed_max_tokens=4)
    assert not layer.amx_large_rows and layer.weight is not None
    assert torch.equal(layer.weight, w)


def test_without_amx_the_layer_keeps_its_dense_copy(monkeypatch) -> None:
    monkeypatch.setattr(Linear, "amx_packed", True)
    monkeypatch.setattr(gemv_q8_cpu, "gemm_amx_available", lambda lib=None: False)
    raw, _ = _q8_0(64, 192, seed=8)
    layer = _layer(raw, 64, 192, dense_fallback=True, packed_max_tokens=4)
    assert not layer.amx_large_rows and layer.weight is not None
    assert "dense above 4 rows" in repr(layer)
    x = torch.randn(9, 192, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight))


def _tied_head(n: int, k: int, seed: int) -> tuple[Linear, torch.Tensor]:
    """A Q8_0 head sharing its bf16 embedding as the dense weight, as a tied model's is: the
    same rows dequantized to bf16 the way the loader makes the embedding (scales in bf16)."""
    raw, _ = _q8_0(n, k, seed=seed)
    head = _layer(raw, n, k, dense_fallback=True, packed_max_tokens=4)
    embedding = dequantize(decode_q8_0(raw, n, k), torch.bfloat16)
    head.use_dense_weight(embedding)
    return head, embedding


@needs_amx
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_tied_head_through_amx_agrees_with_the_embedding_path(monkeypatch, dtype) -> None:
    """A bf16 model's head; its hidden states in bf16, or fp32 (the kernel rounds them to bf16
    as oneDNN's input is)."""
    monkeypatch.setattr(Linear, "amx_packed", True)
    n, k = 3008, 576
    head, embedding = _tied_head(n, k, seed=9)
    assert head.amx_large_rows and head.weight is not None
    assert torch.equal(head.weight, embedding)
    # The tiles make the embedding's values exactly (scales rounded to bf16 as it was made).
    assert head.qweight is not None and head.amx_bf16_scales
    tiles = gemv_q8_cpu.gemm_q8_amx_weights(head.qweight, n, bf16_scales=True)
    assert torch.equal(tiles, embedding)
    assert not torch.equal(gemv_q8_cpu.gemm_q8_amx_weights(head.qweight, n), embedding)
    w32 = embedding.float()
    for rows in (5, 128, 257):
        hidden = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
        with torch.no_grad():
            amx = head(hidden)  # above the packed limit: gemm_q8_amx
            # Today's large-row head: oneDNN on the embedding (fp32 hidden states: its
            # products in fp32 too, so that its logits are not rounded to bf16's ties).
            if dtype == torch.bfloat16:
                dense = head._onednn(hidden)
            else:
                dense = torch.nn.functional.linear(hidden.to(torch.bfloat16).float(), w32)
        assert amx.dtype == dense.dtype == dtype and amx.shape == dense.shape == (rows, n)
        assert torch.equal(amx.argmax(-1), dense.argmax(-1))  # greedy picks the same token
        torch.testing.assert_close(amx.float(), dense.float(), rtol=1e-2, atol=1e-2)


@needs_amx
@pytest.mark.parametrize("onednn_faster", [False, True])
def test_crossover_picks_the_faster_large_side_of_a_tied_head(
    monkeypatch, tmp_path, caplog, onednn_faster
) -> None:
    """Packed, AMX and oneDNN are timed for a tied head; the large side that sums to less
    over the row counts above the crossover serves."""
    import logging

    from torch import nn

    from pagemill.runtime.model_executor.quantization import crossover

    monkeypatch.setattr(Linear, "amx_packed", True)
    monkeypatch.setenv(crossover.PACKED_LIMITS_ENV, "measure")
    head, _ = _tied_head(64, 128, seed=10)
    head.scheme = WeightScheme("native", dense_fallback=True, measure_packed_limit=True)
    model = nn.Module()
    model.logits_proj = head
    assert crossover.has_onednn_choice(head)
    assert crossover.layer_kind(head).endswith(":amx")
    # The real timer times three paths for it.
    assert len(crossover.time_layers([head], 2)) == 3

    def timer(layers, rows):  # packed wins up to 4 rows; oneDNN or AMX above
        packed = 1.0 if rows <= 4 else 10.0 * rows
        amx, onednn = (2.0 * rows, 1.0 * rows) if onednn_faster else (1.0 * rows, 2.0 * rows)
        return packed, amx, onednn

    with caplog.at_level(logging.INFO, logger=crossover.__name__):
        limits = crossover.measure_packed_limits(
            model, tmp_path / "limits.json", timer, rows=(1, 2, 4, 8), large_rows=(64, 128)
        )
    assert limits == {"lm_head": 4} and head.packed_max_tokens == 4
    assert head.amx_large_rows == (not onednn_faster)
    side = "oneDNN on the dense weight" if onednn_faster else "AMX"
    assert f"lm_head packed up to 4 rows, then {side}" in caplog.text
    # Kept, and read back at the next start the same way.
    saved = json.loads((tmp_path / "limits.json").read_text())
    (entry,) = saved.values()
    assert len(entry["onednn_ms"]) == len(entry["rows"]) == 6
    head.amx_large_rows = True
    head.packed_max_tokens = 0

    def untimed(layers, rows):
        raise AssertionError("measured again")

    crossover.measure_packed_limits(
        model, tmp_path / "limits.json", untimed, rows=(1, 2, 4, 8), large_rows=(64, 128)
    )
    assert head.packed_max_tokens == 4 and head.amx_large_rows == (not onednn_faster)
