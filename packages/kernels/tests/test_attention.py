"""Paged attention: torch path vs naive dense attention, Triton (interpreter) vs torch path."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pagemill.kernels.attention_cpu as attention_cpu
from pagemill.kernels import (
    cpu_native,
    paged_attention,
    paged_attention_torch,
    paged_attention_triton,
)

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def make_batch(
    seed: int,
    q_lens: list[int],
    ctx_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int = 32,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
) -> Batch:
    """Random caches with each request's blocks scattered over the pool and junk padding.

    Unused blocks hold random values too, and table padding is -1 or a real block id, so
    reading past a request's context or through padding changes the result.
    """
    g = torch.Generator().manual_seed(seed)
    nblocks = [-(-c // block_size) for c in ctx_lens]
    max_blocks = max(nblocks) + 2
    pool = sum(nblocks) + 7
    perm = torch.randperm(pool, generator=g)
    tables = torch.randint(-1, pool, (len(q_lens), max_blocks), generator=g, dtype=torch.int32)
    used = 0
    for s, n in enumerate(nblocks):
        tables[s, :n] = perm[used : used + n]
        used += n
    k_cache = torch.randn(pool, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(pool, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    return q, k_cache, v_cache, tables, qsl, torch.tensor(ctx_lens, dtype=torch.int32)


def naive_attention(
    q, k_cache, v_cache, tables, qsl, seq_lens, scale, window=0, softcap=0.0
) -> torch.Tensor:
    """Dense causal attention per request in float64, K/V read token by token; ``window`` >
    0 also hides keys at or before ``q_pos - window``, ``softcap`` > 0 caps the scores."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    block_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    for s in range(tables.shape[0]):
        a, b, ctx = int(qsl[s]), int(qsl[s + 1]), int(seq_lens[s])
        pos = torch.arange(ctx)
        blk = tables[s, pos // block_size].long()
        k = k_cache[blk, pos % block_size].double().repeat_interleave(group, 1)
        v = v_cache[blk, pos % block_size].double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[a:b].double(), k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(ctx - (b - a), ctx)
        scores.masked_fill_(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        if window:
            scores.masked_fill_(pos[None, None, :] <= q_pos[None, :, None] - window, float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}

# (query lengths, context lengths): query shorter than context = cached prefix / prefix hit.
MIXED = ([1, 15, 16, 17, 1, 5, 40], [1, 15, 20, 17, 33, 50, 70])
DECODE = ([1] * 6, [1, 15, 16, 17, 100, 33])
GQA = [(4, 4), (9, 3), (8, 2)]  # ratios 1, 3, 4


@pytest.fixture(params=["native", "sdpa", "gemm"])
def decode_path(request, monkeypatch):
    """Every CPU decode path: the native kernel reading K/V in place (where a compiler built
    it), and without it small chunks use whole-block SDPA, larger ones head-major GEMMs;
    test shapes are small, so the GEMM path is forced by lowering the switch point."""
    if request.param == "native":
        if cpu_native.load() is None:
            pytest.skip("the native CPU kernel could not be built here")
    else:
        monkeypatch.setattr(cpu_native, "load", lambda: None)
    if request.param == "gemm":
        monkeypatch.setattr(attention_cpu, "_DECODE_SMALL_TOKENS", 0)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA)
@pytest.mark.parametrize("lens", [MIXED, DECODE], ids=["mixed", "decode"])
def test_torch_matches_naive(dtype, num_heads, num_kv_heads, lens, decode_path):
    batch = make_batch(0, *lens, num_heads, num_kv_heads, dtype=dtype)
    ref = naive_attention(*batch, 0.3)
    assert rel_err(paged_attention_torch(*batch, 0.3), ref) < TOL[dtype]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 50)), min_size=1, max_size=5),
    heads=st.sampled_from(GQA),
    block_size=st.sampled_from([4, 8, 16]),
    seed=st.integers(0, 2**16),
)
def test_torch_matches_naive_random(data, heads, block_size, seed):
    q_lens = [q for q, _ in data]
    ctx = [q + prefix for q, prefix in data]
    batch = make_batch(seed, q_lens, ctx, *heads, head_dim=16, block_size=block_size)
    assert rel_err(paged_attention_torch(*batch, 0.25), naive_attention(*batch, 0.25)) < 1e-5


