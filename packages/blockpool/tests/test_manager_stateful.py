"""Stateful property test of KVCacheManager driven like a scheduler would drive it.

Requests with overlapping prompts (a few shared prefixes, two salts) are admitted with
prefix hits, prefilled in chunks, decoded token by token, preempted and finished in random
order. Besides the block accounting, the machine simulates the KV contents: every computed
position writes (salt, token) into its slot, and every step checks that each running
request's slots hold exactly its own tokens. A wrongly shared, evicted or reused block
would show up there as foreign data. Block hashes live on the requests, extended through
the manager's `block_hasher` whenever tokens arrive, as the scheduler does.

`WindowManagerMachine` drives a sliding-window manager the same way, with requests longer
than the whole pool: blocks no later query can read must have been given back (the null
block in their place, checked against attention's own definition), the KV of every
position a later query reads must still be the request's own, and the pool must be whole
again once every request has ended.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagemill.blockpool import BlockHash, KVCacheManager, get_hash_fn, hash_block_chain

NUM_BLOCKS = 12
BLOCK_SIZE = 4
MAX_TOKENS = 40  # 10 blocks: one request alone always fits in the pool
PREFIXES = [[], [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 6], [7] * 8]


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    block_hashes: list[BlockHash] = field(default_factory=list)


class ManagerMachine(RuleBasedStateMachine):
    max_tokens = MAX_TOKENS

    @initialize(algo=st.sampled_from(["sha256", "xxh3_128"]))
    def setup(self, algo: str) -> None:
        self.m = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, hash_algo=algo)
        self.init_state(algo)

    def init_state(self, algo: str) -> None:
        self.hash_fn = get_hash_fn(algo)
        self.requests: dict[str, Req] = {}
        self.running: set[str] = set()
        self.waiting: list[str] = []
        self.slots: dict[int, tuple[str | None, int]] = {}  # simulated KV contents
        self.counter = 0
        self.expected_stats = [0, 0, 0]  # since the last make_prefix_cache_stats()
        self.expected_totals = [0, 0, 0]

    # ---------------------------------------------------------------- helpers

    def snapshot(self) -> tuple:
        pool = self.m.block_pool
        return (
            [b.ref_cnt for b in pool.blocks],
            [b.block_hash for b in pool.blocks],
            [b.block_id for b in pool.free_block_queue],
            dict(pool.cached_block_hash_to_block),
            {rid: list(t) for rid, t in self.m.req_to_blocks.items()},
            self.m.prefix_cache_stats,
        )

    def sync_hashes(self, r: Req) -> None:
        assert self.m.block_hasher is not None
        r.block_hashes.extend(self.m.block_hasher(r))

    def count_admission(self, r: Req, n_hit: int) -> None:
        for stats in (self.expected_stats, self.expected_totals):
            stats[0] += 1
            stats[1] += len(r.all_token_ids)
            stats[2] += n_hit

    def compute(self, r: Req, start: int, end: int) -> None:
        """Simulate the forward pass writing KV for positions [start, end)."""
        for pos, slot in zip(range(start, end), self.m.slot_mapping(r.request_id, start, end)):
            self.slots[slot] = (r.cache_salt, r.all_token_ids[pos])
        r.num_computed_tokens = end

    def check_hits(self, r: Req, hits: list) -> None:
        """The longest full-block prefix whose blocks are all cached."""
        n = len(r.all_token_ids)
        chain = hash_block_chain(self.hash_fn, r.all_token_ids, BLOCK_SIZE, self.extra(r))
        assert [b.block_hash for b in hits] == chain[: len(hits)]
        if len(hits) < (n - 1) // BLOCK_SIZE:
            assert self.m.block_pool.get_cached_block(chain[len(hits)]) is None

    def max_chunk(self, r: Req, start: int, wanted: int) -> int:
        """Most tokens a step starting at `start` may take (the scheduler's cap)."""
        return wanted

    def released_free(self, r: Req, start: int) -> int:
        """Blocks this allocation gives back to the free queue first (window only)."""
        return 0

    def try_allocate(self, r: Req, num_new: int, n_hit: int = 0, hits=()) -> bool:
        before = self.snapshot()
        free_before = self.m.get_num_free_blocks()
        table_len = len(self.m.req_to_blocks.get(r.request_id, ()))
        released = self.released_free(r, r.num_computed_tokens + n_hit)
        in_queue_before = sum(1 for b in hits if b.ref_cnt == 0)
        got = self.m.allocate_slots(r, num_new, n_hit, list(hits))
        total = r.num_computed_tokens + n_hit + num_new
        needed = max(0, -(-total // BLOCK_SIZE) - table_len - len(hits))
        if got is None:
            event("allocation refused")
            assert self.snapshot() == before, "a failed allocation must change nothing"
            assert needed > free_before + released - in_queue_before, "refused although it fits"
            return False
        assert len(got) == needed
        return True

    def preempt_or_finish(self, rid: str) -> None:
        table = list(self.m.req_to_blocks[rid])
        queue_before = [b.block_id for b in self.m.block_pool.free_block_queue]
        self.m.free(rid)
        self.running.discard(rid)
        # LRU: the blocks this free released join the queue tail, the request's tail first.
        released = [b.block_id for b in reversed(table) if b.ref_cnt == 0]
        assert [b.block_id for b in self.m.block_pool.free_block_queue] == queue_before + released

    # ---------------------------------------------------------------- rules

    @rule(
        prefix=st.sampled_from(PREFIXES),
        tail=st.lists(st.integers(0, 3), max_size=9),
        salt=st.sampled_from([None, None, "s"]),
        data=st.data(),
    )
    def arrive(self, prefix: list[int], tail: list[int], salt: str | None, data) -> None:
        """A new request arrives and the scheduler tries to admit it at once."""
        tokens = (prefix + tail) or [0]
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
        n = len(r.all_token_ids)
        # Longest full-block prefix, capped so the last token is recomputed.
        assert n_hit == len(hits) * BLOCK_SIZE and n_hit <= n - 1
        self.check_hits(r, hits)
        event("prefix hit" if n_hit else "no prefix hit")
        chunk = data.draw(st.integers(1, self.max_chunk(r, n_hit, n - n_hit)), label="chunk")
        if self.try_allocate(r, chunk, n_hit, hits):
            self.count_admission(r, n_hit)  # a refused admission is looked up again later
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
        if remaining == 0:  # decode: the sampled token joins the sequence, then is computed
            if len(r.all_token_ids) >= self.max_tokens:
                return
            r.all_token_ids.append(data.draw(st.integers(0, 3), label="token"))
            self.sync_hashes(r)
            event("decode")
            remaining = 1
        start = r.num_computed_tokens
        chunk = data.draw(st.integers(1, self.max_chunk(r, start, remaining)), label="chunk")
        if self.try_allocate(r, chunk):
            self.compute(r, start, start + chunk)
        elif remaining == 1 and len(r.all_token_ids) > r.num_prompt_tokens:
            r.all_token_ids.pop()  # the token is resampled after the next successful step
            del r.block_hashes[len(r.all_token_ids) // BLOCK_SIZE :]

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)), label="rid")
        self.preempt_or_finish(rid)
        del self.requests[rid]

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        """Free a running request and queue it for recomputation from scratch."""
        rid = data.draw(st.sampled_from(sorted(self.running)), label="rid")
        self.preempt_or_finish(rid)
        self.requests[rid].num_computed_tokens = 0
        self.waiting.append(rid)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt_and_readmit(self, data: st.DataObject) -> None:
        """Free a running request and admit it again: its own blocks should come back."""
        rid = data.draw(st.sampled_from(sorted(self.running)), label="rid")
        r = self.requests[rid]
        cached_prefix = 0
        for b in self.m.req_to_blocks[rid]:
            if b.block_hash is None:
                break
            cached_prefix += 1
        self.preempt_or_finish(rid)
        r.num_computed_tokens = 0
        hits, n_hit = self.m.get_computed_blocks(r)
        # Its cached blocks were just freed, not evicted: they must all hit (up to the cap).
        # (A full block left uncached as a duplicate may miss once its twin is evicted.)
        cap = (len(r.all_token_ids) - 1) // BLOCK_SIZE
        assert len(hits) >= min(cached_prefix, cap)
        n = len(r.all_token_ids)
        end = n_hit + self.max_chunk(r, n_hit, n - n_hit)
        if self.try_allocate(r, end - n_hit, n_hit, hits):
            self.count_admission(r, n_hit)
            r.num_computed_tokens = n_hit
            self.compute(r, n_hit, end)
            self.running.add(rid)
        else:  # other requests hold the rest of the pool
            self.waiting.append(rid)

    @rule(rid=st.sampled_from(["ghost", "r0"]))
    def free_unknown(self, rid: str) -> None:
        if rid in self.running:
            return
        before = self.snapshot()
        try:
            self.m.free(rid)
        except KeyError:
            pass
        else:
            raise AssertionError("freeing an unknown request must raise KeyError")
        assert self.snapshot() == before

    @rule()
    def stats(self) -> None:
        s = self.m.make_prefix_cache_stats()
        assert [s.requests, s.queries, s.hits] == self.expected_stats
        self.expected_stats = [0, 0, 0]
        t = self.m.prefix_cache_stats
        assert [t.requests, t.queries, t.hits] == self.expected_totals

    # ---------------------------------------------------------------- invariants

    def extra(self, r: Req) -> tuple:
        return () if r.cache_salt is None else (r.cache_salt,)

    @invariant()
    def accounting(self) -> None:
        pool = self.m.block_pool
        free = self.m.get_num_free_blocks()
        referenced = sum(1 for b in pool.blocks if b.ref_cnt > 0)
        assert free + referenced == NUM_BLOCKS
        queued = pool.free_block_queue.get_all_free_blocks()
        assert len(queued) == free
        queued_ids = {b.block_id for b in queued}
        for b in pool.blocks:
            assert (b.block_id in queued_ids) == (b.ref_cnt == 0)

    @invariant()
    def shared_ref_counts_equal_holders(self) -> None:
        counts = [0] * NUM_BLOCKS
        assert set(self.m.req_to_blocks) == self.running
        for table in self.m.req_to_blocks.values():
            assert len(set(map(id, table))) == len(table)
            for b in table:
                counts[b.block_id] += 1
        assert counts == [b.ref_cnt for b in self.m.block_pool.blocks]

    @invariant()
    def the_table_is_one_table(self) -> None:
        """What the manager reports of a table (ids, length) is its one table, read fresh."""
        for rid, table in self.m.req_to_blocks.items():
            ids = self.m.get_block_ids(rid)
            assert ids == [b.block_id for b in table] and ids is not self.m.get_block_ids(rid)
            assert self.m.num_request_blocks(rid) == len(table)
            assert self.m.has_request(rid)
        assert self.m.num_request_blocks("never-seen") == 0

    @invariant()
    def tables_cover_exactly_the_computed_tokens(self) -> None:
        for rid in self.running:
            r = self.requests[rid]
            assert len(self.m.req_to_blocks[rid]) == -(-r.num_computed_tokens // BLOCK_SIZE)

    @invariant()
    def kv_contents_belong_to_their_request(self) -> None:
        for rid in self.running:
            r = self.requests[rid]
            slots = self.m.slot_mapping(rid, 0, r.num_computed_tokens)
            got = [self.slots.get(s) for s in slots]
            want = [(r.cache_salt, t) for t in r.all_token_ids[: r.num_computed_tokens]]
            assert got == want

    @invariant()
    def cached_hashes_match_contents(self) -> None:
        index = self.m.block_pool.cached_block_hash_to_block
        for h, b in index.items():
            assert b.block_hash == h
        assert sum(b.block_hash is not None for b in self.m.block_pool.blocks) == len(index)
        for rid in self.running:
            r = self.requests[rid]
            chain = hash_block_chain(self.hash_fn, r.all_token_ids, BLOCK_SIZE, self.extra(r))
            table = self.m.req_to_blocks[rid]
            full = r.num_computed_tokens // BLOCK_SIZE
            for i, b in enumerate(table):
                # A full block may stay uncached (another block held its hash when it
                # filled), but a cached one always carries its own content's hash.
                if b.block_hash is not None:
                    assert i < full and b.block_hash == chain[i]

    @invariant()
    def request_hashes_cover_exactly_the_full_blocks(self) -> None:
        for r in self.requests.values():
            assert r.block_hashes == hash_block_chain(
                self.hash_fn, r.all_token_ids, BLOCK_SIZE, self.extra(r)
            )

    @invariant()
    def equal_chains_iff_equal_prefixes(self) -> None:
        reqs = [self.requests[rid] for rid in sorted(self.running)]
        chains = [r.block_hashes for r in reqs]
        for a, ca in zip(reqs, chains):
            for b, cb in zip(reqs, chains):
                for i in range(min(len(ca), len(cb))):
                    end = (i + 1) * BLOCK_SIZE
                    same = a.all_token_ids[:end] == b.all_token_ids[:end] and (
                        a.cache_salt == b.cache_salt
                    )
                    assert (ca[i] == cb[i]) == same

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        for rid in list(self.running):
            self.preempt_or_finish(rid)
        pool = self.m.block_pool
        assert self.m.get_num_free_blocks() == NUM_BLOCKS, "blocks leaked"
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        assert not self.m.req_to_blocks
        assert self.m.reset_prefix_cache() is True


ManagerMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
TestKVCacheManager = ManagerMachine.TestCase


class WindowManagerMachine(ManagerMachine):
    """The same life cycle with a sliding window, requests growing past the whole pool."""

    max_tokens = 3 * NUM_BLOCKS * BLOCK_SIZE

    @initialize(algo=st.sampled_from(["sha256", "xxh3_128"]), window=st.sampled_from([1, 5, 8]))
    def setup(self, algo: str, window: int) -> None:  # type: ignore[override]
        self.window = window
        self.m = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, hash_algo=algo, sliding_window=window)
        self.init_state(algo)
        # Per running request: where the earliest query of its last allocation stood.
        self.alloc_start: dict[str, int] = {}

    @precondition(lambda self: self.running)
    @rule(data=st.data(), k=st.integers(1, 3 * BLOCK_SIZE))
    def grow(self, data: st.DataObject, k: int) -> None:
        """Tokens arrive faster than one per step, so requests outgrow the pool."""
        rid = data.draw(st.sampled_from(sorted(self.running)), label="rid")
        r = self.requests[rid]
        k = min(k, self.max_tokens - len(r.all_token_ids))
        if k <= 0:
            return
        r.all_token_ids.extend(data.draw(st.lists(st.integers(0, 3), min_size=k, max_size=k)))
        self.sync_hashes(r)
        if len(r.all_token_ids) > (NUM_BLOCKS - 1) * BLOCK_SIZE:
            event("request longer than the pool")

    @property
    def null(self):
        return self.m.block_pool.null_block

    def first_read(self, start: int) -> int:
        """Attention's definition: a query at q reads keys q-W < k <= q."""
        return max(0, start - self.window + 1)

    def check_hits(self, r: Req, hits: list) -> None:
        chain = hash_block_chain(self.hash_fn, r.all_token_ids, BLOCK_SIZE, self.extra(r))
        first = self.first_read(len(hits) * BLOCK_SIZE)
        for i, b in enumerate(hits):
            if b is self.null:
                assert (i + 1) * BLOCK_SIZE <= first, "a block the window reads is missing"
            else:
                assert b.block_hash == chain[i]

    def max_chunk(self, r: Req, start: int, wanted: int) -> int:
        return max(1, min(wanted, self.m.max_num_tokens(start) - start))

    def released_free(self, r: Req, start: int) -> int:
        table = self.m.req_to_blocks.get(r.request_id, [])
        return sum(
            1
            for j, b in enumerate(table)
            if b is not self.null
            and (j + 1) * BLOCK_SIZE <= self.first_read(start)
            and b.ref_cnt == 1
        )

    def try_allocate(self, r: Req, num_new: int, n_hit: int = 0, hits=()) -> bool:
        start = r.num_computed_tokens + n_hit
        ok = super().try_allocate(r, num_new, n_hit, hits)
        if ok:
            self.alloc_start[r.request_id] = start
        return ok

    @invariant()
    def shared_ref_counts_equal_holders(self) -> None:
        counts = [0] * NUM_BLOCKS
        counts[self.null.block_id] = 1  # the manager's own reference
        assert set(self.m.req_to_blocks) == self.running
        for table in self.m.req_to_blocks.values():
            live = [b for b in table if b is not self.null]
            assert len(set(map(id, live))) == len(live)
            for b in live:
                counts[b.block_id] += 1
        assert counts == [b.ref_cnt for b in self.m.block_pool.blocks]
        assert self.null not in self.m.block_pool.free_block_queue
        assert self.null.block_hash is None

    @invariant()
    def blocks_behind_the_window_are_given_back(self) -> None:
        """Exactly the blocks no query from the last allocation on reads are null, and the
        held count says so."""
        for rid in self.running:
            first = self.first_read(self.alloc_start[rid])
            table = self.m.req_to_blocks[rid]
            for j, b in enumerate(table):
                assert (b is self.null) == ((j + 1) * BLOCK_SIZE <= first), (rid, j, first)
            held = sum(b is not self.null for b in table)
            assert self.m.num_held_blocks(rid) == held
            event("window blocks given back" if held < len(table) else "whole table held")

    @invariant()
    def kv_contents_belong_to_their_request(self) -> None:
        """Every key a later query reads is still the request's own."""
        for rid in self.running:
            r = self.requests[rid]
            c = r.num_computed_tokens
            lo = self.first_read(self.alloc_start[rid])
            slots = self.m.slot_mapping(rid, lo, c)
            got = [self.slots.get(s) for s in slots]
            want = [(r.cache_salt, t) for t in r.all_token_ids[lo:c]]
            assert got == want

    def preempt_or_finish(self, rid: str) -> None:
        super().preempt_or_finish(rid)
        self.alloc_start.pop(rid, None)

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        for rid in list(self.running):
            self.preempt_or_finish(rid)
        pool = self.m.block_pool
        assert self.m.get_num_free_blocks() == NUM_BLOCKS - 1, "blocks leaked"
        assert all(b.ref_cnt == 0 for b in pool.blocks if b is not self.null)
        assert not self.m.req_to_blocks
        assert self.m.reset_prefix_cache() is True


WindowManagerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=100, deadline=None
)
TestWindowKVCacheManager = WindowManagerMachine.TestCase
