"""An fp8 KV cache against plain torch: the write quantizes as ``(x / scale)`` saturated
and cast by torch's own float8 conversion; attention over the fp8 cache equals attention
over the dequantized cache (``float(x_fp8) * scale``) computed by a plain dense reference."""

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

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _ref_quant(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    m = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-m, m).to(dtype)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


@pytest.mark.parametrize("fp8", FP8)
def test_write_round_trip(fp8: torch.dtype) -> None:
    torch.manual_seed(0)
    nb, bs, h, d = 4, 8, 2, 16
    kc = torch.zeros(nb, bs, h, d, dtype=fp8)
    vc = torch.zeros(nb, bs, h, d, dtype=fp8)
    k = torch.randn(5, h, d, dtype=torch.bfloat16) * 3
    v = torch.randn(5, h, d, dtype=torch.bfloat16) * 3
    k[0, 0, 0] = 1e6  # saturates, never inf/NaN
    slots = torch.tensor([3, 9, -1, 31, 0])
    ks, vs = torch.tensor(0.5), torch.tensor(2.0)
    write_kv_cache_torch(k, v, kc, vc, slots, ks, vs)
    flat_k, flat_v = kc.view(-1, h, d), vc.view(-1, h, d)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        assert torch.equal(_bytes(flat_k[s]), _bytes(_ref_quant(k[i], 0.5, fp8)))
        assert torch.equal(_bytes(flat_v[s]), _bytes(_ref_quant(v[i], 2.0, fp8)))
    assert torch.isfinite(flat_k.float()).all()
    assert flat_k[3, 0, 0].float() == torch.finfo(fp8).max
    # The read back (dequantized) is within the format's relative step of the input.
    back = flat_k[9].float() * 0.5
    rel = 2.0 ** -(3 if fp8 == torch.float8_e4m3fn else 2)
    err = (back - k[1].float()).abs()
    assert (err <= rel * k[1].float().abs() + 1e-2).all()


