"""The int4 x int8-activation CPU GEMV against plain torch: the same arithmetic written in
torch (`gemv_q4_torch`), the exact fp32 product within the int8 rounding's own bound, every
ISA build this CPU can run, odd shapes, thread counts, the op in a compiled graph, and the
fallback without a compiler."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pagemill.kernels import gemv_q4_cpu as g

pytestmark = pytest.mark.skipif(g.load() is None, reason="no C++ compiler for the kernel")


@pytest.fixture(autouse=True)
def _gemv_paths_only() -> Iterator[None]:
    """The GEMV's own paths at every row count: on an AMX machine `gemv_q4` would move to the
    tiles from a few rows (test_gemm_q4_amx_cpu tests that, to the bit)."""
    libs = [lib for lib in {g.load(), *(g.load(isa) for isa in ISAS)} if lib is not None]
    prev = [g.set_amx_rows(0, lib) for lib in libs]
    yield
    for lib, p in zip(libs, prev, strict=True):
        g.set_amx_rows(p, lib)


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


_NEEDS = {0: set(), 1: {"avx2", "fma"}, 2: {"avx_vnni"}, 3: {"avx512_vnni", "avx512vl"}}
ISAS = [isa for isa, need in _NEEDS.items() if need <= _cpu_flags()]


def _rows(n: int, k: int, group: int = 32, seed: int = 0, exact16: bool = True):
    """Random int4 groups (q, scale, zero) in the Int4Groups convention."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    d = torch.rand(n, k // group, generator=gen) * 0.02 + 1e-3
    m = -8 * d * torch.rand(n, k // group, generator=gen)
    if exact16:
        d, m = d.half().float(), m.half().float()
    else:
        d = d * (1 + 2**-20)  # off the fp16 grid
    return q, d, m + 8 * d


def _exact_weight(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, group: int) -> torch.Tensor:
    n, k = q.shape
    w = (q.view(n, k // group, group).float() - 8) * s[..., None] + z[..., None]
    return w.view(n, k)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("n", [1, 16, 17, 48])
@pytest.mark.parametrize("exact16", [True, False], ids=["fp16", "fp32"])
def test_tiles_hold_the_weights(group, n, exact16) -> None:
    q, s, z = _rows(n, 256, group, exact16=exact16)
    blocks = g.pack_q4_blocks(q, s, z, group)
    assert blocks.shape == (-(-n // 16), 8, 320 if exact16 else 384)
    torch.testing.assert_close(
        g.dequantize_q4_blocks(blocks, n), _exact_weight(q, s, z, group), rtol=0, atol=1e-7
    )
    q2, _, _ = g.unpack_q4_blocks(blocks, n)
    assert torch.equal(q2, q)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 48, 96), (2, 17, 32), (3, 1, 64), (5, 33, 160)])
def test_matches_the_torch_arithmetic(isa, planes, dtype, m, n, k) -> None:
    lib = g.load(isa)
    assert lib is not None and lib.pagemill_gemv_q4_isa() == isa
    for exact16 in (True, False):
        q, s, z = _rows(n, k, exact16=exact16, seed=m)
        blocks = g.pack_q4_blocks(q, s, z, 32)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype)
        got = g.gemv_q4(x, blocks, n, lib, planes=planes)
        want = g.gemv_q4_torch(x, blocks, n, planes)
        assert got.dtype == dtype and got.shape == (m, n)
        # Same integers; only the float summation order differs.
        tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("m", [6, 8, 13, 16, 31, 64, 127, 300])
def test_batches_match_the_torch_arithmetic(isa, planes, m) -> None:
    """Large batches: every row-block size the kernel splits m into (8 or 4 rows, and the
    remainder), each row the same arithmetic as a batch of one."""
    lib = g.load(isa)
    assert lib is not None
    n, k = 50, 160  # a partial last tile
    q, s, z = _rows(n, k, seed=m)
    blocks = g.pack_q4_blocks(q, s, z, 32)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    got = g.gemv_q4(x, blocks, n, lib, planes=planes)
    torch.testing.assert_close(got, g.gemv_q4_torch(x, blocks, n, planes))
    # A row's result does not depend on its neighbours or on where the row blocks fall.
    for r in (0, m // 2, m - 1):
        assert torch.equal(got[r : r + 1], g.gemv_q4(x[r : r + 1], blocks, n, lib, planes=planes))


@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("m", [1, 4, 9, 37, 256])
def test_int8_rounding_stays_within_its_bound(m, planes) -> None:
    """Against x · Wᵀ in fp32 with the exact weights: each x is off by at most half its
    block's step (dx / 2 with one plane, dx / 508 with two), and the min term is exact, so
    |err| <= sum_b step_b / 2 * sum_j |d q_j| (plus fp32 summation slack)."""
    n, k = 40, 192
    q, s, z = _rows(n, k, seed=3)
    blocks = g.pack_q4_blocks(q, s, z, 32)
    x = torch.randn(m, k) * torch.linspace(0.1, 4, k)  # blocks of different ranges
    got = g.gemv_q4(x, blocks, n, planes=planes)
    exact = x @ _exact_weight(q, s, z, 32).T
    qq, d, _ = g.unpack_q4_blocks(blocks, n)
    _, dx, _ = g.quantize_activations(x)
    dq = (qq.view(n, k // 32, 32).float() * d[..., None]).abs().sum(-1)  # [n, nb]
    bound = 0.5 * dx @ dq.T / (1 if planes == 1 else 254)
    err = (got - exact).abs()
    assert (err <= bound * 1.001 + 2e-5 * exact.abs().max()).all()
    if planes == 2:  # and far inside one plane's bound
        assert err.max() < 0.02 * (0.5 * dx @ dq.T).max()
    assert err.max() > 0  # the rounding is real: this is not the exact product


def test_thread_counts_give_the_same_bits() -> None:
    """Each output row is one thread's work start to end: any split gives the same bits."""
    q, s, z = _rows(200, 320, seed=5)
    blocks = g.pack_q4_blocks(q, s, z, 32)
    for m in (6, 37, 300):  # 16 rows and more quantize in parallel too
        x = torch.randn(m, 320, dtype=torch.bfloat16)
        for planes in (1, 2):
            outs = [g.gemv_q4(x, blocks, 200, threads=t, planes=planes) for t in (1, 2, 3, 7)]
            assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_strided_rows_and_refusals() -> None:
    q, s, z = _rows(32, 64)
    blocks = g.pack_q4_blocks(q, s, z, 32)
    wide = torch.randn(3, 128)
    x = wide[:, :64]  # rows 128 apart
    torch.testing.assert_close(g.gemv_q4(x, blocks, 32), g.gemv_q4(x.contiguous(), blocks, 32))
    with pytest.raises(ValueError, match="gemv_q4 takes"):
        g.gemv_q4(torch.randn(2, 96), blocks, 32)  # K does not match
    with pytest.raises(ValueError, match="gemv_q4 takes"):
        g.gemv_q4(torch.randn(2, 64, dtype=torch.float16), blocks, 32)
    with pytest.raises(ValueError, match="gemv_q4 takes"):
        g.gemv_q4(torch.randn(2, 64), blocks, 33)  # more rows than the tiles hold
    with pytest.raises(ValueError, match="1 or 2 activation planes"):
        g.gemv_q4(torch.randn(2, 64), blocks, 32, planes=3)
    with pytest.raises(ValueError, match="multiple of 32"):
        g.pack_q4_blocks(q[:, :48], s, z, 32)


def test_op_in_a_compiled_graph() -> None:
    q, s, z = _rows(48, 96)
    blocks = g.pack_q4_blocks(q, s, z, 32)

    def f(x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.pagemill.gemv_q4(x * 2, blocks, 48) + torch.ops.pagemill.gemv_q4(
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
