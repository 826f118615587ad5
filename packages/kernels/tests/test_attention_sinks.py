"""Attention sinks (gpt-oss) in every attention path against a dense float64 reference.

The reference is transformers' eager gpt-oss attention written out: the sink's logit is
concatenated as one more column of the scores, the softmax runs over all of them and the
sink's column is dropped. Each path runs with and without sinks and windows: the torch
paths (whole-block SDPA, GEMM and native decodes, masked prefill), the Triton kernel in the
interpreter (one pass and split contexts), and the compiled-graph op.
"""

from __future__ import annotations

import pytest
import torch

import pagemill.kernels.attention_cpu as attention_cpu
from pagemill.kernels import (
    cpu_native,
    paged_attention,
    paged_attention_torch,
    paged_attention_triton,
    plan_attention,
)


def make_batch(seed, q_lens, ctx_lens, num_heads, num_kv_heads, head_dim=16, block_size=8,
               dtype=torch.float32):  # fmt: skip
    """Caches with each request's blocks scattered over a pool of random junk."""
    g = torch.Generator().manual_seed(seed)
    nblocks = [-(-c // block_size) for c in ctx_lens]
    pool = sum(nblocks) + 5
    perm = torch.randperm(pool, generator=g)
    tables = torch.randint(0, pool, (len(q_lens), max(nblocks) + 1), generator=g)
    used = 0
    for s, n in enumerate(nblocks):
        tables[s, :n] = perm[used : used + n]
        used += n
    shape = (pool, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    return q, k_cache, v_cache, tables.to(torch.int32), qsl, torch.tensor(ctx_lens).int()


def reference(q, k_cache, v_cache, tables, qsl, seq_lens, scale, window=0, sinks=None):
    out = torch.zeros(q.shape, dtype=torch.float64)
    bs = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    for s in range(tables.shape[0]):
        a, b, ctx = int(qsl[s]), int(qsl[s + 1]), int(seq_lens[s])
        pos = torch.arange(ctx)
        blk = tables[s, pos // bs].long()
        k = k_cache[blk, pos % bs].double().repeat_interleave(group, 1)
        v = v_cache[blk, pos % bs].double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[a:b].double(), k) * scale
        q_pos = torch.arange(ctx - (b - a), ctx)
        hidden = pos[None, None, :] > q_pos[None, :, None]
        if window:
            hidden |= pos[None, None, :] <= q_pos[None, :, None] - window
        scores.masked_fill_(hidden, float("-inf"))
        if sinks is not None:
            col = sinks.double().view(-1, 1, 1).expand(-1, b - a, 1)
            probs = torch.cat([scores, col], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[a:b] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


HEADS, KV_HEADS = 6, 2
# Sinks large enough to take most of some heads' weight, and very negative (no effect).
SINKS = torch.tensor([2.5, -1.0, 0.0, 4.0, -30.0, 1.0])
MIXED = ([1, 9, 16, 1, 4, 1], [1, 30, 16, 41, 20, 9])
DECODE = ([1] * 5, [1, 8, 17, 40, 25])
TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2}


@pytest.fixture(params=["native", "sdpa", "gemm"])
def decode_path(request, monkeypatch):
    if request.param == "native":
        if cpu_native.load() is None:
            pytest.skip("the native CPU kernel could not be built here")
    else:
        monkeypatch.setattr(cpu_native, "load", lambda: None)
    if request.param == "gemm":
        monkeypatch.setattr(attention_cpu, "_DECODE_SMALL_TOKENS", 0)
    return request.param


@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("lens", [MIXED, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_sinks_match_reference(window, lens, dtype, decode_path):
    batch = make_batch(1, *lens, HEADS, KV_HEADS, dtype=dtype)
    ref = reference(*batch, 0.4, window=window, sinks=SINKS)
    got = paged_attention_torch(*batch, 0.4, window=window, sinks=SINKS)
    assert rel_err(got, ref) < TOL[dtype]
    # The sinks change the answer, so the comparison can fail.
    assert rel_err(reference(*batch, 0.4, window=window), ref) > 5e-2
    # Without sinks the same call is the plain attention (other models are unaffected).
    plain = paged_attention_torch(*batch, 0.4, window=window)
    assert rel_err(plain, reference(*batch, 0.4, window=window)) < TOL[dtype]


def test_sinks_in_model_dtype_are_read_as_fp32():
    batch = make_batch(2, *MIXED, HEADS, KV_HEADS)
    ref = reference(*batch, 0.4, sinks=SINKS.bfloat16().float())
    assert rel_err(paged_attention(*batch, 0.4, sinks=SINKS.bfloat16()), ref) < TOL[torch.float32]


def test_bad_sinks_are_refused():
    batch = make_batch(3, [1, 2], [4, 9], HEADS, KV_HEADS)
    with pytest.raises(ValueError, match="one float per query head"):
        paged_attention(*batch, 1.0, sinks=torch.zeros(KV_HEADS))
    with pytest.raises(ValueError, match="one float per query head"):
        paged_attention(*batch, 1.0, sinks=torch.zeros(HEADS, dtype=torch.int64))


@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("lens", [MIXED, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_sinks_match_reference(interpreter, window, lens, dtype):
    batch = make_batch(4, *lens, HEADS, KV_HEADS, dtype=dtype)
    ref = reference(*batch, 0.4, window=window, sinks=SINKS)
    got = paged_attention_triton(*batch, 0.4, window=window, sinks=SINKS)
    assert rel_err(got, ref) < (1e-5 if dtype == torch.float32 else TOL[dtype])


@pytest.mark.parametrize("window", [0, 5])
def test_triton_sinks_with_split_contexts(interpreter, tiled_triton_plan, window):
    """The sink counts once across context slices (some empty before the window)."""
    batch = make_batch(5, [1] * 4, [1, 40, 16, 75], HEADS, KV_HEADS)
    q, kc, _, bt, qsl, sl = batch
    plan = tiled_triton_plan(q, kc, bt, qsl, sl, block_n=16, num_splits=4)
    assert plan.impl.num_splits > 2
    ref = reference(*batch, 0.4, window=window, sinks=SINKS)
    got = paged_attention_triton(*batch, 0.4, plan=plan, window=window, sinks=SINKS)
    assert rel_err(got, ref) < 1e-5


def test_compiled_op_passes_sinks(decode_path):
    """The graph's opaque op (and its native decode fast path) applies the sinks."""
    from pagemill.kernels import ops

    if not ops.COMPILE_READY:
        pytest.skip("this torch cannot pass the plan through a graph")
    for lens in (DECODE, MIXED):
        batch = make_batch(6, *lens, HEADS, KV_HEADS)
        q, kc, vc, bt, qsl, sl = batch
        plan = plan_attention(
            qsl, sl, bt, k_cache_shape=tuple(kc.shape), num_heads=HEADS, dtype=q.dtype
        )
        got = torch.ops.pagemill.paged_attention(q, kc, vc, plan, 0.4, 6, 0.0, None, None, SINKS)
        assert rel_err(got, reference(*batch, 0.4, window=6, sinks=SINKS)) < 1e-5