def test_torch_empty_queries_and_odd_sizes():
    """A request with no query this step, head_dim 24 and block size 12."""
    batch = make_batch(9, [3, 0, 1, 21, 2], [3, 5, 7, 30, 25], 6, 2, head_dim=24, block_size=12)
    assert rel_err(paged_attention_torch(*batch, 0.4), naive_attention(*batch, 0.4)) < 1e-5


def test_torch_decode_chunks(monkeypatch, decode_path):
    """Long decode batches are cut into length-sorted chunks; results must not depend on it."""
    batch = make_batch(3, [1] * 9, [5, 90, 17, 64, 1, 33, 48, 16, 70], 8, 2)
    whole = paged_attention_torch(*batch, 0.2)
    monkeypatch.setattr(attention_cpu, "_DECODE_CHUNK_ELEMS", 64 * 2 * 32)
    chunked = paged_attention_torch(*batch, 0.2)
    assert rel_err(whole, chunked) < 1e-6
    assert rel_err(chunked, naive_attention(*batch, 0.2)) < 1e-5


def test_out_argument_and_dispatch():
    batch = make_batch(4, *MIXED, 9, 3)
    out = torch.full_like(batch[0], float("nan"))
    res = paged_attention(*batch, 0.3, out=out)
    assert res is out
    assert torch.equal(out, paged_attention_torch(*batch, 0.3))


def test_bad_input_is_refused():
    q, kc, vc, bt, qsl, sl = make_batch(5, [2, 1], [4, 9], 6, 4)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention_torch(q, kc, vc, bt, qsl, sl, 1.0)
    q, kc, vc, bt, qsl, sl = make_batch(5, [2, 1], [4, 9], 4, 2)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention_torch(q, kc, vc, bt, qsl[:-1], sl, 1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_attention_torch(q, kc, vc, bt, qsl, torch.tensor([1, 9], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="share"):
        paged_attention_torch(q.half(), kc, vc, bt, qsl, sl, 1.0)


# ------------------------------------------------------------------ Triton under the interpreter


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_mixed_matches_torch(interpreter, num_heads, num_kv_heads, dtype):
    batch = make_batch(1, *MIXED, num_heads, num_kv_heads, dtype=dtype)
    ref = paged_attention_torch(*batch, 0.3)
    assert rel_err(paged_attention_triton(*batch, 0.3), ref) < TOL[dtype] / 2 + 1e-6


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2)])
def test_triton_decode_matches_torch(interpreter, num_heads, num_kv_heads):
    batch = make_batch(2, *DECODE, num_heads, num_kv_heads)
    assert rel_err(paged_attention_triton(*batch, 0.3), paged_attention_torch(*batch, 0.3)) < 1e-5


def test_triton_small_tiles_odd_shapes(interpreter, tiled_triton_plan):
    """Many query tiles per request, KV tiles straddling pages, non-power-of-two sizes."""
    batch = make_batch(6, [3, 0, 1, 21, 2], [3, 5, 7, 30, 25], 6, 2, head_dim=24, block_size=12)
    q, kc, _, bt, qsl, sl = batch
    plan = tiled_triton_plan(q, kc, bt, qsl, sl, block_m=16, block_n=16)
    assert plan.impl.block_m == 16 and plan.impl.block_n == 16
    out = paged_attention_triton(*batch, 0.4, plan=plan)
    assert rel_err(out, naive_attention(*batch, 0.4)) < 1e-5


