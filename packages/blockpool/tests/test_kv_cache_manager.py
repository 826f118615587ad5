"""KV cache manager unit tests: prefix hits, all-or-nothing allocation, caching, free order."""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass, field

import pytest

from pagemill.blockpool import BlockHash, KVCacheManager, get_hash_fn, hash_block_chain
from pagemill.blockpool import kv_cache_manager as kv_cache_manager_module
from pagemill.blockpool.kv_cache_manager import CacheRequest


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    block_hashes: list[BlockHash] = field(default_factory=list)


def hashed(m: KVCacheManager, r: Req) -> Req:
    """Bring the request's block hashes up to date, as the scheduler does on every token."""
    if m.block_hasher is not None:
        r.block_hashes.extend(m.block_hasher(r))
    return r


def lookup(m: KVCacheManager, r: Req):
    return m.get_computed_blocks(hashed(m, r))


def run_prefill(m: KVCacheManager, r: Req) -> tuple[int, list[int]]:
    """Admit a request the way a scheduler does; returns (hit tokens, block ids)."""
    hits, n = lookup(m, r)
    assert m.allocate_slots(r, len(r.all_token_ids) - n, n, hits) is not None
    r.num_computed_tokens = len(r.all_token_ids)
    return n, m.get_block_ids(r.request_id)


def test_request_satisfies_protocol() -> None:
    assert isinstance(Req("a"), CacheRequest)


def test_prefix_hit_shares_blocks_and_counts_stats() -> None:
    m = KVCacheManager(num_blocks=10, block_size=4)
    a = Req("a", list(range(10)))
    assert run_prefill(m, a) == (0, [0, 1, 2])
    b = Req("b", [*range(8), 99, 98, 97])
    n, table = run_prefill(m, b)
    assert n == 8 and table[:2] == [0, 1] and table[2] not in (0, 1, 2)
    assert [blk.ref_cnt for blk in m.block_pool.blocks[:2]] == [2, 2]
    stats = m.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 21, 8)
    assert stats.hit_rate == pytest.approx(8 / 21)
    assert m.make_prefix_cache_stats().queries == 0  # reset on read
    assert m.prefix_cache_stats == stats  # the totals are not reset


def test_stats_count_each_admission_once_however_often_it_is_looked_up() -> None:
    """A head of the queue that does not fit is looked up every step; only its admission
    counts (the old manager counted every lookup and disagreed with the scheduler)."""
    m = KVCacheManager(num_blocks=5, block_size=2)
    run_prefill(m, Req("a", [1, 2, 3, 4, 5]))  # 3 blocks, 2 of them cached
    blocked = Req("b", [1, 2, 3, 4, 9, 9])  # hits 4 tokens, then needs 1 more block
    hog = Req("hog", [7, 7, 7, 7])
    assert m.allocate_slots(hog, 4) is not None  # the last two free blocks
    for _ in range(5):  # five steps of a blocked head
        hits, n = lookup(m, blocked)
        assert n == 4 and m.allocate_slots(blocked, 2, n, hits) is None
    m.free("hog")
    hits, n = lookup(m, blocked)
    assert m.allocate_slots(blocked, 2, n, hits) is not None
    blocked.num_computed_tokens = 6
    blocked.all_token_ids.append(3)  # a decode step is not an admission
    assert m.allocate_slots(hashed(m, blocked), 1) is not None
    # a, hog and b once each: 5 + 4 + 6 queried tokens, b's 4 hit tokens.
    totals = m.prefix_cache_stats
    assert (totals.requests, totals.queries, totals.hits) == (3, 15, 4)
    # Re-admission after preemption (table freed, nothing computed) counts again.
    m.free("b")
    blocked.num_computed_tokens = 0
    run_prefill(m, blocked)
    totals = m.prefix_cache_stats
    assert (totals.requests, totals.queries, totals.hits) == (4, 22, 10)
    interval = m.make_prefix_cache_stats()
    assert (interval.requests, interval.queries, interval.hits) == (4, 22, 10)
    m.free("a")
    run_prefill(m, Req("c", [1, 2, 5]))
    interval = m.make_prefix_cache_stats()
    assert (interval.requests, interval.queries, interval.hits) == (1, 3, 2)
    assert m.prefix_cache_stats.requests == 5


