"""The Q8_0 product on the AMX-BF16 tiles (`gemm_q8_amx`): against the dense bf16 product
with each weight bf16(d * q) (what a tied head's bf16 embedding holds) and fp32 sums, at
every row count a step has, odd output counts, fp32 and bf16 x, strided x and y, one and
two threads, many panels, the C++ operator, and the refusal where AMX-BF16 is absent. The
tests that need the tiles skip without them; the refusal test runs everywhere."""

from __future__ import annotations

import pytest
import torch

from pagemill.kernels import cpu_native
from pagemill.kernels import gemv_q8_cpu as g

pytestmark = pytest.mark.skipif(g.load() is None, reason="no C++ compiler for the kernel")
needs_amx = pytest.mark.skipif(not g.gemm_amx_available(), reason="no AMX-BF16 here")

# N with an odd tile count (the kernel pairs tiles) and not a multiple of 16 (the packing
# pads the last tile), K one chunk of up to 48 blocks, and two (3072: the sums leave the tiles
# between chunks).
SHAPES = [
    (1, 16, 32),
    (5, 37, 96),
    (17, 80, 64),
    (33, 100, 576),
    (47, 112, 160),
    (64, 16, 1536),
    (40, 48, 3072),
]


def _blocks(n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    # Scales over several binades, so that d * q lands on every bf16 rounding case.
    d = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-4).half().float()
    return g.pack_q8_blocks(q, d)


def _x(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _reference_weights(blocks: torch.Tensor, n: int, bf16_scales: bool = False) -> torch.Tensor:
    """bf16(d * q), the kernel's weights (d first rounded to bf16 with `bf16_scales`), built
    in doubles: the product is exact (8-bit integer, 11-bit scale), then rounded once."""
    q, d = g.unpack_q8_blocks(blocks, n)
    if bf16_scales:
        d = d.to(torch.bfloat16)
    nb = d.shape[1]
    w = q.view(n, nb, 32).double() * d.double()[..., None]
    return w.reshape(n, nb * 32).float().to(torch.bfloat16)


def _assert_dense(
    got: torch.Tensor, x: torch.Tensor, blocks: torch.Tensor, n: int, bf16_scales: bool = False
) -> None:
    """`got` is x rounded to bf16 times bf16(d * q) with fp32 sums: off by the summation
    order only, far below one product's size (a wrong weight, scale or input anywhere moves
    a sum by about one product)."""
    w = _reference_weights(blocks, n, bf16_scales).double()
    xb = x.to(torch.bfloat16).double()
    want = xb @ w.T
    bound = 1e-5 * (xb.abs() @ w.abs().T) + 1e-6
    if got.dtype == torch.bfloat16:
        bound = bound + want.abs() * 2**-8  # the output's own rounding
    err = (got.double() - want).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


@needs_amx
@pytest.mark.parametrize("bf16_scales", [False, True], ids=["fp16-scales", "bf16-scales"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_bf16_tiles_are_the_dense_product(dtype, m, n, k, bf16_scales) -> None:
    blocks = _blocks(n, k, seed=m + n)
    x = _x(m, k, dtype)
    got = g.gemm_q8_amx(x, blocks, n, bf16_scales=bf16_scales)
    assert got.dtype == dtype and got.shape == (m, n)
    _assert_dense(got, x, blocks, n, bf16_scales)
    # The plain-torch twin computes the same thing (its sums in another order).
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {}
    twin = g.gemm_q8_amx_torch(x, blocks, n, bf16_scales)
    torch.testing.assert_close(got, twin, **tol)
    assert torch.equal(
        g.gemm_q8_amx_weights(blocks, n, bf16_scales), _reference_weights(blocks, n, bf16_scales)
    )


@needs_amx
def test_the_scale_rounding_is_seen() -> None:
    # Scales off bf16's grid: rounding them first changes the weights, and so the product.
    blocks = _blocks(48, 96, seed=4)
    assert not torch.equal(_reference_weights(blocks, 48), _reference_weights(blocks, 48, True))
    x = _x(40, 96, torch.float32)
    exact = g.gemm_q8_amx(x, blocks, 48)
    rounded = g.gemm_q8_amx(x, blocks, 48, bf16_scales=True)
    assert not torch.equal(exact, rounded)
    _assert_dense(rounded, x, blocks, 48, bf16_scales=True)


@needs_amx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("n", "k"), [(80, 576), (37, 1536), (48, 96), (16, 3104)])
def test_bf16_tiles_at_every_row_count(dtype, n, k) -> None:
    # Rows pass 32 at a time, a last 1..16 in one A tile; up to 65 rows a pair at a time meets
    # every row, from 255 (x past 160 KB at K 576) the pairs go in L2 panels; 1031: many
    # panels and a ragged last block.
    blocks = _blocks(n, k, seed=n + k)
    for m in [*range(1, 41), 63, 64, 65, 255, 256, 257, 1031]:
        x = _x(m, k, dtype, seed=m)
        rounded = m % 2 == 1
        got = g.gemm_q8_amx(x, blocks, n, bf16_scales=rounded)
        assert got.shape == (m, n) and got.dtype == dtype
        _assert_dense(got, x, blocks, n, rounded)


@needs_amx
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(929, 944, 576), (353, 720, 1536), (2049, 80, 576), (257, 1000, 576), (129, 1000, 576)],
)
def test_one_and_two_threads_give_the_same_bits(m, n, k) -> None:
    # Several panels per thread (the next one made into the ring while the last is in use),
    # or a pair at a time (129 rows: x under 160 KB); N not a multiple of 32.
    blocks = _blocks(n, k, seed=m)
    x = _x(m, k, torch.bfloat16, seed=n)
    two = g.gemm_q8_amx(x, blocks, n, threads=2, bf16_scales=True)
    _assert_dense(two, x, blocks, n, bf16_scales=True)
    assert torch.equal(two, g.gemm_q8_amx(x, blocks, n, threads=1, bf16_scales=True))
    assert torch.equal(two, g.gemm_q8_amx(x, blocks, n, threads=3, bf16_scales=True))


