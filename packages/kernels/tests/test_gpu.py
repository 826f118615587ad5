"""The compiled Triton kernels on a real GPU against the torch paths (skipped without CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

import pagemill.kernels as K

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        reason="needs a CUDA device and compiled (not interpreted) Triton",
    ),
]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def batch(q_lens, ctx_lens, heads, kv_heads, head_dim, dtype, block_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    nblocks = [-(-c // block_size) for c in ctx_lens]
    pool = sum(nblocks) + 3
    perm = torch.randperm(pool, generator=g)
    tables = torch.zeros(len(q_lens), max(nblocks) + 1, dtype=torch.int32)
    used = 0
    for s, n in enumerate(nblocks):
        tables[s, :n] = perm[used : used + n]
        used += n
    kc = torch.randn(pool, block_size, kv_heads, head_dim, generator=g).to(dtype)
    vc = torch.randn(pool, block_size, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(dtype)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    cpu = (q, kc, vc, tables, qsl, torch.tensor(ctx_lens, dtype=torch.int32))
    return cpu, tuple(t.cuda() for t in cpu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(32, 8, 128), (9, 3, 64), (4, 4, 80)])
def test_paged_attention(tiled_triton_plan, dtype, heads, kv_heads, head_dim):
    q_lens = [1, 1, 300, 17, 1, 64]
    ctx = [1, 2000, 300, 40, 513, 700]
    cpu, gpu = batch(q_lens, ctx, heads, kv_heads, head_dim, dtype)
    ref = K.paged_attention_torch(*(t.float() if t.is_floating_point() else t for t in cpu), 0.1)
    tol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    assert rel_err(K.paged_attention(*gpu, 0.1).cpu(), ref) < tol
    dec_cpu, dec_gpu = batch([1] * 5, [1, 4000, 17, 900, 64], heads, kv_heads, head_dim, dtype)
    dref = K.paged_attention_torch(
        *(t.float() if t.is_floating_point() else t for t in dec_cpu), 0.1
    )
    q, kc, _, bt, qsl, sl = dec_gpu
    for splits in (1, 7):
        plan = tiled_triton_plan(q, kc, bt, qsl, sl, num_splits=splits)
        assert plan.impl.num_splits == splits
        out = K.paged_attention(*dec_gpu, 0.1, plan=plan)
        assert rel_err(out.cpu(), dref) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 128])
def test_paged_attention_sinks(tiled_triton_plan, dtype, window):
    """gpt-oss-20b's heads (64 x 64, GQA 8): attention sinks, with and without its sliding
    window, one pass and split contexts, against the CPU torch path (itself checked against
    a dense reference in test_attention_sinks)."""
    heads, kv_heads, head_dim = 64, 8, 64
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(3)) * 2
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for q_lens, ctx in (([1, 300, 17, 1], [2000, 300, 40, 513]), ([1] * 4, [1, 3000, 17, 900])):
        cpu, gpu = batch(q_lens, ctx, heads, kv_heads, head_dim, dtype)
        ref = K.paged_attention_torch(
            *(t.float() if t.is_floating_point() else t for t in cpu),
            0.125,
            window=window,
            sinks=sinks,
        )
        q, kc, _, bt, qsl, sl = gpu
        for splits in (1, 5) if q_lens == [1] * 4 else (1,):
            plan = tiled_triton_plan(q, kc, bt, qsl, sl, num_splits=splits)
            out = K.paged_attention(*gpu, 0.125, plan=plan, window=window, sinks=sinks.cuda())
            assert rel_err(out.cpu(), ref) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_ops(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 576, generator=g).to(dtype)
    r = torch.randn(37, 576, generator=g).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for got, ref in zip(
        K.rms_norm(x.cuda(), w.cuda(), 1e-5, r.cuda()), K.rms_norm_torch(x, w, 1e-5, r)
    ):
        assert rel_err(got.cpu(), ref) < tol
    y = torch.randn(37, 2 * 1536, generator=g).to(dtype)
    assert rel_err(K.silu_and_mul(y.cuda()).cpu(), K.silu_and_mul_torch(y)) < tol
    q = torch.randn(37, 9, 64, generator=g).to(dtype)
    k = torch.randn(37, 3, 64, generator=g).to(dtype)
    pos = torch.randint(0, 8192, (37,), generator=g)
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
    for scaling in (llama3, yarn):  # yarn: cos/sin scaled by its attention factor
        table = K.rope_cos_sin(64, 8192, 500000.0, scaling)
        for got, ref in zip(
            K.apply_rotary(pos.cuda(), q.cuda(), k.cuda(), table.cuda()),
            K.apply_rotary_torch(pos, q, k, table),
        ):
            assert rel_err(got.cpu(), ref) < tol
    kc = torch.zeros(8, 16, 3, 64, dtype=dtype)
    slots = torch.randperm(128, generator=g)[:37]
    slots[::5] = -1
    kc_gpu, vc_gpu = kc.cuda(), kc.clone().cuda()
    K.write_kv_cache(k.cuda(), k.cuda(), kc_gpu, vc_gpu, slots.cuda())
    K.write_kv_cache_torch(k, k, kc, kc.clone(), slots)
    assert torch.equal(kc_gpu.cpu(), kc)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_fused_moe(dtype, tokens):
    """Qwen3-30B-A3B's expert shapes (fewer experts): the grouped-GEMM kernel against the
    sorted CPU path in fp32, at decode and prefill token counts (both block sizes)."""
    g = torch.Generator().manual_seed(2)
    h, inter, e, k = 2048, 768, 16, 8
    x = torch.randn(tokens, h, generator=g)
    w13 = torch.randn(e, 2 * inter, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, inter, generator=g) / inter**0.5
    weights, ids = K.topk_softmax(torch.randn(tokens, e, generator=g), k, renormalize=True)
    ref = K.fused_moe_torch(x, w13, w2, weights, ids)
    got = K.fused_moe(
        x.to(dtype).cuda(), w13.to(dtype).cuda(), w2.to(dtype).cuda(), weights.cuda(), ids.cuda()
    )
    assert got.dtype == dtype
    assert rel_err(got.float().cpu(), ref) < (1e-4 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 300])
def test_fused_moe_gpt_oss(dtype, tokens):
    """gpt-oss-20b's expert shapes (fewer experts): expert biases, the clamped SwiGLU and
    the top-k-then-softmax router, grouped-GEMM kernel against the CPU path in fp32."""
    g = torch.Generator().manual_seed(4)
    h, inter, e, k = 2880, 2880, 8, 4
    x = torch.randn(tokens, h, generator=g)
    w13 = torch.randn(e, 2 * inter, h, generator=g) / h**0.5 * 3
    w2 = torch.randn(e, h, inter, generator=g) / inter**0.5
    b13 = torch.randn(e, 2 * inter, generator=g)
    b2 = torch.randn(e, h, generator=g)
    weights, ids = K.topk_then_softmax(torch.randn(tokens, e, generator=g), k)
    ref = K.fused_moe_torch(x, w13, w2, weights, ids, b13, b2, "swigluoai")
    args = (x, w13, w2, weights, ids, b13, b2)
    got = K.fused_moe(
        *(t.to(dtype).cuda() if t.is_floating_point() and t is not weights else t.cuda()
          for t in args),
        "swigluoai",
    )  # fmt: skip
    assert got.dtype == dtype
    assert rel_err(got.float().cpu(), ref) < (1e-4 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_kv_cache(fp8, dtype):
    """--kv-cache-dtype fp8: the compiled write is byte-equal to torch's saturating cast,
    and attention over the fp8 cache (decode with context splits, prefill) matches the
    torch path on the same bytes."""
    g = torch.Generator().manual_seed(5)
    k = torch.randn(53, 8, 128, generator=g).to(dtype) * 3
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 1e-6, -0.0]).to(dtype)
    slots = torch.randperm(16 * 16, generator=g)[:53]
    slots[::7] = -1
    ks, vs = torch.tensor(0.5), torch.tensor(2.0)
    kc = torch.zeros(16, 16, 8, 128, dtype=fp8)
    vc = torch.zeros_like(kc)
    kc_gpu, vc_gpu = kc.cuda(), vc.cuda()
    K.write_kv_cache(k.cuda(), k.cuda(), kc_gpu, vc_gpu, slots.cuda(), ks.cuda(), vs.cuda())
    K.write_kv_cache_torch(k, k, kc, vc, slots, ks, vs)
    assert torch.equal(kc_gpu.cpu().view(torch.uint8), kc.view(torch.uint8))
    assert torch.equal(vc_gpu.cpu().view(torch.uint8), vc.view(torch.uint8))
    for q_lens, ctx in (([1] * 6, [4000, 17, 900, 2048, 1, 333]), ([300, 1, 64], [700, 50, 64])):
        cpu, gpu = batch(q_lens, ctx, 32, 8, 128, dtype)
        q, kc, vc, *meta = cpu
        kc8, vc8 = (kc * 4).to(fp8), vc.to(fp8)
        ref = K.paged_attention_torch(q, kc8, vc8, *meta, 0.09, k_scale=ks, v_scale=vs)
        qg, _, _, *meta_g = gpu
        got = K.paged_attention(
            qg, kc8.cuda(), vc8.cuda(), *meta_g, 0.09, k_scale=ks.cuda(), v_scale=vs.cuda()
        )
        assert rel_err(got.cpu(), ref) < 2e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_kv_cache(dtype):
    """--kv-cache-dtype int8: the compiled write is byte-equal to a plain-torch
    ``clamp(round(x / scale), -127, 127)`` (power-of-two scales, so the division is exact
    whatever the GPU's fp32 divide), and attention over the int8 codes (decode with context
    splits, prefill) matches the dense fp64 reference of ``code * scale``."""
    g = torch.Generator().manual_seed(6)
    k = torch.randn(53, 8, 128, generator=g).to(dtype) * 30
    k[0, 0, :6] = torch.tensor([1e4, -1e4, 0.25, 0.75, -0.25, -0.0]).to(dtype)
    slots = torch.randperm(16 * 16, generator=g)[:53]
    slots[::7] = -1
    ks, vs = torch.tensor(0.5), torch.tensor(0.25)
    kc = torch.zeros(16, 16, 8, 128, dtype=torch.int8)
    vc = torch.zeros_like(kc)
    kc_gpu, vc_gpu = kc.cuda(), vc.cuda()
    K.write_kv_cache(k.cuda(), k.cuda(), kc_gpu, vc_gpu, slots.cuda(), ks.cuda(), vs.cuda())
    keep = slots >= 0
    for cache, s in ((kc, 0.5), (vc, 0.25)):
        codes = torch.round(k[keep].double() / s).clamp(-127, 127).to(torch.int8)
        cache.view(-1, 8, 128)[slots[keep]] = codes
    assert torch.equal(kc_gpu.cpu(), kc)
    assert torch.equal(vc_gpu.cpu(), vc)
    kss, vss = 0.013, 0.021
    for q_lens, ctx in (([1] * 6, [4000, 17, 900, 2048, 1, 333]), ([300, 1, 64], [700, 50, 64])):
        cpu, gpu = batch(q_lens, ctx, 32, 8, 128, dtype)
        q, kc, vc, tables, qsl, lens = cpu
        kc8 = torch.randint(-127, 128, kc.shape, generator=g, dtype=torch.int8)
        vc8 = torch.randint(-127, 128, vc.shape, generator=g, dtype=torch.int8)
        ref = K.paged_attention_torch(
            q.float(),
            (kc8.double() * kss).float(),
            (vc8.double() * vss).float(),
            tables,
            qsl,
            lens,
            0.09,
        )
        qg, _, _, *meta_g = gpu
        got = K.paged_attention(
            qg,
            kc8.cuda(),
            vc8.cuda(),
            *meta_g,
            0.09,
            k_scale=torch.tensor(kss).cuda(),
            v_scale=torch.tensor(vss).cuda(),
        )
        assert rel_err(got.cpu().float(), ref) < 2e-2


@pytest.mark.parametrize("kv", [torch.float8_e4m3fn, torch.int8])
def test_per_head_kv_scales(kv):
    """One K/V scale per KV head (--kv-scales-per-head, attn_head checkpoints): the compiled
    write is byte-equal to the torch write, and attention (decode with context splits,
    prefill) matches the torch path on the same bytes and scales."""
    g = torch.Generator().manual_seed(7)
    k = torch.randn(53, 8, 128, generator=g).to(torch.bfloat16) * 3
    slots = torch.randperm(16 * 16, generator=g)[:53]
    slots[::7] = -1
    # Powers of two, far apart per head: exact division, and a mixed-up head shows.
    ks = 2.0 ** torch.arange(-6, 2, dtype=torch.float32)
    vs = ks.flip(0).contiguous()
    kc = torch.zeros(16, 16, 8, 128, dtype=kv)
    vc = torch.zeros_like(kc)
    kc_gpu, vc_gpu = kc.cuda(), vc.cuda()
    K.write_kv_cache(k.cuda(), k.cuda(), kc_gpu, vc_gpu, slots.cuda(), ks.cuda(), vs.cuda())
    K.write_kv_cache_torch(k, k, kc, vc, slots, ks, vs)
    assert torch.equal(kc_gpu.cpu().view(torch.uint8), kc.view(torch.uint8))
    assert torch.equal(vc_gpu.cpu().view(torch.uint8), vc.view(torch.uint8))
    for q_lens, ctx in (([1] * 6, [4000, 17, 900, 2048, 1, 333]), ([300, 1, 64], [700, 50, 64])):
        cpu, gpu = batch(q_lens, ctx, 32, 8, 128, torch.bfloat16)
        q, kc, vc, *meta = cpu
        if kv == torch.int8:
            kc8 = torch.randint(-127, 128, kc.shape, generator=g, dtype=torch.int8)
            vc8 = torch.randint(-127, 128, vc.shape, generator=g, dtype=torch.int8)
        else:
            kc8, vc8 = (kc * 4).to(kv), vc.to(kv)
        ref = K.paged_attention_torch(q, kc8, vc8, *meta, 0.09, k_scale=ks, v_scale=vs)
        qg, _, _, *meta_g = gpu
        got = K.paged_attention(
            qg, kc8.cuda(), vc8.cuda(), *meta_g, 0.09, k_scale=ks.cuda(), v_scale=vs.cuda()
        )
        assert rel_err(got.cpu(), ref) < 2e-2