def test_stats_are_not_counted_without_caching() -> None:
    m = KVCacheManager(num_blocks=4, block_size=2, enable_caching=False)
    run_prefill(m, Req("a", [1, 2, 3]))
    assert m.prefix_cache_stats == m.make_prefix_cache_stats() == type(m.prefix_cache_stats)()


def test_block_hasher_returns_only_the_new_full_blocks() -> None:
    m = KVCacheManager(num_blocks=4, block_size=2)
    assert m.block_hasher is not None
    fn = get_hash_fn()
    r = Req("a", [1, 2, 3], cache_salt="s")
    first = m.block_hasher(r)
    assert first == hash_block_chain(fn, [1, 2], 2, ("s",)) and r.block_hashes == []
    r.block_hashes.extend(first)
    assert m.block_hasher(r) == []  # nothing filled since
    r.all_token_ids += [4, 5, 6]
    # Chained on the last known hash: equal to hashing the whole sequence at once.
    r.block_hashes.extend(m.block_hasher(r))
    assert r.block_hashes == hash_block_chain(fn, [1, 2, 3, 4, 5, 6], 2, ("s",))
    assert KVCacheManager(4, 2, enable_caching=False).block_hasher is None


def test_full_blocks_are_cached_only_once_hashed() -> None:
    """The manager never hashes on its own: a block whose hash the caller has not added yet
    stays uncached, and is registered by the first allocation after the hash arrives."""
    m = KVCacheManager(num_blocks=4, block_size=2)
    r = Req("a", [1, 2, 3, 4])
    assert m.allocate_slots(r, 3) is not None  # no hashes on the request yet
    r.num_computed_tokens = 3
    assert m.block_pool.num_cached_blocks == 0
    hashed(m, r)
    assert m.allocate_slots(r, 1) is not None
    assert [b.block_hash for b in m.req_to_blocks["a"]] == r.block_hashes


def test_full_prompt_hit_leaves_last_token_to_recompute() -> None:
    m = KVCacheManager(num_blocks=10, block_size=4)
    run_prefill(m, Req("a", list(range(8))))
    hits, n = lookup(m, Req("b", list(range(8))))
    assert n == 4 and len(hits) == 1  # (8 - 1) // 4 = 1 block, not 2
    hits, n = lookup(m, Req("c", list(range(9))))
    assert n == 8


def test_hit_stops_at_first_miss() -> None:
    m = KVCacheManager(num_blocks=10, block_size=2)
    run_prefill(m, Req("a", [1, 2, 3, 4, 5, 6, 7]))
    _, n = lookup(m, Req("b", [1, 2, 9, 9, 5, 6, 7]))
    assert n == 2  # block 2 matches by tokens but not by chain


def test_salts_isolate_tenants() -> None:
    m = KVCacheManager(num_blocks=10, block_size=4)
    run_prefill(m, Req("a", list(range(9)), cache_salt="t1"))
    assert lookup(m, Req("b", list(range(9)), cache_salt="t2"))[1] == 0
    assert lookup(m, Req("c", list(range(9))))[1] == 0
    assert lookup(m, Req("d", list(range(9)), cache_salt="t1"))[1] == 8


def test_freed_blocks_stay_hittable_and_free_is_reverse_order() -> None:
    m = KVCacheManager(num_blocks=6, block_size=2)
    a = Req("a", [1, 2, 3, 4, 5, 6, 7])
    run_prefill(m, a)  # blocks 0..3
    m.free("a")
    queue = [b.block_id for b in m.block_pool.free_block_queue]
    assert queue == [4, 5, 3, 2, 1, 0]  # never-used first, then a's tail first
    _, n = lookup(m, Req("b", [1, 2, 3, 4, 5, 6, 0]))
    assert n == 6
    # Taking 3 fresh blocks evicts a's tail block (id 3) but keeps its prefix.
    run_prefill(m, Req("c", [50, 51, 52, 53, 54, 55]))
    assert m.get_block_ids("c") == [4, 5, 3]
    _, n = lookup(m, Req("d", [1, 2, 3, 4, 5, 6, 0]))
    assert n == 6  # blocks 0..2 survive; block 3 (tokens 7..) was the one evicted


