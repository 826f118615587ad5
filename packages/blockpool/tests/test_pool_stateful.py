"""Stateful property test of BlockPool against a plain-list model of the free queue.

The model mirrors the queue order exactly (pop head, append tail, remove from the middle),
so every step checks not only the counting invariants but the precise LRU eviction order.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagemill.blockpool import BlockPool, KVCacheBlock

NUM_BLOCKS = 8
HASHES = [bytes([i]) for i in range(6)]  # a small alphabet so duplicate hashes happen


class BlockPoolMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.pool = BlockPool(NUM_BLOCKS)
        self.model_queue: list[int] = list(range(NUM_BLOCKS))
        self.holders: list[list[KVCacheBlock]] = []

    def snapshot(self) -> tuple:
        pool = self.pool
        return (
            [b.ref_cnt for b in pool.blocks],
            [b.block_hash for b in pool.blocks],
            [b.block_id for b in pool.free_block_queue],
            dict(pool.cached_block_hash_to_block),
        )

    @rule(n=st.integers(0, NUM_BLOCKS + 1))
    def allocate(self, n: int) -> None:
        if n > len(self.model_queue):
            before = self.snapshot()
            try:
                self.pool.get_new_blocks(n)
            except ValueError:
                pass
            else:
                raise AssertionError("over-allocation must raise")
            assert self.snapshot() == before
            return
        index_before = dict(self.pool.cached_block_hash_to_block)
        got = self.pool.get_new_blocks(n)
        assert [b.block_id for b in got] == self.model_queue[:n]
        del self.model_queue[:n]
        for b in got:
            assert b.ref_cnt == 1 and b.block_hash is None
            assert all(v is not b for v in self.pool.cached_block_hash_to_block.values())
        # Only the popped blocks' hashes were evicted.
        evicted = {h for h, b in index_before.items() if b in got}
        assert set(index_before) - set(self.pool.cached_block_hash_to_block) == evicted
        if got:
            self.holders.append(got)

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def cache(self, data: st.DataObject) -> None:
        blocks = data.draw(st.sampled_from(self.holders))
        hashes = [data.draw(st.sampled_from(HASHES)) for _ in blocks]
        uncached = [b for b in blocks if b.block_hash is None]
        index = self.pool.cached_block_hash_to_block
        expect = {}
        taken = set(index)
        for b, h in zip(blocks, hashes):
            if b.block_hash is None and h not in taken:
                expect[b.block_id] = h
                taken.add(h)
        blocks_to_cache = [b for b, h in zip(blocks, hashes) if b.block_hash in (None, h)]
        hashes_to_cache = [h for b, h in zip(blocks, hashes) if b.block_hash in (None, h)]
        self.pool.cache_full_blocks(blocks_to_cache, hashes_to_cache)
        for b in uncached:
            assert b.block_hash == expect.get(b.block_id)

    @rule(h=st.sampled_from(HASHES), times=st.integers(1, 2))
    def hit(self, h: bytes, times: int) -> None:
        block = self.pool.get_cached_block(h)
        if block is None:
            return
        assert block.block_hash == h
        if block.ref_cnt == 0:
            self.model_queue.remove(block.block_id)
        self.pool.touch([block] * times)
        for _ in range(times):
            self.holders.append([block])

    @precondition(lambda self: self.holders)
    @rule(data=st.data(), reverse=st.booleans())
    def free(self, data: st.DataObject, reverse: bool) -> None:
        i = data.draw(st.integers(0, len(self.holders) - 1))
        blocks = self.holders.pop(i)
        order = list(reversed(blocks)) if reverse else blocks
        self.pool.free_blocks(order)
        for b in order:
            if b.ref_cnt == 0:
                self.model_queue.append(b.block_id)

    @precondition(lambda self: any(b.ref_cnt == 0 for b in self.pool.blocks))
    @rule(data=st.data())
    def double_free_is_refused(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from([b for b in self.pool.blocks if b.ref_cnt == 0]))
        before = self.snapshot()
        try:
            self.pool.free_blocks([block])
        except ValueError:
            pass
        else:
            raise AssertionError("freeing a free block must raise")
        assert self.snapshot() == before

    @rule()
    def reset(self) -> None:
        in_use = bool(self.holders)
        before = self.snapshot()
        assert self.pool.reset_prefix_cache() is (not in_use)
        if in_use:
            assert self.snapshot() == before
        else:
            assert not self.pool.cached_block_hash_to_block

    @invariant()
    def queue_matches_model(self) -> None:
        assert [b.block_id for b in self.pool.free_block_queue] == self.model_queue

    @invariant()
    def counts_add_up(self) -> None:
        pool = self.pool
        free = pool.get_num_free_blocks()
        referenced = sum(1 for b in pool.blocks if b.ref_cnt > 0)
        assert free + referenced == NUM_BLOCKS
        assert (
            len(pool.free_block_queue.get_all_free_blocks()) == free == len(pool.free_block_queue)
        )
        assert pool.get_usage() == referenced / NUM_BLOCKS

    @invariant()
    def queued_iff_unreferenced(self) -> None:
        queued = {b.block_id for b in self.pool.free_block_queue}
        for b in self.pool.blocks:
            assert b.ref_cnt >= 0
            assert (b.block_id in queued) == (b.ref_cnt == 0) == (b in self.pool.free_block_queue)

    @invariant()
    def ref_count_equals_holders(self) -> None:
        counts = [0] * NUM_BLOCKS
        for blocks in self.holders:
            for b in blocks:
                counts[b.block_id] += 1
        assert counts == [b.ref_cnt for b in self.pool.blocks]

    @invariant()
    def hash_index_is_consistent(self) -> None:
        index = self.pool.cached_block_hash_to_block
        for h, b in index.items():
            assert b.block_hash == h
        hashed = [b for b in self.pool.blocks if b.block_hash is not None]
        assert len(hashed) == len(index)  # no block carries a hash the index lacks

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        for blocks in self.holders:
            self.pool.free_blocks(blocks)
        assert self.pool.get_num_free_blocks() == NUM_BLOCKS
        assert all(b.ref_cnt == 0 for b in self.pool.blocks)


BlockPoolMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None
)
TestBlockPool = BlockPoolMachine.TestCase
