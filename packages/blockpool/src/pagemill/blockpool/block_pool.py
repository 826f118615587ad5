"""Physical KV blocks, the O(1) free queue and the pool that hands them out.

The free queue is intrusive (the links live in the blocks themselves) and bounded by two
sentinel nodes, so popleft, append and removal from the middle (a prefix hit reviving a
freed block) are a few pointer writes with no branches for the ends and no scan. A block is
in the free queue exactly when its ref count is 0; the queue order is the eviction order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from pagemill.blockpool.hashing import BlockHash
from pagemill.blockpool.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)

if TYPE_CHECKING:
    from pagemill.blockpool.kv_cache_manager import CacheRequest


class KVCacheBlock:
    """One physical block: its id, how many requests hold it, its prefix hash, free links.

    `cache_group` is the KV cache group whose hash index holds `block_hash` (0 unless the
    pool serves several groups, see `BlockPool`); it is meaningful only while cached.
    """

    __slots__ = ("block_hash", "block_id", "cache_group", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id: int = block_id
        self.ref_cnt: int = 0
        self.block_hash: BlockHash | None = None
        self.cache_group: int = 0
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks between a head and a tail sentinel.

    Membership is read off the links: a block is queued iff its prev_free is set (every
    queued block has at least the head sentinel before it).
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.prev_free is not None

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    def popleft(self) -> KVCacheBlock:
        """Remove and return the block evicted first (the head)."""
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks left in the queue")
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        """Queue `block` last (evicted after everything already queued)."""
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from wherever it sits in the queue."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Queue contents head to tail (for tests and debugging; O(n))."""
        return list(self)


