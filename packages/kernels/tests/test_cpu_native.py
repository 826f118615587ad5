"""The native CPU decode kernel (K/V read in place) against float64 dense attention.

It is built on first use with the host compiler; where none exists the tests skip (the
torch path then serves decodes, and test_attention covers it).
"""

from __future__ import annotations

import pytest
import torch

from pagemill.kernels import cpu_native, native_build, paged_attention, plan_attention

TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.fixture(params=["operator", "ctypes"])
def lib(request):
    """The kernel library, reached through its C++ torch operator or through ctypes."""
    built = cpu_native.load()
    if built is None:
        pytest.skip("the native CPU kernel could not be built here (no C++ compiler?)")
    if request.param == "operator":
        if not cpu_native.load_attention_ops():
            pytest.skip("the C++ operators could not be built here")
        yield built
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_native, "load_attention_ops", lambda: False)
        yield built


def _batch(seed, ctx, num_heads, num_kv_heads, head_dim, block_size, dtype):
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-c // block_size) for c in ctx]
    pool = sum(nblk) + 3
    perm = torch.randperm(pool, generator=g)
    # Junk past each request's blocks: the kernel must never read it.
    tables = torch.randint(0, pool, (len(ctx), max(nblk) + 2), generator=g, dtype=torch.int32)
    used = 0
    for s, n in enumerate(nblk):
        tables[s, :n] = perm[used : used + n].to(torch.int32)
        used += n
    shape = (pool, block_size, num_kv_heads, head_dim)
    kc = torch.randn(shape, generator=g).to(dtype)
    vc = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(len(ctx), num_heads, head_dim, generator=g).to(dtype)
    return q, kc, vc, tables, torch.tensor(ctx, dtype=torch.int32)


def _dense(q, kc, vc, tables, lens, scale, window=0, softcap=0.0, sinks=None, ks=1.0, vs=1.0):
    """float64 attention of each request's one query over its whole context, with the
    layer options spelled out as transformers' eager attention does them."""
    out = []
    group = q.shape[1] // kc.shape[2]
    for s, n in enumerate(lens.tolist()):
        nb = -(-n // kc.shape[1])
        k = kc[tables[s, :nb].long()].reshape(-1, kc.shape[2], kc.shape[3])[:n].double() * ks
        v = vc[tables[s, :nb].long()].reshape(-1, vc.shape[2], vc.shape[3])[:n].double() * vs
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("hd,thd->ht", q[s].double(), k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if window and n > window:
            scores[:, : n - window] = float("-inf")
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None]], dim=1)
        w = torch.softmax(scores, dim=-1)[:, :n]
        out.append(torch.einsum("ht,thd->hd", w, v))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(4, 4, 64), (9, 3, 64), (8, 2, 128), (6, 1, 24), (16, 2, 256)],
)
@pytest.mark.parametrize("block_size", [16, 5])
def test_native_decode_matches_dense(lib, dtype, num_heads, num_kv_heads, head_dim, block_size):
    ctx = [1, 2, 15, 16, 17, 70, 33]
    q, kc, vc, tables, lens = _batch(0, ctx, num_heads, num_kv_heads, head_dim, block_size, dtype)
    out = torch.full_like(q, float("nan"))
    cpu_native.paged_decode(lib, q, kc, vc, out, tables, lens, None, 0.3)
    ref = _dense(q, kc, vc, tables, lens, 0.3)
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err < TOL[dtype]


def test_native_rows_write_only_their_rows(lib):
    """Decode rows scattered among prefill rows: only those rows of `out` are written."""
    q, kc, vc, tables, lens = _batch(1, [9, 40, 3], 8, 2, 64, 16, torch.float32)
    big_q = torch.randn(7, 8, 64)
    rows = torch.tensor([5, 0, 3])
    big_q[rows] = q
    out = torch.full_like(big_q, float("nan"))
    cpu_native.paged_decode(lib, big_q, kc, vc, out, tables, lens, rows, 0.25)
    assert torch.allclose(out[rows].double(), _dense(q, kc, vc, tables, lens, 0.25), atol=1e-5)
    others = [r for r in range(7) if r not in rows.tolist()]
    assert out[others].isnan().all()