def test_failed_allocation_changes_nothing() -> None:
    m = KVCacheManager(num_blocks=4, block_size=2)
    run_prefill(m, Req("a", [1, 2, 3, 4, 5]))  # 3 blocks
    pool = m.block_pool
    snapshot = ([b.ref_cnt for b in pool.blocks], [b.block_id for b in pool.free_block_queue])
    big = Req("b", list(range(100, 106)))
    assert m.allocate_slots(big, 6) is None
    assert not m.has_request("b")
    assert ([b.ref_cnt for b in pool.blocks], [b.block_id for b in pool.free_block_queue]) == (
        snapshot
    )


def test_hit_blocks_in_free_queue_are_not_double_counted() -> None:
    m = KVCacheManager(num_blocks=4, block_size=2)
    run_prefill(m, Req("a", [1, 2, 3, 4, 5]))  # blocks 0,1 full and cached, 2 partial
    m.free("a")  # all 4 free; 0 and 1 are hit-able
    b = Req("b", [1, 2, 3, 4, 9, 9, 9, 9, 9])
    hits, n = lookup(m, b)
    assert n == 4
    # 9 tokens need 5 blocks: more than the pool holds.
    with pytest.raises(ValueError, match="only has 4 blocks"):
        m.allocate_slots(b, 5, n, hits)
    b.all_token_ids = b.all_token_ids[:7]  # 4 blocks: 2 hits + 2 new; free = 4 - 2 hits = 2
    del b.block_hashes[3:]  # the hashes follow the tokens they describe
    assert m.allocate_slots(b, 3, n, hits) is not None
    assert m.get_num_free_blocks() == 0
    m.free("b")
    c = Req("c", [1, 2, 3, 4, 7, 7, 7, 7])
    hits, n = lookup(m, c)
    assert n == 4 and m.get_num_free_blocks() == 4
    # Now ask for one block more than the free queue holds once the hits leave it.
    c.num_computed_tokens = 0
    other = Req("x", [0])
    assert m.allocate_slots(other, 1) is not None  # 3 free, 2 of them are c's hits
    before = [blk.ref_cnt for blk in m.block_pool.blocks]
    assert m.allocate_slots(c, 4, n, hits) is None  # needs 2 new, only 1 truly free
    assert [blk.ref_cnt for blk in m.block_pool.blocks] == before


def test_blocks_are_cached_as_they_fill_during_decode() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    a = Req("a", [1, 2, 3])
    run_prefill(m, a)
    assert m.block_pool.num_cached_blocks == 0
    for tok in (4, 5, 6, 7, 8):  # decode: append the sampled token, then compute it
        a.all_token_ids.append(tok)
        hashed(m, a)
        assert m.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    assert a.num_computed_tokens == 8
    assert m.block_pool.num_cached_blocks == 2
    expected = hash_block_chain(get_hash_fn(), list(range(1, 9)), 4)
    assert [b.block_hash for b in m.req_to_blocks["a"]] == expected


