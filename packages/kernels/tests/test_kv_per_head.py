"""Per-KV-head K/V scales (``k_scale``/``v_scale`` of shape [num_kv_heads]) against plain
torch: the write divides each head's rows by its own scale (fp8: saturating cast, int8:
round half to even and clamp to +-127), and attention in every path (torch, the native
CPU kernel, Triton in the interpreter) equals fp64 attention over the cache dequantized
head by head (``float(code) * scale[h]``). Heads get scales far apart (a factor of 64),
so a path that used one head's scale for another, or one scale for all, fails."""

from __future__ import annotations

import math

import pytest
import torch

from pagemill.kernels import (
    cpu_native,
    paged_attention_torch,
    paged_attention_triton,
    write_kv_cache_torch,
    write_kv_cache_triton,
)

KV_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]
# Per KV head: far apart, so any mix-up of heads shows (powers of two: exact division).
KS = [0.25, 0.0078125, 0.03125]
VS = [0.015625, 0.5, 0.0625]


def _ref_write(x: torch.Tensor, scales: list[float], dtype: torch.dtype) -> torch.Tensor:
    """Each head divided by its scale, from the definitions (independent of kv_quant)."""
    y = x.double() / torch.tensor(scales, dtype=torch.float64)[:, None]
    if dtype == torch.int8:
        return torch.round(y).clamp(-127, 127).to(torch.int8)
    limit = torch.finfo(dtype).max
    return y.clamp(-limit, limit).float().to(dtype)


def _write_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    heads = len(KS)
    k = torch.randn(7, heads, 16, generator=g) * torch.tensor([30.0, 1.0, 4.0])[:, None]
    v = torch.randn(7, heads, 16, generator=g) * torch.tensor([2.0, 60.0, 8.0])[:, None]
    k[2, 1, 0], v[4, 0, 1] = 1e6, -1e6  # saturate in the small-scale heads
    slots = torch.tensor([3, 9, -1, 31, 0, 17, 12])
    return k.to(torch.bfloat16), v.to(torch.bfloat16), slots


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_torch_write_per_head(kv: torch.dtype) -> None:
    k, v, slots = _write_inputs(0)
    kc = torch.zeros(4, 8, len(KS), 16, dtype=kv)
    vc = torch.zeros_like(kc)
    write_kv_cache_torch(k, v, kc, vc, slots, torch.tensor(KS), torch.tensor(VS))
    keep = slots >= 0
    got_k = kc.view(-1, len(KS), 16)[slots[keep]]
    got_v = vc.view(-1, len(KS), 16)[slots[keep]]
    bits = torch.int8 if kv == torch.int8 else torch.uint8
    assert torch.equal(got_k.view(bits), _ref_write(k[keep], KS, kv).view(bits))
    assert torch.equal(got_v.view(bits), _ref_write(v[keep], VS, kv).view(bits))


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_triton_write_per_head(interpreter, kv: torch.dtype) -> None:
    """The Triton write is byte-equal to the torch one (and so to the reference above)."""
    k, v, slots = _write_inputs(1)
    caches = []
    for fn in (write_kv_cache_torch, write_kv_cache_triton):
        kc = torch.zeros(4, 8, len(KS), 16, dtype=kv)
        vc = torch.zeros_like(kc)
        fn(k, v, kc, vc, slots, torch.tensor(KS), torch.tensor(VS))
        caches.append((kc.view(torch.uint8), vc.view(torch.uint8)))
    assert torch.equal(caches[0][0], caches[1][0])
    assert torch.equal(caches[0][1], caches[1][1])


def test_scale_shapes_refused() -> None:
    k = torch.zeros(2, 3, 16)
    kc = torch.zeros(4, 8, 3, 16, dtype=torch.int8)
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        write_kv_cache_torch(k, k, kc, kc, slots, torch.ones(2), torch.ones(2))
    with pytest.raises(ValueError, match="per KV head"):
        write_kv_cache_torch(k, k, kc, kc, slots, torch.ones(3, 1), torch.ones(3, 1))


def _case(qlens: list[int], lens: list[int], kv: torch.dtype, dtype=torch.float32):
    torch.manual_seed(3)
    nb, bs, kvh, h, d = 24, 8, len(KS), 6, 32
    if kv == torch.int8:
        kc = torch.randint(-127, 128, (nb, bs, kvh, d), dtype=torch.int8)
        vc = torch.randint(-127, 128, (nb, bs, kvh, d), dtype=torch.int8)
    else:
        kc = (torch.randn(nb, bs, kvh, d) * 8).to(kv)
        vc = (torch.randn(nb, bs, kvh, d) * 8).to(kv)
    width = max(math.ceil(n / bs) for n in lens)
    tables = torch.stack([torch.randperm(nb)[:width] for _ in lens]).to(torch.int32)
    q = torch.randn(sum(qlens), h, d).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    return q, kc, vc, tables, qsl, torch.tensor(lens, dtype=torch.int32)


