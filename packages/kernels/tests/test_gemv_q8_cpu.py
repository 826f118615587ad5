"""The Q8_0 x int8-activation CPU GEMV against plain torch: the same arithmetic written in
torch (`gemv_q8_torch`), the exact fp32 product within the int8 rounding's own bound, every
ISA build this CPU can run (weights of -128 and 127 included: the VNNI offset and the AVX2
sign trick must not overflow), odd shapes, thread counts, the op in a compiled graph, and
the fallback without a compiler. On an AMX machine: the matrix-unit path gives the vector
kernel's bits at every row count, and the kernel's own pick follows the row count and
PAGEMILL_CPU_GEMV_AMX."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagemill.kernels import gemv_q8_cpu as g

pytestmark = pytest.mark.skipif(g.load() is None, reason="no C++ compiler for the kernel")


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


_NEEDS = {
    0: set(),
    1: {"avx2", "fma", "f16c"},
    2: {"avx_vnni"},
    3: {"avx512_vnni", "avx512vl", "avx512bw"},
}
ISAS = [isa for isa, need in _NEEDS.items() if need <= _cpu_flags()]


def _rows(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random int8 blocks (q in the full -128..127 range, fp16 scales)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    q.view(-1)[:2] = torch.tensor([-128, 127], dtype=torch.int8)
    d = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3).half().float()
    return q, d


def _exact_weight(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    return (q.view(n, k // 32, 32).float() * d[..., None]).view(n, k)


@pytest.mark.parametrize("n", [1, 16, 17, 48])
def test_tiles_hold_the_weights(n) -> None:
    q, d = _rows(n, 256)
    blocks = g.pack_q8_blocks(q, d)
    assert blocks.shape == (-(-n // 16), 8, 544)
    assert torch.equal(g.dequantize_q8_blocks(blocks, n), _exact_weight(q, d))
    q2, d2 = g.unpack_q8_blocks(blocks, n)
    assert torch.equal(q2, q) and torch.equal(d2, d)


def test_scales_fp16_cannot_hold_are_refused() -> None:
    q, d = _rows(16, 64)
    off = d * (1 + 2**-20)
    assert g.packable(q, d) and not g.packable(q, off)
    with pytest.raises(ValueError, match="fp16-exact scales"):
        g.pack_q8_blocks(q, off)
    with pytest.raises(ValueError, match="fp16-exact scales"):
        g.pack_q8_blocks(q[:, :48], d)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 48, 96), (2, 17, 32), (3, 1, 64), (5, 33, 160), (16, 40, 96), (37, 33, 64)],
)
def test_matches_the_torch_arithmetic(isa, planes, dtype, m, n, k) -> None:
    lib = g.load(isa)
    assert lib is not None and lib.pagemill_gemv_q8_isa() == isa
    q, d = _rows(n, k, seed=m)
    blocks = g.pack_q8_blocks(q, d)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    x[0, :32] = x[0, :32].clamp(-1, 1)
    x[0, :2] = torch.tensor([-3.0, 3.0])  # its block's extremes: -127 and 127
    got = g.gemv_q8(x, blocks, n, lib, planes=planes)
    want = g.gemv_q8_torch(x, blocks, n, planes)
    assert got.dtype == dtype and got.shape == (m, n)
    # Same integers; only the float summation order differs.
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 2, 5])
def test_two_planes_at_their_extremes(isa, m) -> None:
    """The largest integers two planes make: q1 = 126 with q2 = 127 (the AVX2 build meets
    them as one int16, 254 * q1 + q2 = 32131) against weights of -128 and 127 in every input
    of a block (its sum near 2^27 must not overflow)."""
    lib = g.load(isa)
    n, k = 33, 96
    q = torch.full((n, k), -128, dtype=torch.int8)
    q[1::2] = 127
    q[2, ::2] = 127  # mixed signs in one row
    d = torch.full((n, k // 32), 2.0**-10)
    blocks = g.pack_q8_blocks(q, d)
    x = torch.full((m, k), 126.499)
    x[:, ::32] = 127.0  # each block's max: dx = 1
    x[-1, 32:64] *= -1
    xq, _, _ = g.quantize_activations(x, 2)
    assert xq[0, 1] == 126 + 127 / 254  # the planes hold what this test means to reach
    got = g.gemv_q8(x, blocks, n, lib, planes=2)
    exact = (xq.double() @ (q.double() * 2.0**-10).T).float()
    torch.testing.assert_close(got, exact, rtol=1e-6, atol=0)


@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("m", [1, 4, 9])
def test_int8_rounding_stays_within_its_bound(m, planes) -> None:
    """Against x · Wᵀ in fp32 with the exact weights: each x is off by at most half its
    block's step (dx / 2 with one plane, dx / 508 with two), so
    |err| <= sum_b step_b / 2 * sum_j |d q_j| (plus fp32 summation slack)."""
    n, k = 40, 192
    q, d = _rows(n, k, seed=3)
    blocks = g.pack_q8_blocks(q, d)
    x = torch.randn(m, k) * torch.linspace(0.1, 4, k)  # blocks of different ranges
    got = g.gemv_q8(x, blocks, n, planes=planes)
    w = _exact_weight(q, d)
    exact = x @ w.T
    dx = x.view(m, k // 32, 32).abs().amax(-1) / 127
    dq = w.view(n, k // 32, 32).abs().sum(-1)  # [n, nb]
    bound = 0.5 * dx @ dq.T / (1 if planes == 1 else 254)
    err = (got - exact).abs()
    assert (err <= bound * 1.001 + 2e-5 * exact.abs().max()).all()
    if planes == 2:  # and far inside one plane's bound
        assert err.max() < 0.02 * (0.5 * dx @ dq.T).max()
    assert err.max() > 0  # the rounding is real: this is not the exact product


def test_unquantized_twin_is_the_exact_product() -> None:
    q, d = _rows(20, 64, seed=4)
    blocks = g.pack_q8_blocks(q, d)
    x = torch.randn(3, 64)
    torch.testing.assert_close(
        g.gemv_q8_torch(x, blocks, 20, quantize=False), x @ _exact_weight(q, d).T
    )


def test_thread_counts_give_the_same_bits() -> None:
    """Each output row is one thread's work start to end: any split gives the same bits."""
    q, d = _rows(200, 320, seed=5)
    blocks = g.pack_q8_blocks(q, d)
    x = torch.randn(6, 320, dtype=torch.bfloat16)
    for planes in (1, 2):
        outs = [g.gemv_q8(x, blocks, 200, threads=t, planes=planes) for t in (1, 2, 3, 7)]
        assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_strided_rows_and_refusals() -> None:
    q, d = _rows(32, 64)
    blocks = g.pack_q8_blocks(q, d)
    wide = torch.randn(3, 128)
    x = wide[:, :64]  # rows 128 apart
    torch.testing.assert_close(g.gemv_q8(x, blocks, 32), g.gemv_q8(x.contiguous(), blocks, 32))
    with pytest.raises(ValueError, match="gemv_q8 takes"):
        g.gemv_q8(torch.randn(2, 96), blocks, 32)  # K does not match
    with pytest.raises(ValueError, match="gemv_q8 takes"):
        g.gemv_q8(torch.randn(2, 64, dtype=torch.float16), blocks, 32)
    with pytest.raises(ValueError, match="gemv_q8 takes"):
        g.gemv_q8(torch.randn(2, 64), blocks, 33)  # more rows than the tiles hold
    with pytest.raises(ValueError, match="1 or 2 activation planes"):
        g.gemv_q8(torch.randn(2, 64), blocks, 32, planes=3)


