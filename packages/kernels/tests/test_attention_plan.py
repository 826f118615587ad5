"""The per-step attention plan: same results as planning per call, reusable across layers,
bad metadata refused when planning, and calls with a plan doing no planning at all."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pagemill.kernels.attention as attention
import pagemill.kernels.attention_cpu as attention_cpu
from pagemill.kernels import (
    AttentionPlan,
    cpu_native,
    paged_attention,
    paged_attention_torch,
    paged_attention_triton,
    plan_attention,
)
from pagemill.kernels.attention_cpu import TorchPlan
from pagemill.kernels.attention_triton import TritonPlan

GQA = [(4, 4), (9, 3), (8, 2)]


def make_batch(
    seed,
    q_lens,
    ctx_lens,
    num_heads,
    num_kv_heads,
    *,
    head_dim=16,
    block_size=8,
    dtype=torch.float32,
    layers=1,
):
    """Tables over a shuffled pool with junk padding, and ``layers`` caches of one shape."""
    g = torch.Generator().manual_seed(seed)
    nblocks = [-(-c // block_size) for c in ctx_lens]
    pool = sum(nblocks) + 5
    perm = torch.randperm(pool, generator=g)
    tables = torch.randint(
        -1, pool, (len(q_lens), max(nblocks, default=0) + 2), generator=g, dtype=torch.int32
    )
    used = 0
    for s, n in enumerate(nblocks):
        tables[s, :n] = perm[used : used + n]
        used += n
    shape = (pool, block_size, num_kv_heads, head_dim)
    caches = [
        (torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
        for _ in range(layers)
    ]
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
    return q, caches, tables, qsl, torch.tensor(ctx_lens, dtype=torch.int32)


def host_plan(q, caches, tables, qsl, seq_lens, q_lens, ctx_lens, **kw) -> AttentionPlan:
    """A plan built the way the model runner builds it: host lengths as numpy arrays."""
    return plan_attention(
        qsl,
        seq_lens,
        tables,
        k_cache_shape=tuple(caches[0][0].shape),
        num_heads=q.shape[1],
        dtype=q.dtype,
        query_lens=np.array(q_lens),
        context_lens=np.array(ctx_lens),
        **kw,
    )


# Knobs of the CPU planner: default, GEMM path forced, length-sorted chunks forced.
CPU_KNOBS = [
    {"_DECODE_SMALL_TOKENS": attention_cpu._DECODE_SMALL_TOKENS},
    {"_DECODE_SMALL_TOKENS": 0},
    {"_DECODE_CHUNK_ELEMS": 40 * 2 * 16},
    {"_DECODE_SMALL_TOKENS": 0, "_DECODE_CHUNK_ELEMS": 40 * 2 * 16},
]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.lists(
        st.tuples(st.sampled_from([0, 1, 1, 1, 2, 7, 16]), st.integers(0, 60)),
        min_size=1,
        max_size=8,
    ),
    heads=st.sampled_from(GQA),
    block_size=st.sampled_from([4, 8, 16]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    knobs=st.sampled_from(CPU_KNOBS),
    seed=st.integers(0, 2**16),
)
def test_torch_plan_equals_no_plan(data, heads, block_size, dtype, knobs, seed):
    q_lens = [q for q, _ in data]
    ctx = [max(1, q + prefix) for q, prefix in data]
    q, caches, tables, qsl, seq_lens = make_batch(
        seed, q_lens, ctx, *heads, block_size=block_size, dtype=dtype
    )
    kc, vc = caches[0]
    # The default knobs run the native decode kernel where it was built; the others the
    # gather paths it replaces.
    native = cpu_native.load if knobs is CPU_KNOBS[0] else (lambda: None)
    with mock.patch.multiple(attention_cpu, **knobs), mock.patch.object(cpu_native, "load", native):
        ref = paged_attention_torch(q, kc, vc, tables, qsl, seq_lens, 0.3)
        from_host = host_plan(q, caches, tables, qsl, seq_lens, q_lens, ctx)
        from_tensors = plan_attention(
            qsl, seq_lens, tables, k_cache_shape=tuple(kc.shape), num_heads=q.shape[1], dtype=dtype
        )
    for plan in (from_host, from_tensors):
        assert plan.backend == "torch" and plan.num_tokens == sum(q_lens)
        got = paged_attention(
            q, kc, vc, plan.block_tables, plan.query_start_loc, plan.seq_lens, 0.3, plan=plan
        )
        assert torch.equal(got, ref)


def test_torch_plan_structure():
    """Decode chunks are length-sorted and bounded, prefill gets one segment per request."""
    q_lens, ctx = [1, 5, 1, 1, 3, 1], [60, 9, 4, 58, 3, 30]
    batch = make_batch(1, q_lens, ctx, 8, 2)
    with (
        mock.patch.object(attention_cpu, "_DECODE_CHUNK_ELEMS", 2 * 60 * 2 * 16),
        mock.patch.object(cpu_native, "load", lambda: None),
    ):
        plan = host_plan(*batch, q_lens, ctx)
    impl = plan.impl
    assert isinstance(impl, TorchPlan)
    # Decode rows of q are 0, 6, 7, 11 (contexts 60, 4, 58, 30): sorted 60, 58 | 30 | 4.
    assert [c.rows.tolist() for c in impl.decode] == [[0, 7], [11], [6]]
    assert [(c.max_len, c.mask is None) for c in impl.decode] == [
        (60, False),
        (30, True),
        (4, True),
    ]
    # Prefill: a 5-token query over a 9-token context (masked), a whole 3-token context (causal).
    assert [(s.start, s.stop, s.ctx, s.mask is None) for s in impl.prefill] == [
        (1, 6, 9, False),
        (8, 11, 3, True),
    ]
    assert impl.prefill[0].block_ids.tolist() == batch[2][1, :2].tolist()


def test_torch_plan_reused_across_layers():
    """One plan serves every layer's cache; each layer still reads its own K/V."""
    q_lens, ctx = [1, 1, 6, 1, 0, 3], [40, 7, 6, 25, 9, 20]
    q, caches, tables, qsl, seq_lens = make_batch(2, q_lens, ctx, 9, 3, layers=3)
    plan = host_plan(q, caches, tables, qsl, seq_lens, q_lens, ctx)
    outs = []
    for kc, vc in caches:
        out = torch.full_like(q, float("nan"))
        got = paged_attention_torch(q, kc, vc, tables, qsl, seq_lens, 0.25, out=out, plan=plan)
        assert got is out
        assert torch.equal(out, paged_attention_torch(q, kc, vc, tables, qsl, seq_lens, 0.25))
        outs.append(out)
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])