def test_triton_writes_only_its_rows_of_out(interpreter):
    batch = make_batch(7, [2, 1], [9, 4], 4, 2)
    big = torch.full((5, 4, 32), 7.0)
    out = big[1:4]
    paged_attention_triton(*batch, 0.5, out=out)
    assert torch.equal(big[0], torch.full((4, 32), 7.0)) and torch.equal(big[4], big[0])
    assert rel_err(out, paged_attention_torch(*batch, 0.5)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_split_context_decode(interpreter, tiled_triton_plan, dtype):
    """Flash-decoding: contexts cut into slices (some empty) and merged equal one pass."""
    batch = make_batch(8, [1] * 4, [1, 40, 16, 75], 8, 2, dtype=dtype)
    q, kc, _, bt, qsl, sl = batch
    split_plan = tiled_triton_plan(q, kc, bt, qsl, sl, block_n=16, num_splits=4)
    single_plan = tiled_triton_plan(q, kc, bt, qsl, sl, block_n=16, num_splits=1)
    assert split_plan.impl.num_splits == 4 and single_plan.impl.num_splits == 1
    split = paged_attention_triton(*batch, 0.3, plan=split_plan)
    single = paged_attention_triton(*batch, 0.3, plan=single_plan)
    assert rel_err(split, naive_attention(*batch, 0.3)) < TOL[dtype] / 2 + 1e-6
    assert rel_err(split, single) < (1e-6 if dtype == torch.float32 else 1e-2)


# ------------------------------------------------------------- sliding windows and soft-caps

# (window, softcap): Mistral-style window, Gemma 2's cap alone and both; windows shorter
# and longer than a block, and one longer than every context (no key hidden).
WINDOWED = [(5, 0.0), (16, 0.0), (0, 2.0), (7, 1.5), (500, 0.0)]
# Prefill chunks of prompts longer than the window (cached prefix past it), decodes far
# past it, a context inside it.
LONG = ([1, 12, 16, 1, 5, 30, 1], [1, 40, 20, 37, 70, 30, 90])


@pytest.mark.parametrize(("window", "softcap"), WINDOWED)
@pytest.mark.parametrize("lens", [LONG, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_window_softcap_matches_naive(window, softcap, lens, dtype, decode_path):
    batch = make_batch(12, *lens, 8, 2, dtype=dtype)
    ref = naive_attention(*batch, 0.3, window=window, softcap=softcap)
    got = paged_attention_torch(*batch, 0.3, window=window, softcap=softcap)
    assert rel_err(got, ref) < TOL[dtype]
    if window and window < 30:  # the window changes the answer: the test can fail
        assert rel_err(naive_attention(*batch, 0.3), ref) > 1e-2


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.lists(st.tuples(st.integers(1, 30), st.integers(0, 40)), min_size=1, max_size=4),
    window=st.integers(1, 40),
    softcap=st.sampled_from([0.0, 1.0, 5.0]),
    block_size=st.sampled_from([4, 16]),
    seed=st.integers(0, 2**16),
)
def test_torch_window_matches_naive_random(data, window, softcap, block_size, seed):
    q_lens = [q for q, _ in data]
    ctx = [q + prefix for q, prefix in data]
    batch = make_batch(seed, q_lens, ctx, 6, 2, head_dim=16, block_size=block_size)
    ref = naive_attention(*batch, 0.25, window=window, softcap=softcap)
    assert rel_err(paged_attention_torch(*batch, 0.25, window=window, softcap=softcap), ref) < 1e-5


def test_window_and_softcap_are_checked():
    batch = make_batch(5, [2, 1], [4, 9], 4, 2)
    with pytest.raises(ValueError, match="window"):
        paged_attention(*batch, 1.0, window=-1)
    with pytest.raises(ValueError, match="softcap"):
        paged_attention(*batch, 1.0, softcap=-2.0)


@pytest.mark.parametrize(("window", "softcap"), [(5, 0.0), (16, 0.0), (7, 1.5), (0, 2.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_window_softcap_matches_torch(interpreter, window, softcap, dtype):
    batch = make_batch(13, *LONG, 8, 2, dtype=dtype)
    ref = naive_attention(*batch, 0.3, window=window, softcap=softcap)
    got = paged_attention_triton(*batch, 0.3, window=window, softcap=softcap)
    assert rel_err(got, ref) < TOL[dtype] / 2 + 1e-6


@pytest.mark.parametrize("window", [5, 33])
def test_triton_window_small_tiles_and_splits(interpreter, tiled_triton_plan, window):
    """Windows that start mid-tile and mid-page, and split contexts whose slices lie wholly
    before the window (empty partial states the merge must ignore)."""
    batch = make_batch(14, [3, 21, 2], [3, 60, 25], 6, 2, head_dim=24, block_size=12)
    q, kc, _, bt, qsl, sl = batch
    plan = tiled_triton_plan(q, kc, bt, qsl, sl, block_m=16, block_n=16)
    ref = naive_attention(*batch, 0.4, window=window, softcap=3.0)
    assert (
        rel_err(paged_attention_triton(*batch, 0.4, plan=plan, window=window, softcap=3.0), ref)
        < 1e-5
    )
    dec = make_batch(15, [1] * 4, [1, 40, 16, 75], 8, 2)
    q, kc, _, bt, qsl, sl = dec
    split = tiled_triton_plan(q, kc, bt, qsl, sl, block_n=16, num_splits=4)
    assert split.impl.num_splits == 4
    assert (
        rel_err(
            paged_attention_triton(*dec, 0.3, plan=split, window=window),
            naive_attention(*dec, 0.3, window=window),
        )
        < 1e-5
    )
