"""The native CPU decode kernel on batches of few (request, KV head) pairs, whose contexts
it cuts into parts read by different threads and merges (a partial softmax per part).

Each case is checked against float64 attention written out here; the cuts fall on block
edges from the window's first block, so contexts ending inside a block, parts left empty
by a short request beside a long one, and parts longer than the kernel's score chunk are
all covered. Skipped where the kernel cannot be built.
"""

from __future__ import annotations

import pytest
import torch

from pagemill.kernels import cpu_native

TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.fixture(scope="module")
def lib():
    built = cpu_native.load()
    if built is None:
        pytest.skip("the native CPU kernel could not be built here (no C++ compiler?)")
    return built


def _batch(seed, ctx, num_heads, num_kv_heads, head_dim, block_size, dtype):
    """Requests of `ctx` tokens over blocks scattered through a pool, junk past each table."""
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-c // block_size) for c in ctx]
    pool = sum(nblk) + 2
    perm = torch.randperm(pool, generator=g).to(torch.int32)
    width = max(max(nblk), 1) + 1
    tables = torch.randint(0, pool, (len(ctx), width), generator=g, dtype=torch.int32)
    used = 0
    for s, n in enumerate(nblk):
        tables[s, :n] = perm[used : used + n]
        used += n
    shape = (pool, block_size, num_kv_heads, head_dim)
    kc = torch.randn(shape, generator=g).to(dtype)
    vc = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(len(ctx), num_heads, head_dim, generator=g).to(dtype)
    return q, kc, vc, tables, torch.tensor(ctx, dtype=torch.int32)