def test_calls_with_a_plan_do_no_planning():
    """With a plan, a layer's call never reads metadata or builds indices."""
    q_lens, ctx = [1, 4, 1], [12, 9, 30]
    q, caches, tables, qsl, seq_lens = make_batch(3, q_lens, ctx, 4, 2)
    kc, vc = caches[0]
    plan = host_plan(q, caches, tables, qsl, seq_lens, q_lens, ctx)
    ref = paged_attention_torch(q, kc, vc, tables, qsl, seq_lens, 0.5)
    forbidden = mock.Mock(side_effect=AssertionError("planned during a call"))
    with (
        mock.patch.object(attention, "plan_torch", forbidden),
        mock.patch.object(attention, "_host_lens", forbidden),
        mock.patch.object(torch.Tensor, "tolist", forbidden),
    ):
        assert torch.equal(paged_attention(q, kc, vc, tables, qsl, seq_lens, 0.5, plan=plan), ref)
        with pytest.raises(AssertionError, match="planned during a call"):
            paged_attention(q, kc, vc, tables, qsl, seq_lens, 0.5)


def test_empty_step_plans_nothing():
    q, caches, tables, qsl, seq_lens = make_batch(4, [0, 0], [3, 5], 4, 2)
    plan = host_plan(q, caches, tables, qsl, seq_lens, [0, 0], [3, 5])
    assert plan.impl is None and plan.num_tokens == 0
    kc, vc = caches[0]
    assert paged_attention(q, kc, vc, tables, qsl, seq_lens, 1.0, plan=plan).shape == (0, 4, 16)


