"""An int8 KV cache (``--kv-cache-dtype int8``) against plain torch: the write stores
``clamp(round(x / scale), -127, 127)`` (ties to even, as ``torch.round``); attention over
the int8 cache, in every path (torch, the native CPU kernel through its byte table,
Triton), equals attention over the dequantized cache (``float(code) * scale``) computed by
a plain dense reference."""

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
from pagemill.kernels.kv_quant import decode_table


def _ref_quant(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Written here from the definition, independent of `kv_quant.quantize`."""
    return torch.round(x.double() / scale).clamp(-127, 127).to(torch.int8)


def test_byte_table_is_twos_complement() -> None:
    """The native kernel's table maps each byte to the int8 it encodes."""
    lut = decode_table(torch.int8)
    want = [b - 256 if b >= 128 else b for b in range(256)]
    assert lut.tolist() == [float(w) for w in want]


def test_write_round_trip() -> None:
    torch.manual_seed(0)
    nb, bs, h, d = 4, 8, 2, 16
    kc = torch.zeros(nb, bs, h, d, dtype=torch.int8)
    vc = torch.zeros_like(kc)
    k = torch.randn(5, h, d, dtype=torch.bfloat16) * 3
    v = torch.randn(5, h, d, dtype=torch.bfloat16) * 3
    k[0, 0, 0] = 1e6  # saturates at 127
    k[0, 0, 1] = -1e6  # and at -127, never -128
    k[3, 1, :4] = torch.tensor([0.25, 0.75, -0.25, -0.75])  # ties at scale 0.5: 0, 2, -0, -2
    slots = torch.tensor([3, 9, -1, 31, 0])
    ks, vs = torch.tensor(0.5), torch.tensor(0.0625)
    write_kv_cache_torch(k, v, kc, vc, slots, ks, vs)
    flat_k, flat_v = kc.view(-1, h, d), vc.view(-1, h, d)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        assert torch.equal(flat_k[s], _ref_quant(k[i], 0.5))
        assert torch.equal(flat_v[s], _ref_quant(v[i], 0.0625))
    assert flat_k[3, 0, 0] == 127 and flat_k[3, 0, 1] == -127
    assert flat_k[31, 1, :4].tolist() == [0, 2, 0, -2]
    # Within half a step of the input where not saturated.
    back = flat_v[9].float() * 0.0625
    assert ((back - v[1].float()).abs() <= 0.0625 / 2 + 1e-6).all()


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


def _case(qlens: list[int], lens: list[int], dtype=torch.float32):
    torch.manual_seed(1)
    nb, bs, kvh, h, d = 24, 8, 2, 4, 32
    kc = torch.randint(-127, 128, (nb, bs, kvh, d), dtype=torch.int8)
    vc = torch.randint(-127, 128, (nb, bs, kvh, d), dtype=torch.int8)
    width = max(math.ceil(n / bs) for n in lens)
    tables = torch.stack([torch.randperm(nb)[:width] for _ in lens]).to(torch.int32)
    q = torch.randn(sum(qlens), h, d).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    return q, kc, vc, tables, qsl, torch.tensor(lens, dtype=torch.int32)


# Scales that make the codes span the usual K/V range (codes of +-127 times ~0.02).
KS, VS = 0.013, 0.021


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(("qlens", "lens"), [([1, 1, 1], [5, 40, 17]), ([1, 6, 1], [9, 30, 64])])
def test_attention_matches_dequantized_reference(
    native: bool, qlens: list[int], lens: list[int], monkeypatch
) -> None:
    if native and cpu_native.load() is None:
        pytest.skip("no native CPU kernel here")
    if not native:
        monkeypatch.setattr(cpu_native, "load", lambda: None)
    q, kc, vc, tables, qsl, seq_lens = _case(qlens, lens)
    ks, vs = torch.tensor(KS), torch.tensor(VS)
    out = paged_attention_torch(q, kc, vc, tables, qsl, seq_lens, 0.2, k_scale=ks, v_scale=vs)
    ref = _dense_ref(q, kc, vc, tables, lens, qlens, 0.2, KS, VS)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_native_kernel_serves_int8(monkeypatch) -> None:
    """The decode really runs in the native kernel (not a torch fallback): bf16 q over the
    int8 cache through the byte table, against the fp64 reference."""
    if cpu_native.load() is None:
        pytest.skip("no native CPU kernel here")
    calls = []
    real = cpu_native.paged_decode
    monkeypatch.setattr(
        cpu_native, "paged_decode", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    lens = [33, 7, 120]
    q, kc, vc, tables, qsl, seq_lens = _case([1, 1, 1], lens, torch.bfloat16)
    ks, vs = torch.tensor(KS), torch.tensor(VS)
    out = paged_attention_torch(q, kc, vc, tables, qsl, seq_lens, 0.2, k_scale=ks, v_scale=vs)
    assert calls, "the native kernel was not used for an int8 cache"
    ref = _dense_ref(q, kc, vc, tables, lens, [1, 1, 1], 0.2, KS, VS)
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=2e-2)


def test_triton_write_matches_torch(interpreter) -> None:
    """Byte-equal to the plain-torch reference: rounding, ties to even, saturation."""
    torch.manual_seed(2)
    nb, bs, h, d = 4, 8, 2, 16
    k = torch.randn(6, h, d) * 40
    v = torch.randn(6, h, d) * 40
    k[1, 1, 3] = -1e5
    k[2, 0, :8] = torch.tensor([0.25, 0.75, -0.25, -1.25, 63.25, 63.75, 1e-9, 0.0])
    v[3, 0, :4] = torch.tensor([127.9 * 0.5, -127.4 * 0.5, 1e30, -1e30])
    slots = torch.tensor([0, 5, 11, 17, 30, -1])
    ks, vs = torch.tensor(0.5), torch.tensor(0.5)
    caches = []
    for fn in (write_kv_cache_torch, write_kv_cache_triton):
        kc = torch.zeros(nb, bs, h, d, dtype=torch.int8)
        vc = torch.zeros_like(kc)
        fn(k, v, kc, vc, slots, ks, vs)
        caches.append((kc, vc))
    assert torch.equal(caches[0][0], caches[1][0])
    assert torch.equal(caches[0][1], caches[1][1])
    flat = caches[1][0].view(-1, h, d)
    assert torch.equal(flat[5], _ref_quant(k[1], 0.5))


def test_triton_encode_every_code_and_tie(interpreter) -> None:
    """Every code, every midpoint between neighbours (ties to even) and a hair either side."""
    vals = torch.arange(-127, 128, dtype=torch.float32)
    mids = vals[:-1] + 0.5
    x = torch.cat([vals, mids, mids.nextafter(vals[1:]), mids.nextafter(vals[:-1])])
    n = -(-x.numel() // 16) * 16
    x = torch.cat([x, torch.zeros(n - x.numel())]).view(-1, 1, 16)
    kc = torch.zeros(x.shape[0], 1, 1, 16, dtype=torch.int8)
    vc = torch.zeros_like(kc)
    slots = torch.arange(x.shape[0])
    write_kv_cache_triton(x, x, kc, vc, slots, torch.tensor(1.0), torch.tensor(1.0))
    assert torch.equal(kc.flatten(), _ref_quant(x, 1.0).flatten())


@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_attention_int8(interpreter, tiled_triton_plan, num_splits) -> None:
    qlens, lens = [1, 1, 1], [5, 40, 17]
    q, kc, vc, tables, qsl, seq_lens = _case(qlens, lens)
    ks, vs = torch.tensor(KS), torch.tensor(VS)
    plan = tiled_triton_plan(q, kc, tables, qsl, seq_lens, block_n=16, num_splits=num_splits)
    out = paged_attention_triton(
        q, kc, vc, tables, qsl, seq_lens, 0.2, plan=plan, k_scale=ks, v_scale=vs
    )
    ref = _dense_ref(q, kc, vc, tables, lens, qlens, 0.2, KS, VS)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_triton_attention_int8_prefill(interpreter) -> None:
    qlens, lens = [1, 6, 3], [9, 30, 20]
    q, kc, vc, tables, qsl, seq_lens = _case(qlens, lens)
    ks, vs = torch.tensor(KS), torch.tensor(VS)
    out = paged_attention_triton(q, kc, vc, tables, qsl, seq_lens, 0.2, k_scale=ks, v_scale=vs)
    ref = _dense_ref(q, kc, vc, tables, lens, qlens, 0.2, KS, VS)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