class BlockPool:
    """All physical blocks, their ref counts, the free queue and the prefix-hash index.

    The hash index maps each cached hash to exactly one block. A freed block keeps its hash
    (it can still be hit) until get_new_blocks pops it for reuse, which evicts the hash.

    With `reserve_null_block`, block 0 is taken for good as `null_block`: the id a block
    table holds where a sliding-window request has given its block back (vLLM's null
    block). No slot of it is ever written, so whatever reads it reads zeros, never another
    request's KV; it is never free and never cached.

    With `num_cache_groups` > 1 (a model whose layers form several KV cache groups, see
    `kv_cache_coordinator`) the blocks of one pool serve every group, but the same token
    prefix is different KV in each group (other layers), so each group has its own hash
    index (`group_indexes`); a cached block remembers its group for eviction. Group 0's
    index is `cached_block_hash_to_block` and the only one KV events describe: the stream
    stays an exact replay of one index, and group 0 is the one holding whole chains
    (full attention, when the model has any).
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        reserve_null_block: bool = False,
        num_cache_groups: int = 1,
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int):
            raise TypeError(f"num_blocks must be an int, got {type(num_blocks).__name__}")
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        if num_cache_groups < 1:
            raise ValueError(f"num_cache_groups must be at least 1, got {num_cache_groups}")
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.group_indexes: list[dict[BlockHash, KVCacheBlock]] = [
            self.cached_block_hash_to_block
        ] + [{} for _ in range(num_cache_groups - 1)]
        # Cached blocks handed out for reuse (their hash dropped from the index), ever. Read
        # by observers (the server's dashboard); one add per allocation that evicts.
        self.num_evictions = 0
        # Index changes since the last take_kv_events(); None: nobody listens (the default).
        self.kv_events: list[KVCacheEvent] | None = None
        self._event_block_size = 0
        self.null_block: KVCacheBlock | None = None
        if reserve_null_block:
            if num_blocks < 2:
                raise ValueError("a pool with a null block needs at least 2 blocks")
            self.null_block = self.get_new_blocks(1)[0]
        # Blocks a request can ever hold (the null block is nobody's).
        self.num_usable_blocks = num_blocks - (1 if reserve_null_block else 0)

    def enable_kv_cache_events(self, block_size: int) -> None:
        """Record every change of the hash index from now on (see kv_events)."""
        self.kv_events = []
        self._event_block_size = block_size

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The events recorded since the previous call, oldest first."""
        events = self.kv_events
        if not events:
            return []
        self.kv_events = []
        return events

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(index) for index in self.group_indexes)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop `n` blocks off the free queue head, evicting their hashes; each gets ref 1."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        queue = self.free_block_queue
        if n > queue.num_free_blocks:
            raise ValueError(
                f"cannot allocate {n} blocks: only {queue.num_free_blocks} of "
                f"{self.num_blocks} are free"
            )
        # Unlink the first n blocks in one splice rather than n separate removals.
        popped: list[KVCacheBlock] = []
        head = queue._head
        node = head.next_free
        indexes = self.group_indexes
        evicted = 0
        removed: list[BlockHash] | None = None if self.kv_events is None else []
        for _ in range(n):
            assert node is not None and node.ref_cnt == 0
            nxt = node.next_free
            node.prev_free = node.next_free = None
            h = node.block_hash
            if h is not None:
                group = node.cache_group
                index = indexes[group]
                if index.get(h) is node:
                    del index[h]
                    evicted += 1
                    if removed is not None and group == 0:
                        removed.append(h)
                node.block_hash = None
            node.ref_cnt = 1
            popped.append(node)
            node = nxt
        assert node is not None
        head.next_free = node
        node.prev_free = head
        queue.num_free_blocks -= n
        if evicted:
            self.num_evictions += evicted
            if removed and self.kv_events is not None:
                self.kv_events.append(BlockRemoved(removed))
        return popped

    def get_cached_block(self, block_hash: BlockHash, group: int = 0) -> KVCacheBlock | None:
        if not self.enable_caching:
            return None
        return self.group_indexes[group].get(block_hash)

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix hit); revive freed ones."""
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        request: CacheRequest | None = None,
        first_block: int = 0,
        group: int = 0,
    ) -> None:
        """Register full blocks under their hashes (in `group`'s index).

        A block that already has a hash is left alone, and so is a block whose hash another
        block already holds: the index never has two blocks for one hash, and the duplicate
        simply stays uncached (it is still valid for its own request).

        `request` (whose block `first_block` is `blocks[0]`) is read only for KV events:
        their token ids and parent hash.
        """
        if len(blocks) != len(block_hashes):
            raise ValueError(
                f"cache_full_blocks got {len(blocks)} blocks but {len(block_hashes)} hashes"
            )
        if not self.enable_caching:
            return
        index = self.group_indexes[group]
        stored: list[int] | None = None if self.kv_events is None or group else []
        for i, (block, h) in enumerate(zip(blocks, block_hashes)):
            if block.block_hash is not None:
                if block.block_hash != h:
                    raise ValueError(
                        f"block {block.block_id} is already cached under a different hash"
                    )
                continue
            if h in index:
                continue
            block.block_hash = h
            block.cache_group = group
            index[h] = block
            if stored is not None:
                stored.append(i)
        if stored:
            self._record_stored(stored, block_hashes, request, first_block)

    def _record_stored(
        self,
        stored: list[int],
        block_hashes: Sequence[BlockHash],
        request: CacheRequest | None,
        first_block: int,
    ) -> None:
        """One BlockStored per run of consecutive newly indexed blocks, so that each
        event's hashes form one chain and its token ids line up with them."""
        assert self.kv_events is not None
        bs = self._event_block_size
        tokens = request.all_token_ids if request is not None else ()
        earlier = request.block_hashes if request is not None else ()
        start = 0
        while start < len(stored):
            end = start + 1
            while end < len(stored) and stored[end] == stored[end - 1] + 1:
                end += 1
            lo, hi = stored[start], stored[end - 1] + 1
            if lo > 0:
                parent: BlockHash | None = block_hashes[lo - 1]
            else:
                parent = earlier[first_block - 1] if first_block > 0 and earlier else None
            first_token = (first_block + lo) * bs
            self.kv_events.append(
                BlockStored(
                    list(block_hashes[lo:hi]),
                    parent,
                    list(tokens[first_token : first_token + (hi - lo) * bs]),
                    bs,
                )
            )
            start = end

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop these blocks' hashes from the index (their KV is not to be trusted)."""
        indexes = self.group_indexes
        removed: list[BlockHash] = []
        for block in blocks:
            h = block.block_hash
            if h is not None:
                index = indexes[block.cache_group]
                if index.get(h) is block:
                    del index[h]
                    if block.cache_group == 0:
                        removed.append(h)
                block.block_hash = None
        if removed and self.kv_events is not None:
            self.kv_events.append(BlockRemoved(removed))

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block; blocks reaching 0 join the queue tail in this order."""
        queue = self.free_block_queue
        done: list[KVCacheBlock] = []
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                # Undo this call's work so that a bad call changes nothing.
                for prev in reversed(done):
                    if prev.ref_cnt == 0:
                        queue.remove(prev)
                    prev.ref_cnt += 1
                raise ValueError(
                    f"block {block.block_id} freed more often than it was taken "
                    f"(ref count {block.ref_cnt})"
                )
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                queue.append(block)
            done.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False, nothing changed) while a block is held."""
        if self.free_block_queue.num_free_blocks != self.num_usable_blocks:
            return False
        for index in self.group_indexes:
            index.clear()
        for block in self.blocks:
            block.block_hash = None
        if self.kv_events is not None:
            self.kv_events.append(AllBlocksCleared())
        return True

    def get_usage(self) -> float:
        """Fraction of the usable blocks held by at least one request."""
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_usable_blocks
