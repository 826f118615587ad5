"""Sliding-window block release: the exact boundary, pool accounting, window hits.

The boundary is checked against attention's own definition, not the manager's formula: a
query at position q reads the keys q-W < k <= q, the next step's earliest query is at
num_computed_tokens, so every block holding a key that query (or any later one) reads
must be live, and every block wholly below it must have been given back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from pagemill.blockpool import BlockHash, KVCacheManager


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    block_hashes: list[BlockHash] = field(default_factory=list)


def hashed(m: KVCacheManager, r: Req) -> Req:
    if m.block_hasher is not None:
        r.block_hashes.extend(m.block_hasher(r))
    return r


def step(m: KVCacheManager, r: Req, n: int) -> None:
    """Schedule n more tokens of `r` (appending decode tokens as needed) and compute them."""
    while len(r.all_token_ids) < r.num_computed_tokens + n:
        r.all_token_ids.append(len(r.all_token_ids) % 7)
    hashed(m, r)
    assert m.allocate_slots(r, n) is not None
    r.num_computed_tokens += n


def null_id(m: KVCacheManager) -> int:
    null = m.block_pool.null_block
    assert null is not None
    return null.block_id


@pytest.mark.parametrize(("window", "block_size"), [(6, 4), (8, 4), (5, 1), (3, 16), (16, 4)])
@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_blocks_leave_exactly_when_no_query_can_read_them(window, block_size, chunk) -> None:
    m = KVCacheManager(64, block_size, sliding_window=window)
    r = Req("r")
    for _ in range(60 // chunk):
        # What the step about to be scheduled (earliest query at c) may read.
        c = r.num_computed_tokens
        step(m, r, chunk)
        table = m.get_block_ids("r")
        first_read = max(0, c - window + 1)
        for j, block_id in enumerate(table):
            positions = range(j * block_size, (j + 1) * block_size)
            read = any(k >= first_read for k in positions)
            assert (block_id != null_id(m)) == read, (c, j, table)
        assert m.num_held_blocks("r") == sum(b != null_id(m) for b in table)


def test_null_block_is_nobodys_and_never_free() -> None:
    m = KVCacheManager(8, 4, sliding_window=5)
    null = m.block_pool.null_block
    assert null is not None and null.block_id == 0
    assert m.num_usable_blocks == 7 and m.get_num_free_blocks() == 7
    assert m.usage == 0.0
    r = Req("r")
    for _ in range(40):
        step(m, r, 1)
    assert null not in m.block_pool.free_block_queue and null.block_hash is None
    m.free("r")
    assert m.get_num_free_blocks() == 7 and m.usage == 0.0
    assert m.reset_prefix_cache() is True
    assert null.ref_cnt == 1  # still reserved


def test_a_request_longer_than_the_pool_holds_one_window() -> None:
    """Without a window a pool of 6 usable blocks of 4 tokens caps a request at 24
    tokens; with a window of 6 it decodes 200 tokens holding at most 3 blocks."""
    m = KVCacheManager(7, 4, sliding_window=6)
    r = Req("r", list(range(5)))
    step(m, r, 5)
    peak = 0
    while r.num_computed_tokens < 200:
        step(m, r, 1)
        peak = max(peak, m.num_held_blocks("r"))
    # Keys c-5..c and the block of c: at most ceil(6 / 4) + 1 blocks.
    assert peak <= 3
    assert m.get_num_free_blocks() == 6 - m.num_held_blocks("r")
    assert m.max_num_tokens(200) > 200
    m.free("r")
    assert m.get_num_free_blocks() == 6


def test_released_blocks_count_as_free_for_the_same_allocation() -> None:
    """A pool exactly full: the step that crosses into a new block succeeds only because
    the block it leaves behind comes back first."""
    m = KVCacheManager(4, 4, sliding_window=5)  # 3 usable blocks
    r = Req("r")
    step(m, r, 12)  # fills all 3 blocks: positions 0..11
    assert m.get_num_free_blocks() == 0
    # Next query at 12 reads from 8 on: blocks 0 and 1 (0..7) are dead, block 3 is new.
    step(m, r, 1)
    assert m.get_block_ids("r")[:2] == [0, 0]
    assert m.num_held_blocks("r") == 2 and m.get_num_free_blocks() == 1


def test_a_refused_allocation_releases_nothing() -> None:
    m = KVCacheManager(5, 4, sliding_window=6)  # 4 usable blocks
    a, b = Req("a"), Req("b")
    step(m, a, 8)
    step(m, b, 8)
    assert m.get_num_free_blocks() == 0
    table = m.get_block_ids("a")
    # a at 8 needs a third block and still reads key 3 (block 0): no room.
    assert m.allocate_slots(hashed(m, Req("a", list(range(9)), 8)), 1) is None
    assert m.get_block_ids("a") == table and m.get_num_free_blocks() == 0


def test_window_hit_needs_only_the_last_window() -> None:
    """The blocks before the window of the first recomputed position may be gone; the
    hit still reaches the end of the prompt and takes only the window's blocks."""
    bs, window = 4, 6
    m = KVCacheManager(16, bs, sliding_window=window)
    prompt = list(range(100, 133))  # 33 tokens: 8 full blocks, the last token recomputed
    a = hashed(m, Req("a", list(prompt)))
    step(m, a, 33)
    m.free("a")
    # Evict the prompt's first blocks (the free queue's head) by taking them for another.
    queue = m.block_pool.free_block_queue.get_all_free_blocks()
    first_blocks = {b.block_hash for b in queue[:3]}
    other = hashed(m, Req("o", [1] * 12))
    step(m, other, 12)  # takes three blocks off the queue head, evicting their hashes
    assert all(m.block_pool.get_cached_block(h) is None for h in first_blocks if h)
    b = hashed(m, Req("b", list(prompt)))
    hits, n = m.get_computed_blocks(b)
    assert n == 32
    # The first recomputed query (32) reads keys 27..32: blocks 6 and 7 must be real.
    first_read_block = (32 - window + 1) // bs
    assert all(h is m.block_pool.null_block for h in hits[:first_read_block])
    assert all(h.block_hash == b.block_hashes[i] for i, h in enumerate(hits) if i >= 6)
    assert m.allocate_slots(b, 1, n, hits) is not None
    b.num_computed_tokens = 33
    assert m.num_held_blocks("b") == 3  # blocks 6, 7 and the new one
    assert m.prefix_cache_stats.hits == 32


