"""KV events: the stream the pool records, applied to an empty index, is the pool's index.

The stateful machine of test_manager_stateful (admissions with prefix hits, chunked
prefill, decode, preemption, eviction, prefix-cache resets) runs with events on; after
every rule the hashes stored minus those removed (a clear empties the set) must equal the
pool's hash index, every BlockStored must re-hash from its own parent and token ids, and
no event may store a hash already held or remove one not held.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant

from pagemill.blockpool import BlockPool, hash_block_chain
from pagemill.blockpool.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

# The tests run with --import-mode=importlib: load the sibling module by path.
_spec = importlib.util.spec_from_file_location(
    "manager_stateful", Path(__file__).with_name("test_manager_stateful.py")
)
assert _spec is not None and _spec.loader is not None
_base = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _base
_spec.loader.exec_module(_base)
BLOCK_SIZE = _base.BLOCK_SIZE


class EventsMachine(_base.ManagerMachine):  # type: ignore[misc,name-defined]
    @initialize(algo=st.sampled_from(["sha256", "xxh3_128"]))
    def setup(self, algo: str) -> None:
        super().setup(algo)
        self.m.block_pool.enable_kv_cache_events(BLOCK_SIZE)
        self.index: set[bytes] = set()

    @invariant()
    def events_rebuild_the_index(self) -> None:
        for ev in self.m.block_pool.take_kv_events():
            if isinstance(ev, BlockStored):
                assert ev.block_size == BLOCK_SIZE
                assert len(ev.token_ids) == BLOCK_SIZE * len(ev.block_hashes)
                rehashed = [
                    hash_block_chain(
                        self.hash_fn, ev.token_ids, BLOCK_SIZE, extra, ev.parent_block_hash
                    )
                    for extra in ((), ("s",))
                ]
                assert ev.block_hashes in rehashed
                for h in ev.block_hashes:
                    assert h not in self.index
                    self.index.add(h)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    assert h in self.index
                    self.index.remove(h)
            else:
                assert isinstance(ev, AllBlocksCleared)
                self.index.clear()
        assert self.index == set(self.m.block_pool.cached_block_hash_to_block)


EventsMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestKVEvents = EventsMachine.TestCase


def test_events_off_records_nothing() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"a", b"b"])
    pool.free_blocks(blocks)
    pool.get_new_blocks(4)
    assert pool.kv_events is None
    assert pool.take_kv_events() == []