def test_op_in_a_compiled_graph() -> None:
    q, d = _rows(48, 96)
    blocks = g.pack_q8_blocks(q, d)

    def f(x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.pagemill.gemv_q8(x * 2, blocks, 48) + torch.ops.pagemill.gemv_q8(
            x, blocks, 48, 1
        )
        return torch.relu(y) + 1

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    x = torch.randn(3, 96)
    torch.testing.assert_close(compiled(x), f(x))
    torch._dynamo.reset()


def test_no_compiler_means_no_kernel(monkeypatch) -> None:
    from pagemill.kernels import native_build

    monkeypatch.setattr(native_build, "compiler", lambda: None)
    assert g.load.__wrapped__() is None
    monkeypatch.setenv("PAGEMILL_NATIVE_CPU_KERNELS", "0")
    assert g.load.__wrapped__() is None


# ---- the AMX path ------------------------------------------------------------------------------

needs_amx = pytest.mark.skipif(not g.amx_available(), reason="no AMX-INT8 here (build or CPU)")


@needs_amx
@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("n", "k"), [(200, 576), (33, 160), (17, 32), (16, 64)])
def test_amx_gives_the_vector_kernels_bits(planes, dtype, n, k) -> None:
    q, d = _rows(n, k, seed=n + k)
    blocks = g.pack_q8_blocks(q, d)
    gen = torch.Generator().manual_seed(k)
    for m in (1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 33, 48, 64):
        x = (torch.randn(m, k, generator=gen) * torch.linspace(0.01, 8, k)).to(dtype)
        for threads in (1, 2):
            vec = g.gemv_q8(x, blocks, n, threads=threads, planes=planes, amx=False)
            amx = g.gemv_q8(x, blocks, n, threads=threads, planes=planes, amx=True)
            assert amx.dtype == dtype and amx.shape == (m, n)
            assert torch.equal(amx, vec), (m, threads)


