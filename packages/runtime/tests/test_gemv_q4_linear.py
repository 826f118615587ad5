"""Int4 linears served by the int8-activation kernel (`gemv_q4`), against the `gguf`
package's own dequantization of the same Q4_1 bytes, and the switch back to PyTorch's."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagemill.kernels import gemv_q4_cpu
from pagemill.runtime.model_executor.layers import Linear
from pagemill.runtime.model_executor.quantization import WeightScheme
from pagemill.runtime.model_executor.quantization.gguf_blocks import decode_q4_1

pytestmark = pytest.mark.skipif(not gemv_q4_cpu.available(), reason="no C++ compiler")


@pytest.fixture(autouse=True)
def _int8_activations_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Linear, "int8_activations", 2)  # whatever the environment says


def test_two_planes_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagemill.runtime.model_executor.layers import linear

    monkeypatch.delenv("PAGEMILL_CPU_INT8_ACTIVATIONS", raising=False)
    assert linear._int8_activation_planes() == 2
    monkeypatch.setenv("PAGEMILL_CPU_INT8_ACTIVATIONS", "0")
    assert linear._int8_activation_planes() == 0
    monkeypatch.setenv("PAGEMILL_CPU_INT8_ACTIVATIONS", "3")
    with pytest.raises(ValueError, match="PAGEMILL_CPU_INT8_ACTIVATIONS"):
        linear._int8_activation_planes()


def _q4_1(n: int, k: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """(raw Q4_1 bytes, gguf's fp32 dequantization of them)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    dense = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1).astype(np.float32)
    return raw, torch.from_numpy(dense.reshape(n, k))


def _layer(raw: np.ndarray, n: int, k: int, dtype=torch.bfloat16, **scheme) -> Linear:
    layer = Linear(k, n, True, dtype)
    layer.scheme = WeightScheme("native", **scheme)
    with torch.no_grad():
        layer.bias.copy_(torch.linspace(-1, 1, n))
    layer.load_rows(0, decode_q4_1(raw, n, k))
    return layer


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What int8 activations may cost: every x is off by at most half its block's step, so
    |x·wᵀ - xq·wᵀ| <= sum_j |w_j| * dx_j / 2 (the kernel's min term is exact: tighter)."""
    _, dx, _ = gemv_q4_cpu.quantize_activations(x)
    return 0.5 * dx.repeat_interleave(32, 1) @ w.abs().T


@pytest.mark.parametrize("rows", [3, 300])  # a decode step, a large batch (a GEMM)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_q4_1_layer_against_gguf_dequantization(dtype, rows) -> None:
    n, k = 96, 320
    raw, w = _q4_1(n, k)
    layer = _layer(raw, n, k, dtype)
    assert layer.int8_act and layer.scales_and_zeros is None and layer.weight is None
    assert "int8 activations" in repr(layer) and layer.weight_format == "int4"
    # GGUF's fp16 d and m fit the 20-bytes-per-32 tiles exactly: the weights are gguf's.
    assert layer.qweight is not None and layer.qweight.shape[-1] == 320
    assert torch.equal(gemv_q4_cpu.dequantize_q4_blocks(layer.qweight, n), w)
    x = torch.randn(rows, k, dtype=dtype)
    with torch.no_grad():
        got = layer(x).float()
    exact = x.float() @ w.T + layer.bias.float()
    slack = 0.02 if dtype == torch.bfloat16 else 1e-4  # bf16 output rounding
    assert ((got - exact).abs() <= _bound(x.float(), w) + slack * exact.abs() + 1e-4).all()


def test_switch_off_keeps_pytorch_int4(monkeypatch) -> None:
    n, k = 48, 128
    raw, w = _q4_1(n, k, seed=1)
    monkeypatch.setattr(Linear, "int8_activations", False)
    layer = _layer(raw, n, k)
    assert not layer.int8_act and layer.scales_and_zeros is not None
    monkeypatch.setattr(Linear, "int8_activations", True)
    assert _layer(raw, n, k).int8_act
    # fp32 kernels are the exact check: never rounded activations.
    exact = _layer(raw, n, k, torch.float32, kernel_dtype=torch.float32)
    assert not exact.int8_act
    x = torch.randn(2, k)
    with torch.no_grad():
        torch.testing.assert_close(exact(x), x @ w.T + exact.bias, rtol=1e-5, atol=1e-5)


def test_without_the_kernel_pytorch_int4_serves(monkeypatch) -> None:
    monkeypatch.setattr(gemv_q4_cpu, "available", lambda: False)
    raw, _ = _q4_1(32, 64)
    layer = _layer(raw, 32, 64)
    assert not layer.int8_act and layer.scales_and_zeros is not None


def test_dense_copy_holds_the_exact_weights(monkeypatch) -> None:
    """With a dense fallback, both sides serve gguf's weights (scales unrounded)."""
    monkeypatch.setattr(Linear, "amx_packed", False)  # a dense copy even where AMX could serve
    n, k = 64, 192
    raw, w = _q4_1(n, k, seed=2)
    layer = _layer(raw, n, k, dense_fallback=True, packed_max_tokens=4)
    assert not layer.amx_large_rows
    assert layer.int8_act and layer.has_dense_fallback
    torch.testing.assert_close(layer.weight.float(), w, rtol=4e-3, atol=1e-6)  # bf16 of w
    x = torch.randn(8, k, dtype=torch.bfloat16)
    with torch.no_grad():
        packed = torch.cat([layer(x[:4]), layer(x[4:])]).float()
        dense = layer(x).float()
    torch.testing.assert_close(packed, dense, rtol=3e-2, atol=3e-2)


def test_amx_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagemill.runtime.model_executor.layers import linear

    monkeypatch.delenv("PAGEMILL_CPU_AMX_PACKED", raising=False)
    assert linear._amx_packed_switch() is True
    monkeypatch.setenv("PAGEMILL_CPU_AMX_PACKED", "0")
    assert linear._amx_packed_switch() is False
    monkeypatch.setenv("PAGEMILL_CPU_AMX_PACKED", "yes")
    with pytest.raises(ValueError, match="PAGEMILL_CPU_AMX_PACKED"):
        linear._amx_packed_switch()


def test_gemv_amx_switch_refuses_what_the_kernels_would_misread(monkeypatch) -> None:
    """The C++ kernels read PAGEMILL_CPU_GEMV_AMX themselves and would take "yes" as 0
    (never): it is refused at start instead."""
    from pagemill.runtime.model_executor.layers import linear

    for ok in ("", "0", "1", "auto", "12"):
        monkeypatch.setenv("PAGEMILL_CPU_GEMV_AMX", ok)
        linear._check_gemv_amx_switch()
    for bad in ("yes", "-3", "1.5"):
        monkeypatch.setenv("PAGEMILL_CPU_GEMV_AMX", bad)
        with pytest.raises(ValueError, match="PAGEMILL_CPU_GEMV_AMX"):
            linear._check_gemv_amx_switch()


@pytest.mark.skipif(not gemv_q4_cpu.amx_available(), reason="no AMX here")
@pytest.mark.parametrize("dense_fallback", [True, False])
def test_amx_serves_large_batches_without_a_dense_copy(monkeypatch, dense_fallback) -> None:
    """Where the CPU has AMX, rows above the limit run on the matrix units from the packed
    blocks: no dense copy is kept (even where copies were asked for), and the large side
    is the bf16 product of the same weights the copy would hold."""
    monkeypatch.setattr(Linear, "amx_packed", True)
    n, k = 64, 192
    raw, w = _q4_1(n, k, seed=5)
    layer = _layer(raw, n, k, dense_fallback=dense_fallback, packed_max_tokens=4)
    assert layer.amx_large_rows and layer.weight is None and layer.has_dense_fallback
    assert "AMX above 4 rows" in repr(layer)
    x = torch.randn(40, k, dtype=torch.bfloat16)
    calls = []
    real = layer._amx
    monkeypatch.setattr(layer, "_amx", lambda t: calls.append(t.shape[0]) or real(t))
    with torch.no_grad():
        big = layer(x).float()
        small = layer(x[:4]).float()
    assert calls == [40]  # the packed GEMV took the 4 rows
    expected = x.float() @ w.to(torch.bfloat16).float().T + layer.bias.float()
    torch.testing.assert_close(big, expected, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(small, big[:4], rtol=3e-2, atol=3e-2)
    # A copy asked for (`--cpu-dense-weights always`) is kept.
    if dense_fallback:
        asked = _layer(raw, n, k, dense_fallback=True, keep_dense_copy=True, packed_max_tokens=4)
        assert not asked.amx_large_rows and asked.weight is not None
    # Without the switch the same layer keeps its copy (or stays packed).
    monkeypatch.setattr(Linear, "amx_packed", False)
    plain = _layer(raw, n, k, dense_fallback=dense_fallback, packed_max_tokens=4)
    assert not plain.amx_large_rows and (plain.weight is not None) == dense_fallback


def test_q4_k_like_scales_use_fp32_tiles() -> None:
    """Scales fp16 cannot hold (Q4_K's d * sc) keep fp32 in the tiles: still exact."""
    from pagemill.runtime.model_executor.quantization.formats import Int4Groups

    n, k = 32, 64
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    d = torch.rand(n, 2, generator=gen) * 0.01 * (1 + 2**-18)
    z = torch.randn(n, 2, generator=gen) * 0.01
    layer = Linear(k, n, False, torch.bfloat16)
    layer.scheme = WeightScheme("native")
    layer.load_rows(0, Int4Groups(q, d, z, 32, "Q4_K"))
    assert layer.int8_act and layer.qweight is not None and layer.qweight.shape[-1] == 384
    w = Int4Groups(q, d, z, 32).dequantize(torch.float32)
    torch.testing.assert_close(
        gemv_q4_cpu.dequantize_q4_blocks(layer.qweight, n), w, rtol=1e-6, atol=1e-8
    )


def test_native_operators_serve_and_survive_a_restore(monkeypatch) -> None:
    """Where the C++ operators load, the layer calls them, eager and compiled, with the same
    bits as the Python custom op over ctypes; a layer restored attribute by attribute (as the
    weight cache does) loads them too, and under PAGEMILL_NATIVE_GEMV_OPS=0 never uses them."""
    from pagemill.kernels import cpu_native

    if not cpu_native.load_gemv_ops():
        pytest.skip("the operators cannot be built here")
    n, k = 48, 96
    raw, _ = _q4_1(n, k, seed=7)
    layer = _layer(raw, n, k)
    layer.finalize()
    assert layer.int8_act and layer.native_gemv
    x = torch.randn(3, k, dtype=torch.bfloat16)
    with torch.no_grad():
        native = layer(x)
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True)(x)
        torch._dynamo.reset()
        layer.native_gemv = False
        python_op = layer(x)
    assert torch.equal(native, python_op) and torch.equal(compiled, native)

    restored = Linear(k, n, True, torch.bfloat16)
    object.__setattr__(restored, "native_gemv", True)
    assert restored.native_gemv and vars(restored)["native_gemv"] is True
    monkeypatch.setattr(cpu_native, "_gemv_ops_loaded", False)
    monkeypatch.setenv(cpu_native.GEMV_OPS_ENV, "0")
    cpu_native.load_gemv_ops.cache_clear()
    try:
        object.__setattr__(restored, "native_gemv", True)
        assert not restored.native_gemv
    finally:
        cpu_native.load_gemv_ops.cache_clear()


@pytest.mark.skipif(not gemv_q4_cpu.amx_available(), reason="no AMX here")
def test_gate_up_layer_applies_silu_in_the_amx_product(monkeypatch) -> None:
    """Above its packed limit an AMX gate | up layer returns silu(gate) * up from one kernel
    (`gemm_q4_amx_silu_mul`), within a bf16 step of the unfused product and activation,
    eager and compiled; below the limit, with a bias, an adapter, another activation or
    halves that are not whole tiles it is the unfused computation, to the bit."""
    from pagemill.kernels import cpu_native, gelu_tanh_and_mul, silu_and_mul

    if not cpu_native.load_gemv_ops():
        pytest.skip("the operators cannot be built here")
    monkeypatch.setattr(Linear, "amx_packed", True)
    k = 192

    def gate_up(n: int, bias: bool = False) -> Linear:
        raw, _ = _q4_1(n, k, seed=n)
        layer = Linear(k, n, bias, torch.bfloat16)
        layer.scheme = WeightScheme("native", packed_max_tokens=4)
        layer.load_rows(0, decode_q4_1(raw, n, k))
        if bias:
            with torch.no_grad():
                layer.bias.copy_(torch.linspace(-1, 1, n))
        assert layer.amx_large_rows
        return layer

    layer = gate_up(96)
    calls: list[int] = []
    real = layer._amx_silu_mul
    monkeypatch.setattr(layer, "_amx_silu_mul", lambda t: calls.append(t.shape[0]) or real(t))
    x = torch.randn(40, k, dtype=torch.bfloat16)
    with torch.no_grad():
        fused = layer.act_and_mul_forward(x, "silu")
        product = layer(x)
        small = layer.act_and_mul_forward(x[:4], "silu")
        small_product = layer(x[:4])
        gelu = layer.act_and_mul_forward(x, "gelu_tanh")
    assert calls == [40] and fused.shape == (40, 48)
    # One rounding of the fp32 activation against the product's bf16 g and u; eager torch
    # rounds silu(g) once more: a bf16 step apart at most either way.
    ref = gemv_q4_cpu.silu_mul_reference(product)
    for want in (ref, silu_and_mul(product)):
        step = torch.exp2(torch.floor(torch.log2(want.float().abs().clamp_min(1e-30))) - 7)
        assert ((fused.float() - want.float()).abs() <= step).all()
    assert torch.equal(small, silu_and_mul(small_product))  # the packed GEMV's rows
    assert torch.equal(gelu, gelu_tanh_and_mul(product))
    assert calls == [40]

    torch._dynamo.reset()
    try:
        fn = torch.compile(lambda t: layer.act_and_mul_forward(t, "silu"), fullgraph=True)
        with torch.no_grad():
            assert torch.equal(fn(x), fused)
            compiled_small = fn(x[:4])
    finally:
        torch._dynamo.reset()
    assert calls == [40, 40]  # the graph's 40 rows took the fused kernel, its 4 rows did not
    step = torch.exp2(torch.floor(torch.log2(small.float().abs().clamp_min(1e-30))) - 7)
    assert ((compiled_small.float() - small.float()).abs() <= step).all()

    class Adapter:
        def apply(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return y + 1

    layer.lora = Adapter()  # type: ignore[assignment]
    with torch.no_grad():
        assert torch.equal(layer.act_and_mul_forward(x, "silu"), silu_and_mul(product + 1))
    layer.lora = None
    biased, odd = gate_up(96, bias=True), gate_up(80)  # 80: halves of 40 rows, not tiles
    with torch.no_grad():
        for other in (biased, odd):
            assert torch.equal(other.act_and_mul_forward(x, "silu"), silu_and_mul(other(x)))
    assert calls == [40, 40]