@needs_amx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", [7, 40, 200])
def test_strided_x_and_y(dtype, m) -> None:
    # The entry point itself, y rows wider than n: the gaps between them stay as they were.
    n, k, pad = 80, 576, 24
    blocks = _blocks(n, k, seed=m)
    x = _x(m, 2 * k, dtype, seed=m)[:, k:]  # row stride 2k, not at the buffer's start
    want = g.gemm_q8_amx(x.contiguous(), blocks, n)
    assert torch.equal(g.gemm_q8_amx(x, blocks, n), want)
    y = torch.full((m, n + pad), float("nan"), dtype=dtype)
    lib = g._gemm_lib(g.load())
    assert lib is not None
    for threads in (1, 2):
        status = lib.pagemill_gemm_q8_amx(
            1 if dtype == torch.bfloat16 else 0,
            x.data_ptr(),
            x.stride(0),
            blocks.data_ptr(),
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


@needs_amx
@pytest.mark.parametrize("bf16_scales", [False, True], ids=["fp16-scales", "bf16-scales"])
def test_a_dense_copy_or_embeddings_values(bf16_scales) -> None:
    # A dense copy made from the tiles holds bf16(d * q); a bf16 embedding dequantized with
    # its scales in bf16 holds bf16(q * bf16(d)). Each is the tiles' weights in one mode, so
    # the product is F.linear's on it (summation order aside).
    n, k = 304, 576
    blocks = _blocks(n, k, seed=11)
    q, d = g.unpack_q8_blocks(blocks, n)
    if bf16_scales:
        d = d.to(torch.bfloat16).float()
    dense_w = (q.view(n, k // 32, 32).float() * d[..., None]).reshape(n, k).to(torch.bfloat16)
    if not bf16_scales:
        assert torch.equal(dense_w, g.dequantize_q8_blocks(blocks, n).to(torch.bfloat16))
    assert torch.equal(dense_w, g.gemm_q8_amx_weights(blocks, n, bf16_scales))
    x = _x(96, k, torch.float32, seed=3)
    got = g.gemm_q8_amx(x, blocks, n, bf16_scales=bf16_scales)
    dense = torch.nn.functional.linear(x.to(torch.bfloat16).float(), dense_w.float())
    torch.testing.assert_close(got, dense, rtol=1e-4, atol=1e-4)


@needs_amx
def test_operator_is_the_kernel() -> None:
    if not cpu_native.load_gemv_ops():
        pytest.skip("the C++ operators did not build here")
    blocks = _blocks(48, 96, seed=5)
    for dtype in (torch.bfloat16, torch.float32):
        x = _x(21, 96, dtype)
        want = g.gemm_q8_amx(x, blocks, 48)
        assert torch.equal(torch.ops.pagemill_native.gemm_q8_amx(x, blocks, 48), want)
        rounded = g.gemm_q8_amx(x, blocks, 48, bf16_scales=True)
        assert torch.equal(torch.ops.pagemill_native.gemm_q8_amx(x, blocks, 48, True), rounded)
        strided = _x(21, 192, dtype)[:, ::2]  # a column stride: the operator copies
        assert torch.equal(
            torch.ops.pagemill_native.gemm_q8_amx(strided, blocks, 48),
            g.gemm_q8_amx(strided.contiguous(), blocks, 48),
        )
    with pytest.raises(RuntimeError, match="bytes per block"):
        torch.ops.pagemill_native.gemm_q8_amx(x, blocks[:, :, :-1].contiguous(), 48)
    with pytest.raises(RuntimeError, match="do not give"):
        torch.ops.pagemill_native.gemm_q8_amx(x, blocks, 49)
    # Its fake kernel gives the shape a compiled graph needs.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        out = torch.ops.pagemill_native.gemm_q8_amx(fx, mode.from_tensor(blocks), 48)
        assert out.shape == (21, 48) and out.dtype == x.dtype


def test_without_amx_it_refuses() -> None:
    plain = g.load(0)  # built without AMX: its entry point refuses (status 4)
    assert plain is not None and not g.gemm_amx_available(plain)
    blocks = _blocks(48, 96, seed=7)
    x = _x(9, 96, torch.bfloat16)
    with pytest.raises(RuntimeError, match="AMX-BF16"):
        g.gemm_q8_amx(x, blocks, 48, lib=plain)
    lib = g._gemm_lib(plain)
    assert lib is not None
    y = torch.empty(9, 48, dtype=torch.bfloat16)
    args = (1, x.data_ptr(), 96, blocks.data_ptr(), y.data_ptr(), 48, 9, 48, 96, 1, 0)
    assert lib.pagemill_gemm_q8_amx(*args) == 4
    # Arguments it refuses before asking for the tiles.
    assert lib.pagemill_gemm_q8_amx(2, *args[1:]) == 1
    assert lib.pagemill_gemm_q8_amx(*args[:8], 95, 1, 0) == 2


@needs_amx
def test_refuses_what_it_cannot_take() -> None:
    blocks = _blocks(48, 96, seed=9)
    with pytest.raises(ValueError, match="gemm_q8_amx takes"):
        g.gemm_q8_amx(_x(3, 64, torch.bfloat16), blocks, 48)
    with pytest.raises(ValueError, match="gemm_q8_amx takes"):
        g.gemm_q8_amx(_x(3, 96, torch.float16), blocks, 48)