def test_block_hashes_are_computed_incrementally(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = 0
    inner = get_hash_fn()

    def counting(data: bytes) -> bytes:
        nonlocal calls
        calls += 1
        return inner(data)

    monkeypatch.setattr(kv_cache_manager_module, "get_hash_fn", lambda name: counting)
    m = KVCacheManager(num_blocks=64, block_size=4)
    a = Req("a", list(range(40)))
    run_prefill(m, a)
    assert calls == 10
    for tok in range(40, 48):
        a.all_token_ids.append(tok)
        hashed(m, a)
        m.allocate_slots(a, 1)
        a.num_computed_tokens += 1
        lookup(m, a)
    assert calls == 12  # only the two blocks that became full
    assert a.block_hashes == hash_block_chain(inner, list(range(48)), 4)


def test_duplicate_content_stays_uncached_without_duplicate_entries() -> None:
    m = KVCacheManager(num_blocks=8, block_size=2)
    a, b = hashed(m, Req("a", [1, 2, 3])), hashed(m, Req("b", [1, 2, 3]))
    # Both admitted before either is cached (as in one scheduling step with no hit).
    assert m.allocate_slots(a, 3) is not None and m.allocate_slots(b, 3) is not None
    ta, tb = m.req_to_blocks["a"], m.req_to_blocks["b"]
    assert ta[0].block_hash is not None and tb[0].block_hash is None
    assert m.block_pool.num_cached_blocks == 1
    m.free("a")
    m.free("b")
    assert m.get_num_free_blocks() == 8


def test_reused_request_id_gets_fresh_hashes() -> None:
    m = KVCacheManager(num_blocks=8, block_size=2)
    lookup(m, Req("a", [1, 2, 3, 4, 5]))  # looked up, never allocated
    r = Req("a", [7, 7, 7, 7, 7])
    run_prefill(m, r)
    assert m.req_to_blocks["a"][0].block_hash == hash_block_chain(get_hash_fn(), [7, 7], 2)[0]


def test_stale_hit_is_rejected() -> None:
    m = KVCacheManager(num_blocks=3, block_size=2)
    run_prefill(m, Req("a", [1, 2, 3]))
    m.free("a")
    b = Req("b", [1, 2, 3])
    hits, n = lookup(m, b)
    assert n == 2
    run_prefill(m, Req("c", [9, 9, 9, 9, 9]))  # takes all three blocks, evicting the hit
    m.free("c")
    with pytest.raises(ValueError, match="evicted or reused"):
        m.allocate_slots(b, 1, n, hits)


def test_slot_mapping() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.allocate_slots(Req("x", [0] * 4), 4)  # takes block 0
    r = Req("a", list(range(10)))
    run_prefill(m, r)
    table = m.get_block_ids("a")
    assert table == [1, 2, 3]
    assert m.slot_mapping("a", 0, 10) == [
        t * 4 + p % 4 for p, t in zip(range(10), [1] * 4 + [2] * 4 + [3] * 2)
    ]
    assert m.slot_mapping("a", 9, 12) == [13, 14, 15]
    assert m.slot_mapping("a", 5, 5) == []
    with pytest.raises(ValueError, match="outside"):
        m.slot_mapping("a", 0, 13)
    with pytest.raises(ValueError, match="outside"):
        m.slot_mapping("a", 3, 2)


def test_usage_and_reset() -> None:
    m = KVCacheManager(num_blocks=4, block_size=2)
    run_prefill(m, Req("a", [1, 2, 3]))
    assert m.usage == pytest.approx(0.5)
    assert m.reset_prefix_cache() is False
    m.free("a")
    assert m.usage == 0.0
    assert m.reset_prefix_cache() is True
    assert lookup(m, Req("b", [1, 2, 3]))[1] == 0


def test_caching_disabled() -> None:
    m = KVCacheManager(num_blocks=4, block_size=2, enable_caching=False)
    run_prefill(m, Req("a", [1, 2, 3]))
    m.free("a")
    assert lookup(m, Req("b", [1, 2, 3])) == ([], 0)
    assert m.block_pool.num_cached_blocks == 0


def test_xxh3_manager_works() -> None:
    m = KVCacheManager(num_blocks=4, block_size=2, hash_algo="xxh3_128")
    run_prefill(m, Req("a", [1, 2, 3]))
    assert len(m.req_to_blocks["a"][0].block_hash) == 16
    assert lookup(m, Req("b", [1, 2, 3]))[1] == 2


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"num_blocks": 0}, ValueError, "num_blocks must be positive"),
        ({"num_blocks": -1}, ValueError, "num_blocks must be positive"),
        ({"num_blocks": 4, "block_size": 0}, ValueError, "block_size must be positive"),
        ({"num_blocks": 4, "hash_algo": "md5"}, ValueError, "unknown hash algorithm"),
        ({"num_blocks": 4.0}, TypeError, "num_blocks must be an int"),
    ],
)
def test_constructor_bad_input(kwargs: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        KVCacheManager(**kwargs)


def test_allocate_bad_input() -> None:
    m = KVCacheManager(num_blocks=4, block_size=2)
    r = Req("a", [1, 2, 3])
    with pytest.raises(ValueError, match="num_new_tokens must be non-negative"):
        m.allocate_slots(r, -1)
    with pytest.raises(ValueError, match="num_new_computed_tokens must be non-negative"):
        m.allocate_slots(r, 1, -2)
    with pytest.raises(ValueError, match="does not match"):
        m.allocate_slots(r, 1, 2, [])
    with pytest.raises(ValueError, match="only has 4 blocks"):
        m.allocate_slots(r, 9)
    r.num_computed_tokens = -1
    with pytest.raises(ValueError, match="negative num_computed_tokens"):
        m.allocate_slots(r, 1)
    assert m.get_num_free_blocks() == 4 and not m.has_request("a")


def test_free_unknown_or_twice_raises_key_error() -> None:
    m = KVCacheManager(num_blocks=4, block_size=2)
    with pytest.raises(KeyError, match="never allocated or already freed"):
        m.free("nope")
    run_prefill(m, Req("a", [1, 2, 3]))
    m.free("a")
    with pytest.raises(KeyError, match="already freed"):
        m.free("a")
    with pytest.raises(KeyError, match="holds no blocks"):
        m.get_block_ids("a")
    assert m.get_num_free_blocks() == 4


def test_hit_stops_at_first_miss_even_when_a_later_block_is_cached() -> None:
    """A child hash can outlive its parent's block: the lookup must still stop at the gap."""
    m = KVCacheManager(num_blocks=6, block_size=2)
    a, x = hashed(m, Req("a", [1, 2, 3])), hashed(m, Req("x", [1, 2, 3]))
    assert m.allocate_slots(a, 3) is not None and m.allocate_slots(x, 3) is not None
    a.num_computed_tokens = x.num_computed_tokens = 3
    # x's first block duplicates a's and stays uncached; its second block fills and is cached.
    x.all_token_ids.append(4)
    hashed(m, x)
    assert m.allocate_slots(x, 1) is not None
    x.num_computed_tokens = 4
    m.free("a")
    # Evict a's blocks (the only holder of the first block's hash).
    filler = hashed(m, Req("f", [9] * 8))
    assert m.allocate_slots(filler, 8) is not None
    probe = Req("p", [1, 2, 3, 4, 5])
    chain = hash_block_chain(get_hash_fn(), probe.all_token_ids, 2)
    assert m.block_pool.get_cached_block(chain[0]) is None
    assert m.block_pool.get_cached_block(chain[1]) is m.req_to_blocks["x"][1]
    assert lookup(m, probe) == ([], 0)


def test_dropped_unallocated_requests_do_not_leak() -> None:
    m = KVCacheManager(num_blocks=4, block_size=2)
    r = Req("w", [1, 2, 3, 4, 5])
    lookup(m, r)  # looked up while waiting, then aborted without allocation
    assert len(r.block_hashes) == 2  # the hashes live on the request, not in the manager
    dead = weakref.ref(r)
    del r
    gc.collect()
    assert dead() is None


def test_free_drops_all_per_request_state() -> None:
    m = KVCacheManager(num_blocks=4, block_size=2)
    r = Req("a", [1, 2, 3])
    run_prefill(m, r)
    m.free("a")
    assert "a" not in m._num_cached_blocks and not m.has_request("a")
    dead = weakref.ref(r)
    del r
    gc.collect()
    assert dead() is None


@pytest.mark.parametrize("hybrid", [False, True])
def test_trim_gives_back_the_tail_past_the_kept_tokens(hybrid: bool) -> None:
    """A verified step's rejected drafts: the blocks past those of the computed tokens go
    back to the pool, the prefix stays registered and hittable, the table grows again."""
    from pagemill.blockpool import HybridKVCacheManager, KVCacheGroupSpec

    m: KVCacheManager | HybridKVCacheManager
    if hybrid:
        groups = [KVCacheGroupSpec((0,)), KVCacheGroupSpec((1,), 8)]
        m = HybridKVCacheManager(num_blocks=40, block_size=4, kv_cache_groups=groups)
    else:
        m = KVCacheManager(num_blocks=40, block_size=4)
    free0 = m.get_num_free_blocks()
    r = Req("a", list(range(10)))
    run_prefill(m, hashed(m, r))  # 10 tokens: 3 blocks per group
    held = free0 - m.get_num_free_blocks()
    # Next token plus 9 drafts: positions 10..19, two more blocks per group.
    r.all_token_ids.append(99)
    assert m.allocate_slots(hashed(m, r), 10) is not None
    r.num_computed_tokens = 20
    assert m.trim("a", 25) is None  # nothing past 25 tokens' blocks
    r.num_computed_tokens = 11  # one draft accepted
    assert m.trim("a", 11) == 3
    assert m.get_num_free_blocks() == free0 - held
    assert m.trim("a", 11) is None
    assert m.num_request_blocks("a") == 3
    # The two full prompt blocks are still hits for another request.
    b = Req("b", [*range(8), 50, 51])
    assert lookup(m, b)[1] == 8
    # Growing again takes new blocks after the kept ones.
    assert m.allocate_slots(r, 2) is not None and m.num_request_blocks("a") == 4