def _dense_ref(q, kc, vc, tables, lens, qlens, scale):
    """Per request: its blocks dequantized head by head, causal attention in fp64."""
    ks = torch.tensor(KS, dtype=torch.float64)[:, None]
    vs = torch.tensor(VS, dtype=torch.float64)[:, None]
    outs, start, bs = [], 0, kc.shape[1]
    for s in range(len(lens)):
        ctx, ql = lens[s], qlens[s]
        blocks = tables[s, : math.ceil(ctx / bs)]
        k = kc[blocks].double().reshape(-1, *kc.shape[2:])[:ctx] * ks
        v = vc[blocks].double().reshape(-1, *vc.shape[2:])[:ctx] * vs
        g = q.shape[1] // kc.shape[2]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        sc = torch.einsum("qhd,khd->hqk", q[start : start + ql].double(), k) * scale
        qpos = torch.arange(ctx - ql, ctx)[:, None]
        sc = sc.masked_fill(torch.arange(ctx)[None] > qpos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", sc.softmax(-1), v))
        start += ql
    return torch.cat(outs)


CASES = [([1, 1, 1], [5, 40, 17]), ([1, 6, 1], [9, 30, 64])]


@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(("qlens", "lens"), CASES)
def test_torch_attention_per_head(native, kv, qlens, lens, monkeypatch) -> None:
    """The torch path (decode chunks, prefill SDPA) and, for the decodes, the native kernel."""
    if native and cpu_native.load() is None:
        pytest.skip("no native CPU kernel here")
    if not native:
        monkeypatch.setattr(cpu_native, "load", lambda: None)
    calls = []
    real = cpu_native.paged_decode
    monkeypatch.setattr(
        cpu_native, "paged_decode", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    q, kc, vc, tables, qsl, seq_lens = _case(qlens, lens, kv)
    ks, vs = torch.tensor(KS), torch.tensor(VS)
    out = paged_attention_torch(q, kc, vc, tables, qsl, seq_lens, 0.2, k_scale=ks, v_scale=vs)
    assert bool(calls) == native
    ref = _dense_ref(q, kc, vc, tables, lens, qlens, 0.2)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_torch_attention_per_head_layer_options(kv, monkeypatch) -> None:
    """The masked paths (a window covering the whole context, so the reference holds) and a
    bf16 query through the native kernel."""
    qlens, lens = [1, 6, 1], [9, 30, 64]
    q, kc, vc, tables, qsl, seq_lens = _case(qlens, lens, kv, torch.bfloat16)
    ks, vs = torch.tensor(KS), torch.tensor(VS)
    ref = _dense_ref(q, kc, vc, tables, lens, qlens, 0.2)
    for native in (True, False):
        if not native:
            monkeypatch.setattr(cpu_native, "load", lambda: None)
        out = paged_attention_torch(
            q, kc, vc, tables, qsl, seq_lens, 0.2, k_scale=ks, v_scale=vs, window=1000
        )
        torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_attention_per_head(interpreter, tiled_triton_plan, kv, num_splits) -> None:
    qlens, lens = [1, 1, 1], [5, 40, 17]
    q, kc, vc, tables, qsl, seq_lens = _case(qlens, lens, kv)
    plan = tiled_triton_plan(q, kc, tables, qsl, seq_lens, block_n=16, num_splits=num_splits)
    out = paged_attention_triton(
        q,
        kc,
        vc,
        tables,
        qsl,
        seq_lens,
        0.2,
        plan=plan,
        k_scale=torch.tensor(KS),
        v_scale=torch.tensor(VS),
    )
    ref = _dense_ref(q, kc, vc, tables, lens, qlens, 0.2)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_triton_attention_per_head_prefill(interpreter) -> None:
    qlens, lens = [1, 6, 3], [9, 30, 20]
    q, kc, vc, tables, qsl, seq_lens = _case(qlens, lens, torch.int8)
    out = paged_attention_triton(
        q, kc, vc, tables, qsl, seq_lens, 0.2, k_scale=torch.tensor(KS), v_scale=torch.tensor(VS)
    )
    ref = _dense_ref(q, kc, vc, tables, lens, qlens, 0.2)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
