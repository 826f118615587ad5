"""silu(gate) * up in the AMX-BF16 product's epilogue (`gemm_q4_amx_silu_mul`) against the
unfused computation: `gemm_q4_amx` (planes 0) then the activation with g and u rounded as the
product stores them (`silu_mul_reference`). Every row count a pass shape takes, odd tile
counts per half, fp32/bf16 x, strided x and out, thread counts, the C++ operator and its fake
kernel, the refusals and the fallback without AMX."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from pagemill.kernels import cpu_native
from pagemill.kernels import gemv_q4_cpu as g

pytestmark = pytest.mark.skipif(g.load() is None, reason="no C++ compiler for the kernel")
needs_amx = pytest.mark.skipif(not g.amx_available(), reason="no AMX-INT8/BF16 here")

ROWS = [*range(1, 41), 63, 64, 65, 255, 256, 257, 2049]


def _blocks(n: int, k: int, exact16: bool, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    d = torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3
    m = -8 * d * torch.rand(n, k // 32, generator=gen)
    if exact16:
        d, m = d.half().float(), m.half().float()
    else:
        d = d * (1 + 2**-20)  # off the fp16 grid: fp32 scales
    return g.pack_q4_blocks(q, d, m + 8 * d, 32)


def _x(m: int, k: int, dtype: torch.dtype, seed: int = 1, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _assert_within_one_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16: at most one bf16 step apart (the exp is the kernel's own); fp32: a few fp32
    steps (exp, division and product, each within about an ulp)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    a, b = got.float(), want.float()
    mag = torch.maximum(a.abs(), b.abs()).clamp_min(torch.finfo(torch.float32).tiny)
    step = torch.exp2(torch.floor(torch.log2(mag)) - (7 if got.dtype == torch.bfloat16 else 21))
    bad = (a - b).abs() > step
    assert not bad.any(), (a[bad][:8], b[bad][:8])


def _reference(x: torch.Tensor, blocks: torch.Tensor, n: int) -> torch.Tensor:
    return g.silu_mul_reference(g.gemm_q4_amx(x, blocks, n, planes=0))


@needs_amx
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    ("n", "k", "exact16"),
    # SmolLM2's gate | up; one tile per half; three (odd: the threads' halves of the pairs
    # split unevenly); five with fp32 scales over K in several chunks (K 1536: 48 blocks).
    [(3072, 576, True), (32, 64, True), (96, 96, True), (160, 1536, False)],
)
def test_fused_is_the_product_then_the_activation(dtype, n, k, exact16) -> None:
    blocks = _blocks(n, k, exact16, seed=n + k)
    rows = ROWS if n * k <= 160 * 1536 else [1, 16, 17, 33, 64, 65, 257]
    for m in rows:
        x = _x(m, k, dtype, seed=m)
        got = g.gemm_q4_amx_silu_mul(x, blocks, n)
        assert got.shape == (m, n // 2) and got.dtype == dtype
        _assert_within_one_ulp(got, _reference(x, blocks, n))


@needs_amx
def test_fused_at_many_rows_and_extreme_gates() -> None:
    # 2049 rows: x past the kernel's L2 budget, panels of pairs; large |x| drives the gate
    # to where exp(-g) overflows or vanishes (silu -> 0 and silu -> g).
    n, k = 96, 576
    blocks = _blocks(n, k, True, seed=7)
    for scale in (1.0, 40.0):
        x = _x(2049, k, torch.bfloat16, seed=3, scale=scale)
        got = g.gemm_q4_amx_silu_mul(x, blocks, n)
        want = _reference(x, blocks, n)
        _assert_within_one_ulp(got, want)
        assert torch.isfinite(got).all()


@needs_amx
def test_strided_x_and_out_threads_and_the_operator_give_the_same_bits() -> None:
    n, k = 96, 192
    blocks = _blocks(n, k, True, seed=2)
    for m in (5, 40, 257):
        wide = _x(m, k + 64, torch.bfloat16, seed=m)
        x = wide[:, 32 : 32 + k]  # row stride k + 64
        one = g.gemm_q4_amx_silu_mul(x, blocks, n, threads=1)
        assert torch.equal(one, g.gemm_q4_amx_silu_mul(x, blocks, n, threads=2))
        assert torch.equal(one, g.gemm_q4_amx_silu_mul(x.contiguous(), blocks, n, threads=3))
        buf = torch.full((m, n), -7.0, dtype=torch.bfloat16)
        out = buf[:, 16 : 16 + n // 2]  # row stride n
        assert g.gemm_q4_amx_silu_mul(x, blocks, n, out=out) is out
        assert torch.equal(out, one)
        assert (buf[:, :16] == -7).all() and (buf[:, 16 + n // 2 :] == -7).all()
        _assert_within_one_ulp(one, _reference(x, blocks, n))
        if cpu_native.load_gemv_ops():
            op = torch.ops.pagemill_native.gemm_q4_amx_silu_mul(x, blocks, n)
            assert torch.equal(op, one)


@needs_amx
def test_operator_refuses_and_its_fake_gives_the_shape() -> None:
    if not cpu_native.load_gemv_ops():
        pytest.skip("the C++ operators do not build here")
    n, k = 96, 64
    blocks = _blocks(n, k, True, seed=1)
    x = _x(9, k, torch.bfloat16)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.pagemill_native.gemm_q4_amx_silu_mul(x, blocks, 80)
    with pytest.raises(RuntimeError, match="do not give N"):
        torch.ops.pagemill_native.gemm_q4_amx_silu_mul(x, blocks, 128)
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        fb = mode.from_tensor(blocks)
        y = torch.ops.pagemill_native.gemm_q4_amx_silu_mul(fx, fb, n)
        assert y.shape == (9, n // 2) and y.dtype == torch.bfloat16


def test_refusals_and_the_fallback_without_amx(monkeypatch) -> None:
    n, k = 64, 96
    blocks = _blocks(n, k, True, seed=4)
    x = _x(20, k, torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 32"):
        g.gemm_q4_amx_silu_mul(x, blocks, 48)
    assert not g.silu_mul_fusable(48) and g.silu_mul_fusable(64)
    monkeypatch.setattr(g, "_amx_lib", lambda lib: None)  # as on a machine without AMX
    got = g.gemm_q4_amx_silu_mul(x, blocks, n)
    assert torch.equal(got, _reference(x, blocks, n))


def test_reference_rounds_once() -> None:
    # One rounding of silu(g) * u, not two (eager torch rounds silu(g) first): a case where
    # they differ shows which one the reference is.
    y = torch.randn(4096, 64).to(torch.bfloat16)
    g_, u = y[:, :32].float(), y[:, 32:].float()
    once = (g_ * torch.sigmoid(g_) * u).to(torch.bfloat16)
    got = g.silu_mul_reference(y)
    _assert_within_one_ulp(got, once)
    twice = torch.nn.functional.silu(y[:, :32]) * y[:, 32:]
    assert not torch.equal(got, twice)