def test_native_is_the_plan_for_decodes_and_matches_the_gather_path(lib, monkeypatch):
    q, kc, vc, tables, lens = _batch(2, [5, 90, 17, 64, 1, 33], 9, 3, 64, 16, torch.bfloat16)
    qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    plan = plan_attention(
        qsl, lens, tables, k_cache_shape=tuple(kc.shape), num_heads=9, dtype=q.dtype
    )
    assert plan.impl.native is not None and not plan.impl.decode
    native = paged_attention(q, kc, vc, tables, qsl, lens, 0.125, plan=plan)
    monkeypatch.setattr(cpu_native, "load", lambda: None)
    gathered = paged_attention(q, kc, vc, tables, qsl, lens, 0.125)
    ref = _dense(q, kc, vc, tables, lens, 0.125)
    # fp32 scores in the native kernel: closer to float64 than the bf16-score gather path.
    assert (native.double() - ref).abs().max() <= (gathered.double() - ref).abs().max() + 1e-3


def test_native_result_does_not_depend_on_threads(lib, monkeypatch):
    q, kc, vc, tables, lens = _batch(3, [40] * 8, 8, 2, 64, 16, torch.float32)
    outs = []
    for threads in (1, 2):
        monkeypatch.setattr(torch, "get_num_threads", lambda t=threads: t)
        out = torch.empty_like(q)
        cpu_native.paged_decode(lib, q, kc, vc, out, tables, lens, None, 0.2)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


# Head dims 64 and 128 take the vectorised path where the CPU has AVX-512 (tiles of 16
# tokens; blocks of 5, 16 and 40 tokens cut tiles at, on and across block edges); a GQA
# group over 16 and head dim 96 take the portable one. Both must give the same answers.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 1, 128), (32, 1, 64), (6, 2, 96)]
)
@pytest.mark.parametrize("block_size", [5, 16, 40])
@pytest.mark.parametrize(
    ("window", "softcap", "with_sinks"),
    [(0, 0.0, False), (23, 0.0, False), (0, 3.0, False), (0, 0.0, True), (17, 2.0, True)],
)
def test_native_layer_options_match_dense(
    lib, dtype, num_heads, num_kv_heads, head_dim, block_size, window, softcap, with_sinks
):
    ctx = [1, 16, 17, 31, 33, 64, 100, 150]
    q, kc, vc, tables, lens = _batch(4, ctx, num_heads, num_kv_heads, head_dim, block_size, dtype)
    sinks = (
        torch.randn(num_heads, generator=torch.Generator().manual_seed(5)) if with_sinks else None
    )
    out = torch.full_like(q, float("nan"))
    cpu_native.paged_decode(
        lib, q, kc, vc, out, tables, lens, None, 0.3, window, softcap, sinks=sinks
    )
    ref = _dense(q, kc, vc, tables, lens, 0.3, window, softcap, sinks)
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err < TOL[dtype]


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_native_fp8_cache_matches_dense(lib, fp8, dtype, head_dim):
    """An fp8 cache read through its value table, scales folded in, on both paths' shapes."""
    q, kc, vc, tables, lens = _batch(6, [3, 16, 45, 90], 9, 3, head_dim, 16, torch.float32)
    kc, vc, q = kc.to(fp8), vc.to(fp8), q.to(dtype)
    out = torch.full_like(q, float("nan"))
    cpu_native.paged_decode(
        lib,
        q,
        kc,
        vc,
        out,
        tables,
        lens,
        None,
        0.2,
        k_scale=torch.tensor(0.5),
        v_scale=torch.tensor(2.0),
    )
    ref = _dense(q, kc, vc, tables, lens, 0.2, ks=0.5, vs=2.0)
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 40])
@pytest.mark.parametrize(("window", "with_sinks"), [(0, False), (3000, True)])
def test_native_long_contexts_match_dense(lib, dtype, block_size, window, with_sinks):
    """Contexts past the vectorised path's score chunk (a couple of thousand tokens) merge
    their chunks' softmax states; a window may start inside any chunk."""
    ctx = [2047, 2048, 2049, 4500, 5001]
    q, kc, vc, tables, lens = _batch(8, ctx, 9, 3, 64, block_size, dtype)
    sinks = torch.randn(9, generator=torch.Generator().manual_seed(9)) if with_sinks else None
    out = torch.full_like(q, float("nan"))
    cpu_native.paged_decode(lib, q, kc, vc, out, tables, lens, None, 0.125, window, sinks=sinks)
    ref = _dense(q, kc, vc, tables, lens, 0.125, window, sinks=sinks)
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err < TOL[dtype]


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_native_long_contexts_with_every_option_match_dense(lib, monkeypatch, threads, head_dim):
    """Contexts over several of the vectorised paths' score chunks, a window starting
    inside one, sinks and a soft-cap at once, on one thread and on four."""
    ctx = [1, 15, 333, 337, 700, 1025, 1400, 90]
    q, kc, vc, tables, lens = _batch(21, ctx, 9, 3, head_dim, 16, torch.float32)
    sinks = torch.randn(9, generator=torch.Generator().manual_seed(22))
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    out = torch.full_like(q, float("nan"))
    cpu_native.paged_decode(lib, q, kc, vc, out, tables, lens, None, 0.2, 1200, 4.0, sinks=sinks)
    ref = _dense(q, kc, vc, tables, lens, 0.2, 1200, 4.0, sinks)
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err < TOL[torch.float32]


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(3, 3), (9, 3), (16, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [0, 21])
def test_native_many_requests_match_dense(lib, monkeypatch, num_heads, num_kv_heads, dtype, window):
    """Hundreds of requests whose contexts end anywhere in a block, on two threads: each
    thread's runs of pairs and the prefetch stream that crosses their blocks and pairs."""
    g = torch.Generator().manual_seed(11)
    ctx = torch.randint(1, 90, (300,), generator=g).tolist()
    q, kc, vc, tables, lens = _batch(12, ctx, num_heads, num_kv_heads, 64, 16, dtype)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    out = torch.full_like(q, float("nan"))
    cpu_native.paged_decode(lib, q, kc, vc, out, tables, lens, None, 0.125, window)
    ref = _dense(q, kc, vc, tables, lens, 0.125, window)
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err < TOL[dtype]


