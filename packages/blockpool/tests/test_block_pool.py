"""Unit tests for the free queue and the block pool: O(1) queue ops, LRU order, bad input."""

from __future__ import annotations

import pytest

from pagemill.blockpool import BlockPool, FreeBlockQueue, KVCacheBlock


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_free_queue_popleft_append_remove() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert len(q) == 5 and ids(q) == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert ids(q) == [0, 1, 3, 4] and blocks[2] not in q
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    q.append(blocks[0])
    assert ids(q.get_all_free_blocks()) == [1, 3, 4, 2, 0]
    q.remove(blocks[0])  # the last one
    q.remove(blocks[1])  # the first one
    assert ids(q) == [3, 4, 2] and len(q) == 3


def test_free_queue_rejects_double_insert_and_bad_remove() -> None:
    blocks = [KVCacheBlock(i) for i in range(2)]
    q = FreeBlockQueue(blocks[:1])
    with pytest.raises(ValueError, match="already in the free queue"):
        q.append(blocks[0])
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(blocks[1])
    q.popleft()
    with pytest.raises(ValueError, match="no free blocks"):
        q.popleft()


def test_new_pool_hands_out_blocks_in_id_order() -> None:
    pool = BlockPool(4)
    got = pool.get_new_blocks(3)
    assert ids(got) == [0, 1, 2]
    assert all(b.ref_cnt == 1 and b.block_hash is None for b in got)
    assert pool.get_num_free_blocks() == 1
    assert pool.get_usage() == pytest.approx(0.75)


def test_lru_eviction_order_tail_first() -> None:
    """Freed blocks are reused in free order; a request's tail (freed first) goes first."""
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)  # 0 1 2
    b = pool.get_new_blocks(3)  # 3 4 5
    pool.cache_full_blocks(a, [b"a0", b"a1", b"a2"])
    pool.cache_full_blocks(b, [b"b0", b"b1", b"b2"])
    pool.free_blocks(reversed(a))  # a's tail first -> queue 2 1 0
    pool.free_blocks(reversed(b))  # then b -> queue 2 1 0 5 4 3
    assert ids(pool.free_block_queue) == [2, 1, 0, 5, 4, 3]
    # Freed blocks stay hit-able until popped.
    assert pool.get_cached_block(b"a0") is a[0]
    got = pool.get_new_blocks(2)
    assert ids(got) == [2, 1]
    assert pool.get_cached_block(b"a2") is None and pool.get_cached_block(b"a1") is None
    assert pool.get_cached_block(b"a0") is a[0]
    assert all(blk.block_hash is None for blk in got)


def test_touch_revives_from_the_middle_of_the_queue() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks[:1], [b"h"])
    pool.free_blocks(blocks)
    hit = pool.get_cached_block(b"h")
    assert hit is blocks[0]
    pool.touch([hit, hit])  # two holders
    assert hit.ref_cnt == 2 and hit not in pool.free_block_queue
    assert ids(pool.free_block_queue) == [1, 2, 3]
    pool.free_blocks([hit])
    assert hit.ref_cnt == 1 and hit not in pool.free_block_queue
    pool.free_blocks([hit])
    assert ids(pool.free_block_queue) == [1, 2, 3, 0]


def test_duplicate_hash_leaves_second_block_uncached() -> None:
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [b"same"])
    pool.cache_full_blocks([b], [b"same"])
    assert a.block_hash == b"same" and b.block_hash is None
    assert pool.get_cached_block(b"same") is a
    assert pool.num_cached_blocks == 1


def test_cache_full_blocks_rejects_rehash_and_length_mismatch() -> None:
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([a], [b"x"])
    pool.cache_full_blocks([a], [b"x"])  # idempotent
    with pytest.raises(ValueError, match="different hash"):
        pool.cache_full_blocks([a], [b"y"])
    with pytest.raises(ValueError, match="2 hashes"):
        pool.cache_full_blocks([a], [b"x", b"z"])


def test_reset_prefix_cache_refuses_while_in_use() -> None:
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"0", b"1"])
    pool.free_blocks(blocks[1:])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(b"1") is blocks[1]  # nothing changed
    pool.free_blocks(blocks[:1])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(b"0") is None and all(b.block_hash is None for b in pool.blocks)


def test_caching_disabled_never_hits() -> None:
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [b"h"])
    assert pool.get_cached_block(b"h") is None and blocks[0].block_hash is None


@pytest.mark.parametrize("n", [0, -3])
def test_pool_rejects_non_positive_size(n: int) -> None:
    with pytest.raises(ValueError, match="num_blocks must be positive"):
        BlockPool(n)


def test_pool_rejects_over_allocation_and_changes_nothing() -> None:
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    before = ids(pool.free_block_queue)
    with pytest.raises(ValueError, match="only 1 of 3 are free"):
        pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="negative"):
        pool.get_new_blocks(-1)
    assert ids(pool.free_block_queue) == before


def test_double_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks([a, b, a])
    assert a.ref_cnt == 1 and b.ref_cnt == 1 and pool.get_num_free_blocks() == 1
    pool.free_blocks([a])
    with pytest.raises(ValueError, match="ref count 0"):
        pool.free_blocks([a])
