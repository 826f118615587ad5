"""KV cache writes: torch path vs a per-token loop, Triton (interpreter) vs torch path."""

from __future__ import annotations

import pytest
import torch

from pagemill.kernels import write_kv_cache, write_kv_cache_torch, write_kv_cache_triton


def make(seed: int, num_tokens: int, dtype: torch.dtype, block_size: int = 16):
    g = torch.Generator().manual_seed(seed)
    num_blocks, kvh, d = 6, 3, 16
    k = torch.randn(num_tokens, kvh, d, generator=g).to(dtype)
    v = torch.randn(num_tokens, kvh, d, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens].to(torch.int32)
    slots[::4] = -1  # skipped tokens
    k_cache = torch.randn(num_blocks, block_size, kvh, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kvh, d, generator=g).to(dtype)
    return k, v, k_cache, v_cache, slots


def loop_reference(k, v, k_cache, v_cache, slots):
    kc, vc = k_cache.clone(), v_cache.clone()
    b = kc.shape[1]
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            kc[slot // b, slot % b] = k[t]
            vc[slot // b, slot % b] = v[t]
    return kc, vc


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 17, 40])
def test_torch_matches_loop(dtype, num_tokens):
    k, v, kc, vc, slots = make(num_tokens, num_tokens, dtype)
    ref_k, ref_v = loop_reference(k, v, kc, vc, slots)
    write_kv_cache_torch(k, v, kc, vc, slots)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_torch(interpreter, dtype):
    k, v, kc, vc, slots = make(1, 33, dtype, block_size=8)
    kc2, vc2 = kc.clone(), vc.clone()
    write_kv_cache_torch(k, v, kc, vc, slots)
    write_kv_cache_triton(k, v, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


def test_all_skipped_and_dispatch():
    k, v, kc, vc, slots = make(2, 5, torch.float32)
    before = kc.clone()
    write_kv_cache(k, v, kc, vc, torch.full_like(slots, -1))
    assert torch.equal(kc, before)
    write_kv_cache(k, v, kc, vc, slots.long())
    assert torch.equal(kc, loop_reference(k, v, before, vc, slots)[0])


def test_non_mergeable_cache_view():
    """A cache that is a strided view (e.g. one layer of a stacked array) is written in place."""
    k, v, kc, vc, slots = make(3, 9, torch.float32)
    stacked = torch.zeros(kc.shape[0], 2, *kc.shape[1:])
    view = stacked[:, 1]
    ref_k, _ = loop_reference(k, v, view, vc, slots)
    write_kv_cache_torch(k, v, view, vc.clone(), slots)
    assert torch.equal(stacked[:, 1], ref_k)


def test_bad_input_is_refused():
    k, v, kc, vc, slots = make(4, 8, torch.float32)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache_torch(k, v, kc, vc, slots[:-1])
    with pytest.raises(ValueError, match="outside"):
        write_kv_cache_torch(k, v, kc, vc, torch.full_like(slots, 10_000))
    with pytest.raises(ValueError, match="cache holds"):
        write_kv_cache_torch(k[:, :2], v[:, :2], kc, vc, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_cpu_write_matches_loop(dtype):
    """The native write (one call for K and V) against the per-token loop, with skipped
    slots and K/V rows that are views into a wider projection output (a token stride
    that is not the row's size)."""
    from pagemill.kernels.kv_cache import write_kv_cache_cpu_native

    k, v, kc, vc, slots = make(5, 37, dtype)
    wide = torch.randn(37, 3 * k.shape[1] * k.shape[2]).to(dtype)
    n = k.shape[1] * k.shape[2]
    wide[:, n : 2 * n] = k.reshape(37, -1)
    wide[:, 2 * n :] = v.reshape(37, -1)
    ks, vs = wide[:, n : 2 * n].view(37, *k.shape[1:]), wide[:, 2 * n :].view(37, *v.shape[1:])
    ref_k, ref_v = loop_reference(k, v, kc, vc, slots)
    assert write_kv_cache_cpu_native(ks, vs, kc, vc, slots)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


def test_native_cpu_write_refuses_what_it_cannot_serve():
    from pagemill.kernels.kv_cache import write_kv_cache_cpu_native

    k, v, kc, vc, slots = make(6, 8, torch.float32)
    before = kc.clone()
    bad = slots.clone().long()
    bad[-1] = kc.shape[0] * kc.shape[1]
    with pytest.raises(ValueError, match="outside"):
        write_kv_cache_cpu_native(k, v, kc, vc, bad)
    assert torch.equal(kc, before)  # refused before anything was copied
    # Not its case (a cache in another dtype, rows not contiguous): declined, nothing written.
    assert not write_kv_cache_cpu_native(k, v, kc.to(torch.bfloat16), vc.to(torch.bfloat16), slots)
    assert not write_kv_cache_cpu_native(
        k.transpose(1, 2).contiguous().transpose(1, 2), v, kc, vc, slots
    )
    assert torch.equal(kc, before)


@pytest.mark.parametrize("heads_dim", [(3, 64), (2, 32), (1, 20), (3, 24)])
@pytest.mark.parametrize("aligned", [True, False])
def test_native_cpu_write_whole_lines_and_not(heads_dim, aligned):
    """Rows of whole 64-byte lines in a 64-byte-aligned pool take the streaming stores; rows
    of other sizes, or a pool that starts mid-line, the plain copy: the same bytes either way."""
    from pagemill.kernels.kv_cache import write_kv_cache_cpu_native

    h, d = heads_dim
    g = torch.Generator().manual_seed(h * d)
    k = torch.randn(40, h, d, generator=g).to(torch.bfloat16)
    v = torch.randn(40, h, d, generator=g).to(torch.bfloat16)
    slots = torch.randperm(128, generator=g)[:40]
    slots[3] = -1
    n = 8 * 16 * h * d
    offset = 0 if aligned else 8  # elements: 16 bytes past the buffer's start
    caches = []
    for _ in range(2):
        buf = torch.zeros(n + 64, dtype=torch.bfloat16)
        start = (-buf.data_ptr() // 2) % 32 + offset  # from a 64-byte boundary
        caches.append(buf[start : start + n].view(8, 16, h, d))
    kc, vc = caches
    assert (kc.data_ptr() % 64 == 0) == aligned
    assert write_kv_cache_cpu_native(k, v, kc, vc, slots)
    keep = slots >= 0
    for src, cache in ((k, kc), (v, vc)):
        want = torch.zeros(128, h, d, dtype=torch.bfloat16)
        want[slots[keep]] = src[keep]
        assert torch.equal(cache.reshape(128, h, d), want)