@pytest.mark.parametrize("num_kv_heads", [1, 3])
def test_native_fp8_many_requests_per_head_scales(lib, num_kv_heads):
    ctx = torch.randint(1, 70, (200,), generator=torch.Generator().manual_seed(13)).tolist()
    q, kc, vc, tables, lens = _batch(14, ctx, 3 * num_kv_heads, num_kv_heads, 64, 16, torch.float32)
    kc, vc, q = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn), q.to(torch.bfloat16)
    ks = torch.linspace(0.5, 1.5, num_kv_heads)
    vs = torch.linspace(2.0, 1.0, num_kv_heads)
    out = torch.full_like(q, float("nan"))
    cpu_native.paged_decode(lib, q, kc, vc, out, tables, lens, None, 0.2, k_scale=ks, v_scale=vs)
    group = q.shape[1] // num_kv_heads
    for h in range(num_kv_heads):
        heads = slice(h * group, (h + 1) * group)
        ref = _dense(
            q[:, heads],
            kc[:, :, h : h + 1],
            vc[:, :, h : h + 1],
            tables,
            lens,
            0.2,
            ks=float(ks[h]),
            vs=float(vs[h]),
        )
        err = (out[:, heads].double() - ref).abs().max() / ref.abs().max()
        assert err < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp8", [False, True])
