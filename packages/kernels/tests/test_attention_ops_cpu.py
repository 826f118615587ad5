"""The CPU decode kernel and KV write as C++ torch operators (`cpu_native.load_attention_ops`):
their schemas and fake kernels (what a compiled graph sees), and the write's slot handling."""

from __future__ import annotations

import pytest
import torch

from pagemill.kernels import cpu_native


@pytest.fixture(scope="module", autouse=True)
def ops():
    if not cpu_native.load_attention_ops():
        pytest.skip("the C++ operators could not be built here (no C++ compiler?)")


def _case(dtype=torch.bfloat16, n=5, blocks=12):
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(blocks, 16, 3, 64, generator=g).to(dtype)
    vc = torch.randn(blocks, 16, 3, 64, generator=g).to(dtype)
    q = torch.randn(n, 9, 64, generator=g).to(dtype)
    tables = torch.randperm(blocks, generator=g)[: n * 2].to(torch.int32).view(n, 2)
    lens = torch.randint(1, 33, (n,), generator=g, dtype=torch.int32)
    return q, kc, vc, tables, lens


def test_paged_decode_ops_pass_opcheck():
    q, kc, vc, tables, lens = _case()
    args = (q, kc, vc, tables, lens, None, 0.125, 0, 0.0, None, None, None)
    torch.library.opcheck(torch.ops.pagemill_native.paged_decode.default, args)
    out = torch.empty_like(q)
    torch.library.opcheck(torch.ops.pagemill_native.paged_decode_out.default, (*args, out))


def test_paged_decode_is_paged_decode_out():
    q, kc, vc, tables, lens = _case()
    rows = torch.tensor([4, 0, 2, 1, 3])
    got = torch.ops.pagemill_native.paged_decode(q, kc, vc, tables, lens, rows, 0.125, 5, 2.0)
    out = torch.full_like(q, float("nan"))
    torch.ops.pagemill_native.paged_decode_out(
        q, kc, vc, tables, lens, rows, 0.125, 5, 2.0, None, None, None, out
    )
    assert not out.isnan().any()
    assert torch.equal(got, out)


def test_paged_decode_refuses_what_it_cannot_serve():
    q, kc, vc, tables, lens = _case()
    with pytest.raises(ValueError, match="int32 tables"):
        torch.ops.pagemill_native.paged_decode(q, kc, vc, tables.long(), lens, None, 0.1)
    with pytest.raises(ValueError, match="cannot serve"):
        torch.ops.pagemill_native.paged_decode(q.float(), kc, vc, tables, lens, None, 0.1)


def test_paged_decode_compiles_as_one_opaque_call():
    q, kc, vc, tables, lens = _case()

    def f(q, kc, vc, tables, lens):
        return torch.ops.pagemill_native.paged_decode(q * 2, kc, vc, tables, lens, None, 0.125) + 1

    want = f(q, kc, vc, tables, lens)
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(q, kc, vc, tables, lens)
    assert torch.equal(got, want)


def _write_case(slot_dtype):
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(6, 9 * 64 + 2 * 3 * 64, generator=g).to(torch.bfloat16)
    _, k, v = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)  # strided rows, as a model gives them
    k, v = k.reshape(6, 3, 64), v.reshape(6, 3, 64)
    kc = torch.zeros(4, 16, 3, 64, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([3, -1, 17, 63, 0, 40], dtype=slot_dtype)
    return k, v, kc, vc, slots


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_write_kv_cache_op_writes_its_slots_and_skips_minus_one(slot_dtype):
    k, v, kc, vc, slots = _write_case(slot_dtype)
    torch.ops.pagemill_native.write_kv_cache(k, v, kc, vc, slots)
    want_k, want_v = torch.zeros_like(kc).view(64, 3, 64), torch.zeros_like(vc).view(64, 3, 64)
    keep = slots >= 0
    want_k[slots[keep].long()] = k[keep]
    want_v[slots[keep].long()] = v[keep]
    assert torch.equal(kc.view(64, 3, 64), want_k)
    assert torch.equal(vc.view(64, 3, 64), want_v)


def test_write_kv_cache_op_refuses_a_slot_outside_and_writes_nothing():
    k, v, kc, vc, slots = _write_case(torch.int64)
    slots[4] = 64
    with pytest.raises(ValueError, match="outside the cache"):
        torch.ops.pagemill_native.write_kv_cache(k, v, kc, vc, slots)
    assert not kc.any() and not vc.any()


def test_write_kv_cache_op_passes_opcheck():
    k, v, kc, vc, slots = _write_case(torch.int64)
    torch.library.opcheck(torch.ops.pagemill_native.write_kv_cache.default, (k, v, kc, vc, slots))
