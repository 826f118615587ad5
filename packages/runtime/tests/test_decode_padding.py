"""Decode graphs' host side on CPU: buckets, padding, and padded rows through attention.

The CUDA capture and replay need a GPU (test_cuda_graphs_gpu.py); what decides their
correctness without one is here: which bucket a batch gets, what the padded rows hold, and
that padded rows neither write the KV cache nor change a real row's attention (the Triton
kernel under the interpreter, which the root conftest turns on when there is no GPU).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagemill.kernels import paged_attention, plan_attention, write_kv_cache
from pagemill.kernels._dispatch import interpreting, triton_available
from pagemill.runtime.worker.decode_padding import (
    DecodeLayout,
    bucket_for,
    graph_buckets,
    pad_decode,
    verify_buckets,
)


def test_buckets_are_powers_of_two_then_max() -> None:
    assert graph_buckets(1) == [1]
    assert graph_buckets(8) == [1, 2, 4, 8]
    assert graph_buckets(17) == [1, 2, 4, 8, 16, 17]
    assert graph_buckets(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    with pytest.raises(ValueError):
        graph_buckets(0)


def test_bucket_for_picks_the_smallest_that_fits() -> None:
    buckets = graph_buckets(24)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 9, 17, 24)] == [1, 2, 4, 8, 16, 24, 24]
    assert bucket_for(25, buckets) is None


def _decode_step(n: int, width: int, block_size: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    seq_lens = rng.integers(1, width * block_size + 1, size=n).astype(np.int64)
    tables = np.zeros((n, width), dtype=np.int32)
    blocks = rng.permutation(n * width) + 1  # block 0 is never a real request's here
    for i in range(n):
        tables[i] = blocks[i * width : (i + 1) * width]
    positions = seq_lens - 1
    slots = (
        tables[np.arange(n), positions // block_size].astype(np.int64) * block_size
        + positions % block_size
    )
    ids = rng.integers(0, 100, size=n).astype(np.int64)
    return ids, positions, slots, seq_lens, tables


def _unpack(packed: np.ndarray, layout: DecodeLayout) -> list[np.ndarray]:
    o = layout.offsets()
    parts = [packed[o[i] : o[i + 1]] for i in range(6)]
    parts[5] = parts[5].reshape(layout.bucket, layout.table_width)
    return parts


def test_padding_keeps_real_rows_and_neutralises_the_rest() -> None:
    ids, positions, slots, seq_lens, tables = _decode_step(5, 3)
    layout = DecodeLayout(8, 6)  # bucket 8, tables widened from 3 to 6 blocks
    packed = pad_decode(ids, positions, slots, seq_lens, tables, layout)
    assert packed.dtype == np.int32 and packed.shape == (layout.numel,)
    p_ids, p_pos, p_slots, p_qsl, p_lens, p_tables = _unpack(packed, layout)
    np.testing.assert_array_equal(p_ids, [*ids, 0, 0, 0])
    np.testing.assert_array_equal(p_pos, [*positions, 0, 0, 0])
    np.testing.assert_array_equal(p_slots, [*slots, -1, -1, -1])  # KV write skips -1
    np.testing.assert_array_equal(p_qsl, np.arange(9))  # one query token per row
    np.testing.assert_array_equal(p_lens, [*seq_lens, 0, 0, 0])  # no key to read
    np.testing.assert_array_equal(p_tables[:5, :3], tables)
    assert not p_tables[:5, 3:].any() and not p_tables[5:].any()


def test_padding_reuses_its_buffer_and_clears_stale_rows() -> None:
    layout = DecodeLayout(4, 2)
    buf = np.empty(layout.numel, dtype=np.int32)
    pad_decode(*_decode_step(4, 2, seed=1), layout, out=buf)
    step = _decode_step(1, 1, seed=2)
    again = pad_decode(*step, layout, out=buf)
    assert again is buf
    np.testing.assert_array_equal(buf, pad_decode(*step, layout))


def test_padding_refuses_what_the_graph_cannot_hold() -> None:
    with pytest.raises(ValueError, match="bucket"):
        pad_decode(*_decode_step(5, 2), DecodeLayout(4, 2))
    with pytest.raises(ValueError, match="exceed"):
        pad_decode(*_decode_step(2, 3), DecodeLayout(4, 2))


@pytest.mark.skipif(
    not (interpreting() and triton_available()),
    reason="needs the Triton interpreter (TRITON_INTERPRET=1, set by the root "
    "conftest when there is no GPU)",
)
def test_padded_rows_leave_real_rows_and_the_cache_alone() -> None:
    """The graph's padded batch through the KV write and the Triton attention kernel (its
    plan made once for the bucket and full table width, as at capture) equals the unpadded
    batch on its real rows; padded rows come out as zeros and write nothing."""
    block_size, width, heads, kv_heads, dim, n, bucket = 4, 3, 4, 2, 16, 3, 4
    ids, positions, slots, seq_lens, tables = _decode_step(n, width, block_size, seed=3)
    g = torch.Generator().manual_seed(0)
    num_blocks = n * width + 1
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    q = torch.randn(bucket, heads, dim, generator=g)
    k_new = torch.randn(bucket, kv_heads, dim, generator=g)
    v_new = torch.randn(bucket, kv_heads, dim, generator=g)

    layout = DecodeLayout(bucket, width + 2)
    packed = torch.from_numpy(pad_decode(ids, positions, slots, seq_lens, tables, layout))
    _, _, p_slots, p_qsl, p_lens, p_tables = (
        t for t in (torch.from_numpy(a) for a in _unpack(packed.numpy(), layout))
    )

    k_pad, v_pad = k_cache.clone(), v_cache.clone()
    write_kv_cache(k_new, v_new, k_pad, v_pad, p_slots.to(torch.int64))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_cache(k_new[:n], v_new[:n], k_ref, v_ref, torch.from_numpy(slots))
    assert torch.equal(k_pad, k_ref) and torch.equal(v_pad, v_ref)  # padding wrote nothing

    plan = plan_attention(
        p_qsl,
        p_lens,
        p_tables,
        k_cache_shape=tuple(k_pad.shape),
        num_heads=heads,
        dtype=torch.float32,
        backend="triton",
        query_lens=np.ones(bucket, dtype=np.int64),
        context_lens=np.ones(bucket, dtype=np.int64),
    )
    out = paged_attention(
        q, k_pad, v_pad, plan.block_tables, plan.query_start_loc, plan.seq_lens, 0.25, plan=plan
    )
    qsl = torch.arange(n + 1, dtype=torch.int32)
    ref = paged_attention(
        q[:n],
        k_ref,
        v_ref,
        torch.from_numpy(tables),
        qsl,
        torch.from_numpy(seq_lens.astype(np.int32)),
        0.25,
    )
    torch.testing.assert_close(out[:n], ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))


def test_verify_layout_pads_rows_of_several_tokens() -> None:
    """Two requests of three tokens each in a bucket of four: every token's id, position
    and slot in order, query_start_loc rising by three, padded rows writing nowhere."""
    ids = np.array([5, 6, 7, 8, 9, 10])
    positions = np.array([3, 4, 5, 9, 10, 11])
    slots = np.array([3, 4, 5, 41, 42, 43])
    seq_lens = np.array([6, 12])
    tables = np.array([[0], [2]], dtype=np.int32)
    layout = DecodeLayout(4, 2, query_len=3)
    got = _unpack(pad_decode(ids, positions, slots, seq_lens, tables, layout), layout)
    np.testing.assert_array_equal(got[0], [5, 6, 7, 8, 9, 10, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(got[1][:6], positions)
    np.testing.assert_array_equal(got[2], [3, 4, 5, 41, 42, 43] + [-1] * 6)
    np.testing.assert_array_equal(got[3], [0, 3, 6, 9, 12])
    np.testing.assert_array_equal(got[4], [6, 12, 0, 0])
    np.testing.assert_array_equal(got[5][:, :1], [[0], [2], [0], [0]])
    with pytest.raises(ValueError, match="2 rows of 3 token"):
        pad_decode(ids[:5], positions[:5], slots[:5], seq_lens, tables, layout)
    assert verify_buckets(8, 4, 16) == [1, 2, 4]
