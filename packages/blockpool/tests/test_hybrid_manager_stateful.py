"""Stateful property test of HybridKVCacheManager: per-group tables over one pool.

Requests with overlapping prompts are admitted with prefix hits, prefilled in chunks,
decoded, grown past the pool, preempted and finished in random order, on a manager with a
full-attention group and one or two windowed groups. Checked after every step:

- every block's ref count equals the table entries (any group, any request) that name it,
  the free queue holds exactly the blocks nobody references, nothing leaks or is freed
  twice, and the pool is whole once every request has ended;
- each group's simulated KV holds, at every position a later query of that group reads
  (every position for full attention, the last window for a windowed group), the
  request's own token; a windowed group holds exactly the blocks from the window's first
  block on, the null block before, and never more than ceil(W/B)+1 after a decode;
- a prefix hit is the longest k (checked by brute force over every k) for which every
  full group has the whole chain cached and every windowed group the blocks its first
  query reads;
- a refused allocation changes nothing, and is refused only when it does not fit;
- the KV events, replayed from an empty set, are exactly group 0's hash index.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagemill.blockpool import (
    BlockHash,
    HybridKVCacheManager,
    KVCacheGroupSpec,
    get_hash_fn,
)
from pagemill.blockpool.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

NUM_BLOCKS = 24
BLOCK_SIZE = 4
PREFIXES = [[], [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 6], [7] * 12]


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    block_hashes: list[BlockHash] = field(default_factory=list)


class HybridMachine(RuleBasedStateMachine):
    @initialize(
        algo=st.sampled_from(["sha256", "xxh3_128"]),
        window=st.sampled_from([1, 5, 8]),
        layout=st.sampled_from(["full+window", "full+2windows", "window+full+window"]),
    )
    def setup(self, algo: str, window: int, layout: str) -> None:
        full = KVCacheGroupSpec((0,))
        win = [KVCacheGroupSpec((i,), window) for i in (1, 2)]
        groups = {
            "full+window": [full, win[0]],
            "full+2windows": [full, *win],
            "window+full+window": [win[0], full, win[1]],
        }[layout]
        self.window = window
        self.m = HybridKVCacheManager(NUM_BLOCKS, BLOCK_SIZE, groups, hash_algo=algo)
        self.m.block_pool.enable_kv_cache_events(BLOCK_SIZE)
        self.replayed: set[BlockHash] = set()
        self.ngroups = len(groups)
        self.windows = [g.sliding_window for g in groups]
        self.hash_fn = get_hash_fn(algo)
        self.requests: dict[str, Req] = {}
        self.running: set[str] = set()
        self.waiting: list[str] = []
        # Simulated KV per group: slot -> (salt, token, position).
        self.slots: list[dict[int, tuple[str | None, int, int]]] = [{} for _ in groups]
        self.counter = 0
        # Per running request: computed tokens (and hits) when it last allocated; the
        # window's blocks are given back lazily, at the next allocation.
        self.alloc_start: dict[str, int] = {}
        self.max_tokens = self.m.request_capacity_tokens(chunked_prefill=True) or 1000
        event(f"capacity {self.max_tokens} tokens")

    # ---------------------------------------------------------------- helpers

    @property
    def null(self):
        return self.m.block_pool.null_block

    def extra(self, r: Req) -> tuple:
        return () if r.cache_salt is None else (r.cache_salt,)

    def first_read(self, g: int, start: int) -> int:
        """Attention's definition: a query at q reads keys q-W < k <= q."""
        w = self.windows[g]
        return 0 if w is None else max(0, start - w + 1)

    def skip(self, g: int, computed: int) -> int:
        return self.first_read(g, computed) // BLOCK_SIZE

    def snapshot(self) -> tuple:
        pool = self.m.block_pool
        return (
            [b.ref_cnt for b in pool.blocks],
            [b.block_hash for b in pool.blocks],
            [b.block_id for b in pool.free_block_queue],
            [dict(index) for index in pool.group_indexes],
            {rid: [list(t) for t in ts] for rid, ts in self.m.req_to_blocks.items()},
            self.m.prefix_cache_stats,
        )

    def sync_hashes(self, r: Req) -> None:
        assert self.m.block_hasher is not None
        r.block_hashes.extend(self.m.block_hasher(r))

    def compute(self, r: Req, start: int, end: int) -> None:
        """The forward writes each position's KV into every group's slot."""
        for g in range(self.ngroups):
            slots = self.m.slot_mapping(r.request_id, start, end, g)
            for pos, slot in zip(range(start, end), slots):
                self.slots[g][slot] = (r.cache_salt, r.all_token_ids[pos], pos)
        r.num_computed_tokens = end

    def max_chunk(self, start: int, wanted: int) -> int:
        return max(1, min(wanted, self.m.max_num_tokens(start) - start))

    def brute_force_hit(self, r: Req) -> int:
        pool = self.m.block_pool
        chain = r.block_hashes
        for k in range((len(r.all_token_ids) - 1) // BLOCK_SIZE, 0, -1):
            if all(
                pool.get_cached_block(chain[i], g) is not None
                for g in range(self.ngroups)
                for i in range(self.skip(g, k * BLOCK_SIZE), k)
            ):
                return k
        return 0

    def try_allocate(self, r: Req, num_new: int, n_hit: int = 0, hits=None) -> bool:
        before = self.snapshot()
        pool = self.m.block_pool
        tables = self.m.req_to_blocks.get(r.request_id)
        table_len = len(tables[0]) if tables else 0
        computed = r.num_computed_tokens + n_hit
        # Blocks this allocation gives back first, and hit blocks it takes off the queue.
        released = 0
        if tables:
            for g, t in enumerate(tables):
                released += sum(
                    1
                    for j, b in enumerate(t)
                    if b is not self.null and j < self.skip(g, computed) and b.ref_cnt == 1
                )
        in_queue = 0
        if hits is not None:
            in_queue = sum(
                1
                for g, hs in enumerate(hits.blocks)
                for j, b in enumerate(hs)
                if b is not self.null and b.ref_cnt == 0 and j >= self.skip(g, computed)
            )
        free_before = pool.get_num_free_blocks()
        got = self.m.allocate_slots(r, num_new, n_hit, hits)
        total = computed + num_new
        needed = max(0, -(-total // BLOCK_SIZE) - table_len - n_hit // BLOCK_SIZE)
        if got is None:
            event("allocation refused")
            assert self.snapshot() == before, "a failed allocation must change nothing"
            assert needed * self.ngroups > free_before + released - in_queue, "refused but fits"
            return False
        assert [len(x) for x in got.blocks] == [needed] * self.ngroups
        self.alloc_start[r.request_id] = computed
        return True

    def end(self, rid: str) -> None:
        tables = [list(t) for t in self.m.req_to_blocks[rid]]
        self.m.free(rid)
        self.running.discard(rid)
        for t in tables:
            for b in t:
                assert b is self.null or b.ref_cnt >= 0

    # ---------------------------------------------------------------- rules

    @rule(
        prefix=st.sampled_from(PREFIXES),
        tail=st.lists(st.integers(0, 3), max_size=9),
        salt=st.sampled_from([None, None, "s"]),
        data=st.data(),
    )
    def arrive(self, prefix: list[int], tail: list[int], salt: str | None, data) -> None:
        tokens = ((prefix + tail) or [0])[: self.max_tokens]
        rid = f"r{self.counter}"
        self.counter += 1
        self.requests[rid] = Req(rid, tokens, len(tokens), 0, salt)
        self.sync_hashes(self.requests[rid])
        self.waiting.append(rid)
        self.admit(rid, data)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def retry_waiting(self, data: st.DataObject) -> None:
        self.admit(self.waiting[0], data)

    def admit(self, rid: str, data: st.DataObject) -> None:
        r = self.requests[rid]
        assert r.num_computed_tokens == 0 and rid not in self.running
        hits, n_hit = self.m.get_computed_blocks(r)
        k = n_hit // BLOCK_SIZE
        assert k == self.brute_force_hit(r), "the prefix hit is not the longest"
        assert all(len(hs) == k for hs in hits.blocks)
        chain = r.block_hashes
        for g, hs in enumerate(hits.blocks):
            for i, b in enumerate(hs):
                if i < self.skip(g, n_hit):
                    assert b is self.null
                else:
                    assert b.block_hash == chain[i] and b.cache_group == g
        event("prefix hit" if n_hit else "no prefix hit")
        if any(b is self.null for hs in hits.blocks for b in hs):
            event("prefix hit that starts past a window")
        n = len(r.all_token_ids)
        chunk = data.draw(st.integers(1, self.max_chunk(n_hit, n - n_hit)), label="chunk")
        if self.try_allocate(r, chunk, n_hit, hits):
            r.num_computed_tokens = n_hit
            self.compute(r, n_hit, n_hit + chunk)
            self.running.add(rid)
            self.waiting.remove(rid)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)), label="rid")
        r = self.requests[rid]
        remaining = len(r.all_token_ids) - r.num_computed_tokens
        decode = remaining == 0
        if decode:
            if len(r.all_token_ids) >= self.max_tokens:
                return
            r.all_token_ids.append(data.draw(st.integers(0, 3), label="token"))
            self.sync_hashes(r)
            remaining = 1
        start = r.num_computed_tokens
        chunk = data.draw(st.integers(1, self.max_chunk(start, remaining)), label="chunk")
        if self.try_allocate(r, chunk):
            self.compute(r, start, start + chunk)
            if decode:
                bound = -(-self.window // BLOCK_SIZE) + 1
                for g, w in enumerate(self.windows):
                    if w is not None:
                        assert self.m.num_held_blocks(rid, g) <= bound
                        event("decode past the window")
        elif decode:
            r.all_token_ids.pop()
            del r.block_hashes[len(r.all_token_ids) // BLOCK_SIZE :]

    @precondition(lambda self: self.running)
    @rule(data=st.data(), k=st.integers(1, 3 * BLOCK_SIZE))
    def grow(self, data: st.DataObject, k: int) -> None:
        """Tokens arrive faster than one per step (a long prompt's next chunk)."""
        rid = data.draw(st.sampled_from(sorted(self.running)), label="rid")
        r = self.requests[rid]
        k = min(k, self.max_tokens - len(r.all_token_ids))
        if k > 0:
            r.all_token_ids.extend(data.draw(st.lists(st.integers(0, 3), min_size=k, max_size=k)))
            self.sync_hashes(r)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)), label="rid")
        self.end(rid)
        del self.requests[rid]

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)), label="rid")
        self.end(rid)
        self.requests[rid].num_computed_tokens = 0
        self.waiting.append(rid)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fail_step(self, data: st.DataObject) -> None:
        """A failed step: its blocks leave every index (their KV was never written)."""
        rid = data.draw(st.sampled_from(sorted(self.running)), label="rid")
        r = self.requests[rid]
        first = data.draw(st.integers(0, r.num_computed_tokens // BLOCK_SIZE))
        self.m.forget_blocks_from(rid, first)
        for t in self.m.req_to_blocks[rid]:
            assert all(b.block_hash is None for b in t[first:] if b is not self.null)

    @rule()
    def reset(self) -> None:
        ok = self.m.reset_prefix_cache()
        assert ok == (not self.running)

    # ---------------------------------------------------------------- invariants

    @invariant()
    def ref_counts_equal_holders(self) -> None:
        pool = self.m.block_pool
        counts = [0] * NUM_BLOCKS
        assert set(self.m.req_to_blocks) == self.running
        for tables in self.m.req_to_blocks.values():
            assert len(tables) == self.ngroups
            assert len({len(t) for t in tables}) == 1, "group tables of unequal length"
            for t in tables:
                for b in t:
                    if b is not self.null:
                        counts[b.block_id] += 1
        if self.null is not None:
            counts[self.null.block_id] = self.null.ref_cnt
        assert counts == [b.ref_cnt for b in pool.blocks]
        queued = {b.block_id for b in pool.free_block_queue}
        assert len(queued) == self.m.get_num_free_blocks()
        for b in pool.blocks:
            assert (b.block_id in queued) == (b.ref_cnt == 0)
        held = sum(1 for b in pool.blocks if b.ref_cnt > 0 and b is not self.null)
        assert self.m.get_num_free_blocks() + held == self.m.num_usable_blocks

    @invariant()
    def windows_hold_exactly_what_they_read(self) -> None:
        for rid in self.running:
            r = self.requests[rid]
            c = r.num_computed_tokens
            tables = self.m.req_to_blocks[rid]
            assert len(tables[0]) == -(-c // BLOCK_SIZE)
            for g, t in enumerate(tables):
                skip = self.skip(g, self.alloc_start[rid])
                for j, b in enumerate(t):
                    assert (b is self.null) == (j < skip), (g, j, skip)

    @invariant()
    def kv_contents_belong_to_their_request(self) -> None:
        for rid in self.running:
            r = self.requests[rid]
            c = r.num_computed_tokens
            for g in range(self.ngroups):
                lo = self.first_read(g, c)
                slots = self.m.slot_mapping(rid, lo, c, g)
                got = [self.slots[g].get(s) for s in slots]
                want = [(r.cache_salt, r.all_token_ids[p], p) for p in range(lo, c)]
                assert got == want, f"group {g} reads foreign KV"

    @invariant()
    def cached_blocks_carry_their_contents_hash(self) -> None:
        pool = self.m.block_pool
        for g, index in enumerate(pool.group_indexes):
            for h, b in index.items():
                assert b.block_hash == h and b.cache_group == g
        assert sum(b.block_hash is not None for b in pool.blocks) == pool.num_cached_blocks

    @invariant()
    def events_replay_group_zero(self) -> None:
        for e in self.m.block_pool.take_kv_events():
            if isinstance(e, BlockStored):
                assert not self.replayed & set(e.block_hashes)
                self.replayed |= set(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= self.replayed
                self.replayed -= set(e.block_hashes)
            else:
                assert isinstance(e, AllBlocksCleared)
                self.replayed.clear()
        assert self.replayed == set(self.m.block_pool.group_indexes[0])

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        for rid in list(self.running):
            self.end(rid)
        pool = self.m.block_pool
        assert self.m.get_num_free_blocks() == self.m.num_usable_blocks, "blocks leaked"
        assert all(b.ref_cnt == 0 for b in pool.blocks if b is not self.null)
        assert not self.m.req_to_blocks
        assert self.m.reset_prefix_cache() is True


HybridMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
TestHybridKVCacheManager = HybridMachine.TestCase