def test_window_hit_is_cut_where_a_window_block_is_missing() -> None:
    bs, window = 4, 6
    m = KVCacheManager(16, bs, sliding_window=window)
    prompt = list(range(50, 83))
    a = hashed(m, Req("a", list(prompt)))
    step(m, a, 33)
    # Block 6 (positions 24..27) is dropped from the index: a query at 32 would need it.
    table = m.req_to_blocks["a"]
    m.forget_blocks_from("a", 6)
    assert table[6].block_hash is None
    m.free("a")
    b = hashed(m, Req("b", list(prompt)))
    hits, n = m.get_computed_blocks(b)
    # The longest k with blocks lo(k)..k-1 cached and k <= 6: k = 6 (query 24 reads 19..).
    assert n == 24
    assert all(h is not m.block_pool.null_block for h in hits[(24 - window + 1) // bs :])


def test_null_hit_inside_the_window_is_refused() -> None:
    m = KVCacheManager(16, 4, sliding_window=6)
    a = hashed(m, Req("a", list(range(13))))
    step(m, a, 13)
    m.free("a")
    b = hashed(m, Req("b", list(range(13))))
    _, n = m.get_computed_blocks(b)
    assert n == 12
    forged = [m.block_pool.null_block] * 3
    with pytest.raises(ValueError, match="inside the sliding window"):
        m.allocate_slots(b, 1, n, forged)


def test_left_to_right_hits_are_accepted_and_trimmed() -> None:
    """A caller may hand every hit block (no nulls): those the window no longer reaches
    are not taken."""
    m = KVCacheManager(16, 4, sliding_window=5)
    a = hashed(m, Req("a", list(range(21))))
    step(m, a, 21)
    ids = m.get_block_ids("a")
    m.free("a")
    b = hashed(m, Req("b", list(range(21))))
    hits = [m.block_pool.get_cached_block(h) for h in b.block_hashes[:5]]
    assert all(h is not None for h in hits)
    assert m.allocate_slots(b, 1, 20, hits) is not None
    table = m.get_block_ids("b")
    # Query 20 reads 16..20: blocks 0..3 are null, block 4 (16..19) is a's.
    assert table[:4] == [0] * 4 and table[4] == ids[4]
    assert all(m.block_pool.blocks[i].ref_cnt == 0 for i in ids[:4])


def test_pool_too_small_for_a_window_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot hold a sliding window"):
        KVCacheManager(3, 4, sliding_window=8)  # 2 usable blocks: 8 + 3 > 8
    KVCacheManager(4, 4, sliding_window=8)


@pytest.mark.parametrize("bad", [0, -3, True, 2.5])
def test_bad_window_is_refused(bad) -> None:
    with pytest.raises((TypeError, ValueError)):
        KVCacheManager(8, 4, sliding_window=bad)