def test_bad_metadata_is_refused_at_plan_time():
    _, caches, tables, qsl, seq_lens = make_batch(5, [2, 1], [4, 9], 4, 2)
    shape = tuple(caches[0][0].shape)

    def plan(qsl=qsl, seq_lens=seq_lens, tables=tables, **kw):
        kw = {"k_cache_shape": shape, "num_heads": 4, "dtype": torch.float32, **kw}
        return plan_attention(qsl, seq_lens, tables, **kw)

    with pytest.raises(ValueError, match="query_start_loc must rise from 0"):
        plan(qsl=torch.tensor([0, 3, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="query_start_loc must rise from 0"):
        plan(query_lens=np.array([3, -1]))
    with pytest.raises(ValueError, match=r"seq 0: 2 query tokens but seq_lens is 1"):
        plan(seq_lens=torch.tensor([1, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"seq 1: 1 query tokens but seq_lens is 0"):
        plan(context_lens=np.array([4, 0]))
    with pytest.raises(ValueError, match=r"a context of 99 tokens needs more than the 4 blocks"):
        plan(context_lens=[4, 99])
    with pytest.raises(ValueError, match="query_lens must hold num_seqs=2"):
        plan(query_lens=[1, 1, 1])
    with pytest.raises(ValueError, match="context_lens must hold num_seqs=2"):
        plan(context_lens=[4])
    with pytest.raises(ValueError, match=r"query_start_loc must be \[num_seqs \+ 1"):
        plan(qsl=qsl[:-1])
    with pytest.raises(ValueError, match="block_tables must be int32 or int64"):
        plan(tables=tables.float())
    with pytest.raises(ValueError, match="multiple"):
        plan(num_heads=5)
    with pytest.raises(ValueError, match="fp32/fp16/bf16"):
        plan(dtype=torch.float64)
    with pytest.raises(ValueError, match="backend"):
        plan(backend="cuda")


def test_call_must_match_its_plan():
    q, caches, tables, qsl, seq_lens = make_batch(6, [2, 1], [4, 9], 4, 2)
    kc, vc = caches[0]
    plan = host_plan(q, caches, tables, qsl, seq_lens, [2, 1], [4, 9])
    with pytest.raises(ValueError, match="the plan is for 3 tokens"):
        paged_attention(q[:2], kc, vc, tables, qsl, seq_lens, 1.0, plan=plan)
    with pytest.raises(ValueError, match=r"the plan is for 3 tokens of 4 heads in torch\.float32"):
        paged_attention(
            q.bfloat16(), kc.bfloat16(), vc.bfloat16(), tables, qsl, seq_lens, 1.0, plan=plan
        )
    with pytest.raises(ValueError, match="the caches are"):
        paged_attention(q, kc[:-1], vc[:-1], tables, qsl, seq_lens, 1.0, plan=plan)
    with pytest.raises(ValueError, match="must be the plan's"):
        paged_attention(q, kc, vc, tables[:, :1], qsl, seq_lens, 1.0, plan=plan)
    with pytest.raises(ValueError, match="a torch plan cannot run the triton path"):
        paged_attention_triton(q, kc, vc, tables, qsl, seq_lens, 1.0, plan=plan)


# ------------------------------------------------------------------ Triton under the interpreter

TRITON_BATCHES = [
    ([1, 1, 1, 1], [1, 40, 16, 33]),
    ([1, 5, 0, 17, 1, 3], [9, 5, 3, 30, 20, 3]),
]


@pytest.mark.parametrize("lens", TRITON_BATCHES, ids=["decode", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_plan_equals_no_plan_across_layers(interpreter, lens, dtype):
    q_lens, ctx = lens
    q, caches, tables, qsl, seq_lens = make_batch(7, q_lens, ctx, 8, 2, dtype=dtype, layers=2)
    plan = host_plan(q, caches, tables, qsl, seq_lens, q_lens, ctx, backend="triton")
    assert isinstance(plan.impl, TritonPlan) and plan.num_seqs == len(q_lens)
    for kc, vc in caches:
        ref = paged_attention_triton(q, kc, vc, tables, qsl, seq_lens, 0.3)
        got = paged_attention(q, kc, vc, tables, qsl, seq_lens, 0.3, plan=plan)
        assert torch.equal(got, ref)


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    data=st.lists(
        st.tuples(st.sampled_from([0, 1, 1, 3, 9]), st.integers(0, 30)), min_size=1, max_size=4
    ),
    heads=st.sampled_from(GQA),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_triton_plan_equals_no_plan_random(interpreter, data, heads, dtype, seed):
    q_lens = [q for q, _ in data]
    ctx = [max(1, q + prefix) for q, prefix in data]
    q, caches, tables, qsl, seq_lens = make_batch(seed, q_lens, ctx, *heads, dtype=dtype)
    kc, vc = caches[0]
    plan = host_plan(q, caches, tables, qsl, seq_lens, q_lens, ctx, backend="triton")
    ref = paged_attention_triton(q, kc, vc, tables, qsl, seq_lens, 0.3)
    assert torch.equal(
        paged_attention_triton(q, kc, vc, tables, qsl, seq_lens, 0.3, plan=plan), ref
    )


def test_triton_split_workspace_reused_across_layers(interpreter, tiled_triton_plan):
    """Layers share the plan's split workspace: a later layer's result is still its own."""
    q_lens, ctx = [1, 1, 1], [50, 3, 21]
    q, caches, tables, qsl, seq_lens = make_batch(8, q_lens, ctx, 4, 2, layers=2)
    plan = tiled_triton_plan(q, caches[0][0], tables, qsl, seq_lens, block_n=16, num_splits=3)
    assert plan.impl.num_splits == 3 and plan.impl.part_acc is not None
    outs = [paged_attention(q, kc, vc, tables, qsl, seq_lens, 0.3, plan=plan) for kc, vc in caches]
    for out, (kc, vc) in zip(outs, caches):
        fresh = tiled_triton_plan(q, kc, tables, qsl, seq_lens, block_n=16, num_splits=3)
        assert torch.equal(out, paged_attention(q, kc, vc, tables, qsl, seq_lens, 0.3, plan=fresh))
        ref = paged_attention_torch(q, kc, vc, tables, qsl, seq_lens, 0.3)
        assert ((out - ref).norm() / ref.norm()).item() < 1e-5
