"""The int4 product on the AMX tiles: AMX-INT8 (planes 1, 2) against the AVX-512 GEMV and
the torch arithmetic, AMX-BF16 (planes 0) against the dense bf16 product, odd shapes, fp16
and fp32 scales, every row count a decode step has, thread counts, `gemv_q4`'s switch to the
tiles, the C++ operator, and the fallbacks where AMX is absent. The tests that need the
tiles skip without them; the fallback tests run everywhere."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from pagemill.kernels import cpu_native
from pagemill.kernels import gemv_q4_cpu as g

pytestmark = pytest.mark.skipif(g.load() is None, reason="no C++ compiler for the kernel")
needs_amx = pytest.mark.skipif(not g.amx_available(), reason="no AMX-INT8/BF16 here")

# M not a multiple of 16 (nor of 32, the bf16 kernel's row block), N a multiple of 16 with
# an odd number of tiles (the bf16 kernel pairs them), K a multiple of 32.
SHAPES = [(1, 16, 32), (5, 48, 96), (17, 80, 64), (33, 32, 576), (47, 112, 160), (64, 16, 1536)]


def _blocks(n: int, k: int, exact16: bool, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    d = torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3
    m = -8 * d * torch.rand(n, k // 32, generator=gen)
    if exact16:
        d, m = d.half().float(), m.half().float()
    else:
        d = d * (1 + 2**-20)  # off the fp16 grid: fp32 scales
    blocks = g.pack_q4_blocks(q, d, m + 8 * d, 32)
    assert blocks.shape[2] == (320 if exact16 else 384)
    return blocks


def _x(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture
def gemv_only() -> Iterator[None]:
    """`gemv_q4` on the AVX-512 GEMV at every row count (it moves to the tiles by itself)."""
    prev = g.set_amx_rows(0)
    yield
    g.set_amx_rows(prev)


@needs_amx
@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("exact16", [True, False], ids=["fp16", "fp32"])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_int8_tiles_are_the_gemv(planes, dtype, exact16, m, n, k, gemv_only) -> None:
    blocks = _blocks(n, k, exact16, seed=m + n)
    x = _x(m, k, dtype)
    got = g.gemm_q4_amx(x, blocks, n, planes=planes)
    assert got.dtype == dtype and got.shape == (m, n)
    # The same integers and the same float steps in the same order as the AVX-512 GEMV.
    assert torch.equal(got, g.gemv_q4(x, blocks, n, planes=planes))
    # And the arithmetic itself, written in torch (summation order aside).
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(got, g.gemv_q4_torch(x, blocks, n, planes), **tol)


@needs_amx
@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("exact16", [True, False], ids=["fp16", "fp32"])
def test_int8_tiles_are_the_gemv_at_every_decode_batch(planes, dtype, exact16, gemv_only) -> None:
    # Each row count takes its own pass shape: 1..16 rows in one pass (two planes: up to 8
    # in one A tile), more in passes of 16 and a remainder.
    for n, k in ((48, 96), (80, 1536)):
        blocks = _blocks(n, k, exact16, seed=n)
        for m in [*range(1, 21), 31, 32, 33, 47, 63, 64]:
            x = _x(m, k, dtype, seed=m)
            got = g.gemm_q4_amx(x, blocks, n, planes=planes)
            assert torch.equal(got, g.gemv_q4(x, blocks, n, planes=planes)), (n, k, m)


@needs_amx
def test_gemv_switches_to_the_tiles_by_itself(gemv_only) -> None:
    blocks = _blocks(80, 576, True, seed=11)
    x = _x(16, 576, torch.bfloat16)
    assert g.amx_rows(1) == 0 and g.amx_rows(2) == 0
    want = {p: g.gemv_q4(x, blocks, 80, planes=p) for p in (1, 2)}
    assert g.set_amx_rows(None) == 0  # the machine's default, by planes
    assert g.amx_rows(1) >= g.amx_rows(2) > 0
    assert g.set_amx_rows(3) is None
    assert g.amx_rows(1) == g.amx_rows(2) == 3
    for p in (1, 2):  # the same bits either way
        assert torch.equal(g.gemv_q4(x, blocks, 80, planes=p), want[p])
        assert torch.equal(g.gemv_q4(x[:2], blocks, 80, planes=p), want[p][:2])
    # The environment sets it for a process (and for the C++ operator's library).
    code = "from pagemill.kernels import gemv_q4_cpu as g; print(g.amx_rows(1), g.amx_rows(2))"
    for env, want_rows in (("0", "0 0"), ("5", "5 5")):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PAGEMILL_CPU_GEMV_AMX": env},
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout.split() == want_rows.split()


@needs_amx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("exact16", [True, False], ids=["fp16", "fp32"])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_bf16_tiles_are_the_dense_product(dtype, exact16, m, n, k) -> None:
    blocks = _blocks(n, k, exact16, seed=m + n)
    x = _x(m, k, dtype)
    got = g.gemm_q4_amx(x, blocks, n, planes=0)
    assert got.dtype == dtype and got.shape == (m, n)
    w = g.dequantize_q4_blocks(blocks, n).to(torch.bfloat16).double()
    xb = x.to(torch.bfloat16).double()
    want = xb @ w.T
    # fp32 sums of exact bf16 products: off by the summation order only, far below one
    # product's size; a wrong weight or scale anywhere moves a sum by about one product.
    bound = 1e-5 * (xb.abs() @ w.abs().T) + 1e-6
    if dtype == torch.bfloat16:
        bound = bound + want.abs() * 2**-8  # the output's own rounding
    err = (got.double() - want).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


@needs_amx
def test_thread_counts_and_strided_rows_give_the_same_bits() -> None:
    blocks = _blocks(80, 576, True, seed=3)
    wide = _x(40, 2 * 576, torch.bfloat16)
    x = wide[:, :576]  # row stride 1152
    for planes in (0, 1, 2):
        one = g.gemm_q4_amx(x, blocks, 80, threads=1, planes=planes)
        assert torch.equal(one, g.gemm_q4_amx(x.contiguous(), blocks, 80, planes=planes))
        assert torch.equal(one, g.gemm_q4_amx(x, blocks, 80, threads=3, planes=planes))


@needs_amx
def test_operator_is_the_kernel() -> None:
    if not cpu_native.load_gemv_ops():
        pytest.skip("the C++ operators did not build here")
    blocks = _blocks(48, 96, True, seed=5)
    x = _x(21, 96, torch.bfloat16)
    for planes in (0, 1, 2):
        want = g.gemm_q4_amx(x, blocks, 48, planes=planes)
        assert torch.equal(torch.ops.pagemill_native.gemm_q4_amx(x, blocks, 48, planes), want)
        assert torch.equal(torch.ops.pagemill.gemm_q4_amx(x, blocks, 48, planes), want)
        if planes:  # its gemv_q4 runs on the tiles above the switch's row count: same bits
            assert torch.equal(torch.ops.pagemill_native.gemv_q4(x, blocks, 48, planes), want)
    assert torch.equal(
        torch.ops.pagemill_native.gemm_q4_amx(x, blocks, 48), g.gemm_q4_amx(x, blocks, 48)
    )
    with pytest.raises(RuntimeError, match="planes"):
        torch.ops.pagemill_native.gemm_q4_amx(x, blocks, 48, 3)


def test_without_amx_it_is_the_gemv_or_the_dense_product() -> None:
    plain = g.load(0)  # built without AMX: its entry point refuses (status 4)
    assert plain is not None and not g.amx_available(plain)
    assert g.amx_rows(2, plain) == 0  # and its gemv_q4 stays the GEMV
    blocks = _blocks(48, 96, True, seed=7)
    x = _x(9, 96, torch.bfloat16)
    for planes in (1, 2):
        got = g.gemm_q4_amx(x, blocks, 48, lib=plain, planes=planes)
        assert torch.equal(got, g.gemv_q4(x, blocks, 48, plain, planes=planes))
    w = g.dequantize_q4_blocks(blocks, 48).to(torch.bfloat16)
    got = g.gemm_q4_amx(x, blocks, 48, lib=plain, planes=0)
    assert torch.equal(got, torch.nn.functional.linear(x, w))
    with pytest.raises(ValueError, match="planes"):
        g.gemm_q4_amx(x, blocks, 48, lib=plain, planes=3)
    with pytest.raises(ValueError):
        g.gemm_q4_amx(x[:, :64], blocks, 48, lib=plain, planes=0)


# ---- AMX-BF16's blocking: rows in blocks of 32 (a last 1..16 in one A tile), K in chunks
# (576: two, 1536: three), output pairs per thread in panels unpacked ahead into a ring of two.


def _assert_dense(got: torch.Tensor, x: torch.Tensor, blocks: torch.Tensor, n: int) -> None:
    """`got` is x's dense bf16 product with the weights (see the test above), each weight
    d * q + m rounded once to fp32 (the kernel's fused multiply-add; `dequantize_q4_blocks`
    rounds the product, then the sum, which now and then lands on the other side of a bf16
    rounding boundary with fp32 scales)."""
    q, d, m = g.unpack_q4_blocks(blocks, n)
    nb = d.shape[1]
    w = q.view(n, nb, 32).double() * d.double()[..., None] + m.double()[..., None]
    w = w.reshape(n, nb * 32).float().to(torch.bfloat16).double()
    xb = x.to(torch.bfloat16).double()
    want = xb @ w.T
    bound = 1e-5 * (xb.abs() @ w.abs().T) + 1e-6
    if got.dtype == torch.bfloat16:
        bound = bound + want.abs() * 2**-8
    err = (got.double() - want).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


@needs_amx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("exact16", [True, False], ids=["fp16", "fp32"])
@pytest.mark.parametrize(("n", "k"), [(80, 576), (112, 1536), (48, 96)])
def test_bf16_tiles_at_every_row_count(dtype, exact16, n, k) -> None:
    # N = 80 / 48: an odd tile count (the last pair half empty); K 576 and 1536: two and three
    # chunks of K; 96: one.
    blocks = _blocks(n, k, exact16, seed=n + k)
    for m in [*range(1, 41), 63, 64, 65, 97, 255, 257]:
        x = _x(m, k, dtype, seed=m)
        got = g.gemm_q4_amx(x, blocks, n, planes=0)
        assert got.shape == (m, n) and got.dtype == dtype
        _assert_dense(got, x, blocks, n)


@needs_amx
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("m", "n", "k"), [(353, 720, 1536), (929, 944, 576), (2049, 80, 576), (257, 720, 1536)]
)
def test_bf16_tiles_over_many_panels(threads, m, n, k) -> None:
    # x past 1 MB in bf16 and enough output pairs per thread for several panels (K 1536: five
    # pairs a panel, 576: fourteen), the next one unpacked into the ring while the last is in
    # use; below 1 MB (257 rows) a pair at a time, the next one unpacked beside it. N not a
    # multiple of 32 (720: 22.5 pairs, 944: 29.5); row counts one past a multiple of 32.
    blocks = _blocks(n, k, True, seed=m)
    x = _x(m, k, torch.bfloat16, seed=n)
    got = g.gemm_q4_amx(x, blocks, n, threads=threads, planes=0)
    _assert_dense(got, x, blocks, n)
    if threads == 2:  # each output's sum in the same order whichever thread makes it
        assert torch.equal(got, g.gemm_q4_amx(x, blocks, n, threads=1, planes=0))


@needs_amx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", [7, 40, 200])
def test_bf16_tiles_with_strided_x_and_y(dtype, m) -> None:
    # The entry point itself, y rows wider than n: the gaps between them stay as they were.
    n, k, pad = 80, 1536, 24
    blocks = _blocks(n, k, False, seed=m)
    x = _x(m, 2 * k, dtype, seed=m)[:, k:]  # row stride 2k, not at the buffer's start
    want = g.gemm_q4_amx(x.contiguous(), blocks, n, planes=0)
    y = torch.full((m, n + pad), float("nan"), dtype=dtype)
    lib = g._amx_lib(None)
    assert lib is not None
    for threads in (1, 2):
        status = lib.pagemill_gemm_q4_amx(
            1 if dtype == torch.bfloat16 else 0,
            x.data_ptr(),
            x.stride(0),
            blocks.data_ptr(),
            4,
            y.data_ptr(),
            n + pad,
            m,
            n,
            k,
            threads,
            0,
        )
        assert status == 0
        assert torch.equal(y[:, :n], want)
        assert bool(y[:, n:].isnan().all())
