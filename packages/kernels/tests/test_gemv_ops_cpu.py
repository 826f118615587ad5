"""The GEMV kernels as C++ torch operators (`torch.ops.pagemill_native.gemv_q4` / `gemv_q8`)
against their ctypes entry points (the same kernel: the same bits) and the torch arithmetic
(`gemv_q4_torch` / `gemv_q8_torch`, the oracle), their refusals, a compiled graph holding
them, and the switch that keeps the Python custom ops."""

from __future__ import annotations

import pytest
import torch

from pagemill.kernels import cpu_native, native_build
from pagemill.kernels import gemv_q4_cpu as g4
from pagemill.kernels import gemv_q8_cpu as g8

pytestmark = pytest.mark.skipif(
    not cpu_native.load_gemv_ops(), reason="no C++ compiler or torch headers for the operators"
)


def _q4_tiles(n: int, k: int, fp16: bool, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    s = torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3
    m = torch.randn(n, k // 32, generator=gen) * 0.01
    if fp16:  # GGUF-like: fp16 holds d and m exactly (320-byte blocks; else fp32, 384)
        s, m = s.half().float(), m.half().float()
    tiles = g4.pack_q4_blocks(q, s, m + 8 * s, 32)
    assert tiles.shape[2] == (320 if fp16 else 384)
    return tiles


def _q8_tiles(n: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    d = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3).half().float()
    return g8.pack_q8_blocks(q, d)


@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 9, 40])
def test_q4_operator_is_the_kernel(planes: int, dtype: torch.dtype, m: int) -> None:
    for fp16, n, k in ((True, 40, 96), (False, 17, 64)):
        tiles = _q4_tiles(n, k, fp16, seed=m)
        x = torch.randn(m, k, dtype=dtype)
        y = torch.ops.pagemill_native.gemv_q4(x, tiles, n, planes)
        assert y.dtype == dtype and y.shape == (m, n)
        assert torch.equal(y, g4.gemv_q4(x, tiles, n, planes=planes))
        ref = g4.gemv_q4_torch(x.float(), tiles, n, planes=planes)
        torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 33])
def test_q8_operator_is_the_kernel(planes: int, dtype: torch.dtype, m: int) -> None:
    tiles = _q8_tiles(50, 128, seed=m)
    x = torch.randn(m, 128, dtype=dtype)
    y = torch.ops.pagemill_native.gemv_q8(x, tiles, 50, planes)
    assert y.dtype == dtype and y.shape == (m, 50)
    assert torch.equal(y, g8.gemv_q8(x, tiles, 50, planes=planes))
    ref = g8.gemv_q8_torch(x.float(), tiles, 50, planes=planes)
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-3)


def test_strided_rows_and_refusals() -> None:
    tiles = _q4_tiles(32, 64, True)
    x = torch.randn(3, 128)[:, :64]  # rows 128 apart
    assert torch.equal(
        torch.ops.pagemill_native.gemv_q4(x, tiles, 32),
        torch.ops.pagemill_native.gemv_q4(x.contiguous(), tiles, 32),
    )
    x = torch.randn(4, 64).t().contiguous().t()  # columns not contiguous: copied first
    assert torch.equal(
        torch.ops.pagemill_native.gemv_q4(x, tiles, 32), g4.gemv_q4(x.contiguous(), tiles, 32)
    )
    bad = [
        lambda: torch.ops.pagemill_native.gemv_q4(torch.randn(2, 96), tiles, 32),  # K
        lambda: torch.ops.pagemill_native.gemv_q4(torch.randn(2, 64).half(), tiles, 32),
        lambda: torch.ops.pagemill_native.gemv_q4(torch.randn(2, 64), tiles, 33),  # N
        lambda: torch.ops.pagemill_native.gemv_q4(torch.randn(2, 64), tiles, 32, 3),
        lambda: torch.ops.pagemill_native.gemv_q8(torch.randn(2, 64), tiles, 32),  # q4 tiles
        lambda: torch.ops.pagemill_native.gemv_q4(torch.randn(64), tiles, 32),
    ]
    for call in bad:
        with pytest.raises(RuntimeError):
            call()


def test_operators_in_a_compiled_graph() -> None:
    t4, t8 = _q4_tiles(48, 96, True), _q8_tiles(24, 96)

    def f(x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.pagemill_native.gemv_q4(x * 2, t4, 48) + torch.ops.pagemill_native.gemv_q4(
            x, t4, 48, 1
        )
        return torch.relu(y[:, :24]) + torch.ops.pagemill_native.gemv_q8(x, t8, 24)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    x = torch.randn(3, 96)
    torch.testing.assert_close(compiled(x), f(x))
    torch._dynamo.reset()


def test_switch_keeps_the_python_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_native, "_gemv_ops_loaded", False)
    monkeypatch.setattr(cpu_native, "_torch_ops_loaded", None)
    monkeypatch.setenv(cpu_native.GEMV_OPS_ENV, "0")
    assert cpu_native.load_gemv_ops.__wrapped__() is False
    monkeypatch.setenv(cpu_native.GEMV_OPS_ENV, "1")
    monkeypatch.setattr(native_build, "compiler", lambda: None)
    assert cpu_native.load_gemv_ops.__wrapped__() is False