@needs_amx
def test_amx_reads_strided_rows() -> None:
    q, d = _rows(48, 96, seed=7)
    blocks = g.pack_q8_blocks(q, d)
    x = torch.randn(20, 192)[:, 32:128]  # rows 192 apart
    want = g.gemv_q8(x.contiguous(), blocks, 48, amx=False)
    assert torch.equal(g.gemv_q8(x, blocks, 48, amx=True), want)


@needs_amx
def test_kernel_picks_amx_by_rows_and_switch(monkeypatch) -> None:
    low = g.amx_min_rows()
    assert 1 < low <= 16  # one row streams the weights best on the vector units
    monkeypatch.delenv("PAGEMILL_CPU_GEMV_AMX", raising=False)
    assert not g.picks_amx(low - 1) and g.picks_amx(low) and g.picks_amx(64)
    monkeypatch.setenv("PAGEMILL_CPU_GEMV_AMX", "0")
    assert not g.picks_amx(low) and not g.picks_amx(64)
    monkeypatch.setenv("PAGEMILL_CPU_GEMV_AMX", "1")
    assert g.picks_amx(64)
    monkeypatch.setenv("PAGEMILL_CPU_GEMV_AMX", "12")  # a row count moves the switch
    assert not g.picks_amx(11) and g.picks_amx(12) and g.amx_min_rows() == 12
    # Either way the picked path gives the same bits.
    q, d = _rows(40, 64, seed=8)
    blocks = g.pack_q8_blocks(q, d)
    x = torch.randn(low, 64)
    assert torch.equal(g.gemv_q8(x, blocks, 40), g.gemv_q8(x, blocks, 40, amx=False))


@pytest.mark.parametrize("isa", [isa for isa in ISAS if isa < 3])
def test_portable_builds_have_no_amx(isa) -> None:
    lib = g.load(isa)
    assert lib is not None and not g.amx_available(lib) and g.amx_min_rows(lib) == 0
    assert not g.picks_amx(64, lib)
    q, d = _rows(32, 64, seed=9)
    blocks = g.pack_q8_blocks(q, d)
    x = torch.randn(20, 64)
    torch.testing.assert_close(
        g.gemv_q8(x, blocks, 32, lib), g.gemv_q8_torch(x, blocks, 32), rtol=1e-5, atol=1e-5
    )
    with pytest.raises(RuntimeError, match="AMX"):
        g.gemv_q8(x, blocks, 32, lib, amx=True)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("amx", [False, None], ids=["vector", "picked"])
def test_bf16_outputs_round_as_torch_does(isa, amx) -> None:
    """bf16 x gives the fp32 result rounded to nearest even: the outputs' rounding, not an
    approximation of it (x is bf16-exact, so both calls quantize the same values)."""
    lib = g.load(isa)
    q, d = _rows(70, 96, seed=10)
    blocks = g.pack_q8_blocks(q, d)
    x = (torch.randn(9, 96) * 3).bfloat16()
    y16 = g.gemv_q8(x, blocks, 70, lib, amx=amx if isa == 3 else None)
    y32 = g.gemv_q8(x.float(), blocks, 70, lib, amx=amx if isa == 3 else None)
    assert torch.equal(y16.view(torch.int16), y32.bfloat16().view(torch.int16))
    # Exact ties (257 + 2r: halfway between two bf16 values) go to the even one. With
    # max|x| = 127 the activations are their own int8 values: y_r = 127 * 2 + (3 + 2r) * 1.
    q = torch.zeros(8, 32, dtype=torch.int8)
    q[:, 0] = 127
    q[:, 1] = torch.arange(8, dtype=torch.int8) * 2 + 3
    blocks = g.pack_q8_blocks(q, torch.ones(8, 1))
    x = torch.zeros(9, 32, dtype=torch.bfloat16)
    x[:, :3] = torch.tensor([2.0, 1.0, 127.0])
    y = g.gemv_q8(x, blocks, 8, lib, amx=amx if isa == 3 else None)
    want = (torch.arange(8) * 2 + 257).float().bfloat16().expand(9, 8)
    assert torch.equal(y, want)