def test_native_output_rounds_to_nearest_even(lib, dtype, fp8):
    """With a zero query every key weighs the same, so the output is the exact fp32 mean
    of the V rows, rounded once to the output dtype: it must equal torch's rounding bit for
    bit (and keep a NaN), whatever order the kernel holds its accumulators in."""
    g = torch.Generator().manual_seed(15)
    kc = torch.randn(4, 16, 2, 64, generator=g)
    vc = torch.randn(4, 16, 2, 64, generator=g)
    if fp8:
        kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    else:
        kc, vc = kc.to(dtype), vc.to(dtype)
        vc[1, 0, 0, 5] = float("nan")  # block 1 slot 0: the second request's first token
    tables = torch.tensor([[0, 2], [1, 3]], dtype=torch.int32)
    lens = torch.tensor([2, 4], dtype=torch.int32)  # powers of two: the mean is exact in fp32
    q = torch.zeros(2, 4, 64, dtype=dtype)
    out = torch.empty_like(q)
    cpu_native.paged_decode(lib, q, kc, vc, out, tables, lens, None, 0.125)
    for s, n in enumerate(lens.tolist()):
        v = vc[tables[s, 0].long(), :n].float()  # both contexts sit in their first block
        want = (v.sum(0) / n).to(dtype)  # [kv heads, D]
        got = out[s].view(2, 2, 64)  # [kv heads, group, D]
        for j in range(2):
            assert torch.equal(got[:, j].isnan(), want.isnan())
            assert torch.equal(got[:, j].nan_to_num(), want.nan_to_num())


def test_build_key_covers_the_headers_beside_the_sources(tmp_path, monkeypatch):
    """A header the kernels share (`csrc/*.h`) is part of the build: changing it builds a
    new library instead of loading the one built from the old header."""
    if native_build.compiler() is None:
        pytest.skip("no C++ compiler")
    from pathlib import Path

    monkeypatch.setenv(native_build.CACHE_ENV, str(tmp_path / "kernels"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "value.h").write_text("inline int value() { return 1; }\n")
    (src / "k.cpp").write_text('#include "value.h"\nextern "C" int k() { return value(); }\n')
    first = cpu_native.build_shared(Path(src / "k.cpp"), "a test kernel", "nothing")
    assert first is not None
    (src / "value.h").write_text("inline int value() { return 2; }\n")
    second = cpu_native.build_shared(Path(src / "k.cpp"), "a test kernel", "nothing")
    assert second is not None and second != first
    import ctypes

    assert ctypes.CDLL(str(first)).k() == 1 and ctypes.CDLL(str(second)).k() == 2


def test_direct_decode_serves_what_direct_decode_takes():
    """What `direct_decode_serves` says before a step is what `direct_decode` does with the
    step's query: the caches it refuses are refused either way."""
    from pagemill.kernels.ops import direct_decode, direct_decode_serves

    if cpu_native.load() is None or not cpu_native.load_attention_ops():
        pytest.skip("the C++ operators could not be built here")
    k = torch.randn(4, 16, 2, 64, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(1, 4, 64, dtype=torch.bfloat16)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    lens = torch.tensor([5], dtype=torch.int32)
    strided = k.transpose(1, 2).contiguous().transpose(1, 2)
    cases = {
        "served": (torch.bfloat16, k, v, None, True),
        "fp32 sinks": (torch.bfloat16, k, v, torch.zeros(4), True),
        "fp16 sinks": (torch.bfloat16, k, v, torch.zeros(4, dtype=torch.float16), False),
        "cache in another dtype": (torch.bfloat16, k.float(), v.float(), None, False),
        "v of another shape": (torch.bfloat16, k, v[:2], None, False),
        "strided k": (torch.bfloat16, strided, v, None, False),
        "head dim over 256": (
            torch.bfloat16,
            torch.randn(1, 16, 1, 320, dtype=torch.bfloat16),
            torch.randn(1, 16, 1, 320, dtype=torch.bfloat16),
            None,
            False,
        ),
    }
    for name, (dtype, kc, vc, sinks, expected) in cases.items():
        assert direct_decode_serves(dtype, kc, vc, sinks) is expected, name
        if kc.shape[-1] == 64 and kc.shape[2] == 2:
            out = direct_decode(q.to(dtype), kc, vc, tables, lens, 0.125, sinks=sinks)
            assert (out is not None) is expected, name