def _dense_ref(q, kc, vc, tables, lens, qlens, scale, ks, vs):
    """Per request: dequantize its blocks and run causal attention in fp64."""
    outs = []
    start = 0
    bs = kc.shape[1]
    for s in range(len(lens)):
        ctx, ql = lens[s], qlens[s]
        blocks = tables[s, : math.ceil(ctx / bs)]
        k = (kc[blocks].double() * ks).reshape(-1, *kc.shape[2:])[:ctx]
        v = (vc[blocks].double() * vs).reshape(-1, *vc.shape[2:])[:ctx]
        qs = q[start : start + ql].double()
        g = q.shape[1] // kc.shape[2]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        sc = torch.einsum("qhd,khd->hqk", qs, k) * scale
        qpos = torch.arange(ctx - ql, ctx)[:, None]
        sc = sc.masked_fill(torch.arange(ctx)[None] > qpos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", sc.softmax(-1), v))
        start += ql
    return torch.cat(outs)


def _case(fp8: torch.dtype, qlens: list[int], lens: list[int], dtype=torch.float32):
    torch.manual_seed(1)
    nb, bs, kvh, h, d = 24, 8, 2, 4, 32
    kc = (torch.randn(nb, bs, kvh, d) * 2).to(fp8)
    vc = (torch.randn(nb, bs, kvh, d) * 2).to(fp8)
    width = max(math.ceil(n / bs) for n in lens)
    tables = torch.stack([torch.randperm(nb)[:width] for _ in lens]).to(torch.int32)
    q = torch.randn(sum(qlens), h, d).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    return q, kc, vc, tables, qsl, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(("qlens", "lens"), [([1, 1, 1], [5, 40, 17]), ([1, 6, 1], [9, 30, 64])])
def test_attention_matches_dequantized_reference(
    fp8: torch.dtype, native: bool, qlens: list[int], lens: list[int], monkeypatch
) -> None:
    if native and cpu_native.load() is None:
        pytest.skip("no native CPU kernel here")
    if not native:
        monkeypatch.setattr(cpu_native, "load", lambda: None)
    q, kc, vc, tables, qsl, seq_lens = _case(fp8, qlens, lens)
    ks, vs = torch.tensor(0.7), torch.tensor(1.3)
    out = paged_attention_torch(q, kc, vc, tables, qsl, seq_lens, 0.2, k_scale=ks, v_scale=vs)
    ref = _dense_ref(q, kc, vc, tables, lens, qlens, 0.2, 0.7, 1.3)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("fp8", FP8)
def test_native_bf16_query_over_fp8_cache(fp8: torch.dtype) -> None:
    if cpu_native.load() is None:
        pytest.skip("no native CPU kernel here")
    lens = [33, 7, 120]
    q, kc, vc, tables, qsl, seq_lens = _case(fp8, [1, 1, 1], lens, torch.bfloat16)
    ks, vs = torch.tensor(0.25), torch.tensor(4.0)
    out = paged_attention_torch(q, kc, vc, tables, qsl, seq_lens, 0.2, k_scale=ks, v_scale=vs)
    ref = _dense_ref(q, kc, vc, tables, lens, [1, 1, 1], 0.2, 0.25, 4.0)
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("fp8", FP8)
def test_triton_write_matches_torch(interpreter, fp8: torch.dtype) -> None:
    """Byte-equal to torch's cast: rounding (ties included), subnormals, saturation."""
    torch.manual_seed(2)
    nb, bs, h, d = 4, 8, 2, 16
    k = torch.randn(6, h, d) * 4
    v = torch.randn(6, h, d) * 4
    k[1, 1, 3] = -1e5
    k[2, 0, :8] = torch.tensor([1e-3, -2e-3, 2.0**-10, 3 * 2.0**-11, -7.83, 7.99, 5e-6, 0.0])
    v[3, 0, :4] = torch.tensor([2.0**-17, 2.0**-15 * 1.5, -1e-4, 448.1])
    slots = torch.tensor([0, 5, 11, 17, 30, -1])
    ks, vs = torch.tensor(0.5), torch.tensor(3.0)
    caches = []
    for fn in (write_kv_cache_torch, write_kv_cache_triton):
        kc = torch.zeros(nb, bs, h, d, dtype=fp8)
        vc = torch.zeros(nb, bs, h, d, dtype=fp8)
        fn(k, v, kc, vc, slots, ks, vs)
        caches.append((kc.view(torch.uint8), vc.view(torch.uint8)))
    assert torch.equal(caches[0][0], caches[1][0])
    assert torch.equal(caches[0][1], caches[1][1])


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_attention_fp8(interpreter, tiled_triton_plan, fp8: torch.dtype, num_splits) -> None:
    qlens, lens = [1, 1, 1], [5, 40, 17]
    q, kc, vc, tables, qsl, seq_lens = _case(fp8, qlens, lens)
    ks, vs = torch.tensor(0.7), torch.tensor(1.3)
    plan = tiled_triton_plan(q, kc, tables, qsl, seq_lens, block_n=16, num_splits=num_splits)
    out = paged_attention_triton(
        q, kc, vc, tables, qsl, seq_lens, 0.2, plan=plan, k_scale=ks, v_scale=vs
    )
    ref = _dense_ref(q, kc, vc, tables, lens, qlens, 0.2, 0.7, 1.3)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("fp8", FP8)
def test_triton_attention_fp8_prefill(interpreter, fp8: torch.dtype) -> None:
    qlens, lens = [1, 6, 3], [9, 30, 20]
    q, kc, vc, tables, qsl, seq_lens = _case(fp8, qlens, lens)
    ks, vs = torch.tensor(0.7), torch.tensor(1.3)
    out = paged_attention_triton(q, kc, vc, tables, qsl, seq_lens, 0.2, k_scale=ks, v_scale=vs)
    ref = _dense_ref(q, kc, vc, tables, lens, qlens, 0.2, 0.7, 1.3)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("fp8", FP8)
def test_triton_encode_every_value_and_tie(interpreter, fp8: torch.dtype) -> None:
    """Every finite fp8 value, every midpoint between neighbours (ties to even) and a hair
    either side, through the Triton write, byte-equal to torch's cast."""
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).float()
    vals = vals[torch.isfinite(vals)].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    x = torch.cat([vals, mids, mids.nextafter(vals[1:]), mids.nextafter(vals[:-1])])
    n = -(-x.numel() // 16) * 16
    x = torch.cat([x, torch.zeros(n - x.numel())]).view(-1, 1, 16)
    kc = torch.zeros(x.shape[0], 1, 1, 16, dtype=fp8)
    vc = torch.zeros_like(kc)
    slots = torch.arange(x.shape[0])
    write_kv_cache_triton(x, x, kc, vc, slots, torch.tensor(1.0), torch.tensor(1.0))
    assert torch.equal(_bytes(kc).flatten(), _bytes(_ref_quant(x, 1.0, fp8)).flatten())