def _reference(q, kc, vc, tables, lens, scale, window=0, softcap=0.0, sinks=None, ks=None, vs=None):
    """float64 attention per request and KV head (`ks`/`vs`: one scale per KV head)."""
    num_kv, bs = kc.shape[2], kc.shape[1]
    group = q.shape[1] // num_kv
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s, n in enumerate(lens.tolist()):
        if n == 0:
            continue
        blocks = tables[s, : -(-n // bs)].long()
        k = kc[blocks].reshape(-1, num_kv, kc.shape[3])[:n].double()
        v = vc[blocks].reshape(-1, num_kv, vc.shape[3])[:n].double()
        lo = n - window if window and n > window else 0
        for h in range(num_kv):
            heads = slice(h * group, (h + 1) * group)
            kh = k[lo:, h] * (1.0 if ks is None else float(ks[h]))
            vh = v[lo:, h] * (1.0 if vs is None else float(vs[h]))
            scores = q[s, heads].double() @ kh.T * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            if sinks is not None:
                scores = torch.cat([scores, sinks[heads].double()[:, None]], dim=1)
            w = torch.softmax(scores, dim=-1)[:, : n - lo]
            out[s, heads] = w @ vh
    return out


def _decode(lib, q, kc, vc, tables, lens, scale, threads=2, **kw):
    out = torch.full_like(q, float("nan"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_native, "load_attention_ops", lambda: False)
        mp.setattr(torch, "get_num_threads", lambda: threads)
        cpu_native.paged_decode(lib, q, kc, vc, out, tables, lens, None, scale, **kw)
    return out


def _err(out, ref):
    return float((out.double() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(3, 3), (9, 3), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("ctx", [[301], [513], [290, 77], [300, 3, 129]])
def test_few_requests_match_dense(lib, dtype, num_heads, num_kv_heads, block_size, ctx):
    """GQA groups of 1, 3 and 8; contexts ending inside a block; a 3-token request beside
    a 300-token one leaves some of its parts empty."""
    q, kc, vc, tables, lens = _batch(1, ctx, num_heads, num_kv_heads, 64, block_size, dtype)
    out = _decode(lib, q, kc, vc, tables, lens, 0.125)
    assert _err(out, _reference(q, kc, vc, tables, lens, 0.125)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("window", "softcap", "with_sinks"),
    [(300, 0.0, False), (0, 2.5, False), (0, 0.0, True), (277, 3.0, True), (5000, 0.0, True)],
)
def test_split_layer_options_match_dense(lib, dtype, window, softcap, with_sinks):
    """A window (its first block cut, a part may start inside it), soft-capped scores and
    sinks (one logit per head joining the merge once, not once per part)."""
    q, kc, vc, tables, lens = _batch(2, [1000, 333], 9, 3, 64, 16, dtype)
    sinks = torch.randn(9, generator=torch.Generator().manual_seed(3)) * 3 if with_sinks else None
    out = _decode(lib, q, kc, vc, tables, lens, 0.2, window=window, softcap=softcap, sinks=sinks)
    ref = _reference(q, kc, vc, tables, lens, 0.2, window, softcap, sinks)
    assert _err(out, ref) < TOL[dtype]


def test_split_parts_longer_than_a_score_chunk(lib):
    """One request of 20000 tokens: each part is several of the kernel's score chunks."""
    q, kc, vc, tables, lens = _batch(4, [20001], 9, 3, 64, 16, torch.bfloat16)
    out = _decode(lib, q, kc, vc, tables, lens, 0.125)
    assert _err(out, _reference(q, kc, vc, tables, lens, 0.125)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_split_fp8_per_head_scales(lib, fp8):
    q, kc, vc, tables, lens = _batch(5, [260, 61], 9, 3, 64, 16, torch.float32)
    kc, vc, q = kc.to(fp8), vc.to(fp8), q.to(torch.bfloat16)
    ks, vs = torch.tensor([0.5, 1.0, 1.5]), torch.tensor([2.0, 0.25, 1.0])
    out = _decode(lib, q, kc, vc, tables, lens, 0.2, k_scale=ks, v_scale=vs)
    ref = _reference(q, kc, vc, tables, lens, 0.2, ks=ks, vs=vs)
    assert _err(out, ref) < TOL[torch.bfloat16]


def test_split_result_does_not_depend_on_threads(lib):
    """The cut depends on the batch alone and the parts merge in order: any thread count
    gives the same bits."""
    q, kc, vc, tables, lens = _batch(6, [700], 9, 3, 64, 16, torch.float32)
    outs = [_decode(lib, q, kc, vc, tables, lens, 0.3, threads=t) for t in (1, 2, 3, 5)]
    for o in outs[1:]:
        assert torch.equal(outs[0], o)


def test_split_request_without_context_writes_zeros(lib):
    """A request of no tokens beside a long one: all its parts are empty, its output 0
    (as without a split), with or without sinks."""
    q, kc, vc, tables, lens = _batch(7, [0, 400], 9, 3, 64, 16, torch.float32)
    for sinks in (None, torch.ones(9)):
        out = _decode(lib, q, kc, vc, tables, lens, 0.125, sinks=sinks)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        ref = _reference(q, kc, vc, tables, lens, 0.125, sinks=sinks)
        assert _err(out[1:], ref[1:]) < TOL[torch.float32]


def test_split_writes_only_its_rows(lib):
    """Decode rows among prefill rows: the merge writes each request's row of `out`, no
    other."""
    q, kc, vc, tables, lens = _batch(8, [600, 450], 9, 3, 64, 16, torch.float32)
    big_q = torch.randn(6, 9, 64)
    rows = torch.tensor([4, 1])
    big_q[rows] = q
    out = torch.full_like(big_q, float("nan"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_native, "load_attention_ops", lambda: False)
        mp.setattr(torch, "get_num_threads", lambda: 2)
        cpu_native.paged_decode(lib, big_q, kc, vc, out, tables, lens, rows, 0.125)
    assert _err(out[rows], _reference(q, kc, vc, tables, lens, 0.125)) < TOL[torch.float32]
    assert out[[0, 2, 3, 5]].isnan().all()
