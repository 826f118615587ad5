"""Per-request block tables on top of the block pool, with prefix caching.

The manager owns the mapping request -> list of blocks and keeps, per request, the chained
hashes of its full blocks. Hashes are extended incrementally (only blocks that became full
since the last call are hashed), so per-step work is proportional to new tokens, not to the
prompt length.

Cache salt: a request's `cache_salt` (when not None) is placed in the extra keys of *every*
block, not only the first. Chaining alone would already propagate it, but per-block salting
keeps each hash self-contained, so tenants with different salts never share a block.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from pagemill.blockpool.block_pool import BlockPool, KVCacheBlock
from pagemill.blockpool.hashing import BlockHash, get_hash_fn, hash_block_tokens


@runtime_checkable
class CacheRequest(Protocol):
    """What the manager reads from a request; `all_token_ids` only ever grows."""

    request_id: str
    all_token_ids: Sequence[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    cache_salt: str | None


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the last reset, in tokens (requests counted once per lookup)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class _RequestHashes:
    """Block hashes of one request, tied to the request object they were computed from.

    The owner check protects against a request id being reused by a different request whose
    stale hashes would otherwise be served (silent KV corruption).
    """

    __slots__ = ("hashes", "owner", "salt")

    def __init__(self, owner: object, salt: str | None) -> None:
        self.owner = owner
        self.salt = salt
        self.hashes: list[BlockHash] = []

    def get_owner(self) -> object:
        return self.owner() if isinstance(self.owner, weakref.ref) else self.owner


class KVCacheManager:
    """Grants KV blocks to requests, shares prefix-cache hits, and releases blocks in LRU order."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int):
            raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.num_blocks = self.block_pool.num_blocks
        self.enable_caching = enable_caching
        self.hash_algo = hash_algo
        self._hash_fn = get_hash_fn(hash_algo)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Number of leading blocks of each table already registered in the hash index.
        self._num_cached_blocks: dict[str, int] = {}
        self._req_hashes: dict[str, _RequestHashes] = {}
        self._stats = PrefixCacheStats()

    # ------------------------------------------------------------------ hashing

    def _hash_entry(self, request: CacheRequest) -> _RequestHashes:
        rid = request.request_id
        entry = self._req_hashes.get(rid)
        salt = request.cache_salt
        if entry is not None and entry.get_owner() is request and entry.salt == salt:
            return entry
        try:
            owner: object = weakref.ref(request, self._forget_hashes_cb(rid))
        except TypeError:  # objects without weakref support are held strongly until free()
            owner = request
        entry = _RequestHashes(owner, salt)
        self._req_hashes[rid] = entry
        return entry

    def _forget_hashes_cb(self, rid: str):
        # Drop the hash list of a request that was garbage collected without free()
        # (e.g. aborted while waiting), unless a newer request took over the id.
        manager_ref = weakref.ref(self)

        def callback(dead: weakref.ref) -> None:
            manager = manager_ref()
            if manager is None:
                return
            entry = manager._req_hashes.get(rid)
            if entry is not None and entry.owner is dead:
                del manager._req_hashes[rid]

        return callback

    def get_block_hashes(self, request: CacheRequest) -> list[BlockHash]:
        """Hashes of all full blocks of the request's known tokens, extended incrementally."""
        entry = self._hash_entry(request)
        hashes = entry.hashes
        tokens = request.all_token_ids
        bs = self.block_size
        num_full = len(tokens) // bs
        if len(hashes) < num_full:
            extra: tuple = () if entry.salt is None else (entry.salt,)
            parent = hashes[-1] if hashes else None
            fn = self._hash_fn
            for i in range(len(hashes), num_full):
                parent = hash_block_tokens(fn, parent, tokens[i * bs : (i + 1) * bs], extra)
                hashes.append(parent)
        return hashes

    # ------------------------------------------------------------------ lookup

    def get_computed_blocks(self, request: CacheRequest) -> tuple[list[KVCacheBlock], int]:
        """Longest full-block prefix hit; the last known token is always left to recompute."""
        if not self.enable_caching:
            return [], 0
        num_tokens = len(request.all_token_ids)
        max_hit_blocks = max(0, (num_tokens - 1) // self.block_size)
        hashes = self.get_block_hashes(request)
        pool = self.block_pool
        hits: list[KVCacheBlock] = []
        for h in hashes[:max_hit_blocks]:
            block = pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        self._stats.requests += 1
        self._stats.queries += num_tokens
        self._stats.hits += num_hit_tokens
        return hits, num_hit_tokens

    # ------------------------------------------------------------------ allocation

    def allocate_slots(
        self,
        request: CacheRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Grow the request's table to cover computed + hit + new tokens; None changes nothing.

        Returns the newly allocated blocks (not the hit blocks). Raises ValueError for inputs
        that can never succeed (negative counts, more blocks than the whole pool, stale hits).
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be non-negative, got {num_new_tokens}")
        if num_new_computed_tokens < 0:
            raise ValueError(
                f"num_new_computed_tokens must be non-negative, got {num_new_computed_tokens}"
            )
        hit_blocks: Sequence[KVCacheBlock] = new_computed_blocks or ()
        bs = self.block_size
        if num_new_computed_tokens != len(hit_blocks) * bs:
            raise ValueError(
                f"num_new_computed_tokens={num_new_computed_tokens} does not match "
                f"{len(hit_blocks)} prefix-hit block(s) of {bs} tokens"
            )
        rid = request.request_id
        num_computed = request.num_computed_tokens
        if num_computed < 0:
            raise ValueError(f"request {rid!r} has negative num_computed_tokens {num_computed}")
        table = self.req_to_blocks.get(rid)
        num_existing = len(table) if table is not None else 0
        if hit_blocks:
            self._check_hits(request, hit_blocks, num_existing, num_computed)

        total_tokens = num_computed + num_new_computed_tokens + num_new_tokens
        num_required = -(-total_tokens // bs)
        if num_required > self.num_blocks:
            raise ValueError(
                f"request {rid!r} needs {num_required} blocks for {total_tokens} tokens but the "
                f"pool only has {self.num_blocks} blocks of {bs} tokens"
            )
        num_new_blocks = max(0, num_required - num_existing - len(hit_blocks))
        # Hit blocks with ref count 0 sit in the free queue: touching them takes them out,
        # so they cannot also be counted as free for the new blocks.
        num_hits_in_queue = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        pool = self.block_pool
        if num_new_blocks > pool.get_num_free_blocks() - num_hits_in_queue:
            return None

        if table is None:
            table = self.req_to_blocks[rid] = []
            self._num_cached_blocks[rid] = 0
        if hit_blocks:
            pool.touch(hit_blocks)
            table.extend(hit_blocks)
            # Hit blocks are already in the index under exactly these hashes.
            self._num_cached_blocks[rid] = max(self._num_cached_blocks[rid], len(table))
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        table.extend(new_blocks)

        if self.enable_caching:
            self._cache_full_blocks(request, table, total_tokens)
        return new_blocks

    def _check_hits(
        self,
        request: CacheRequest,
        hit_blocks: Sequence[KVCacheBlock],
        num_existing: int,
        num_computed: int,
    ) -> None:
        """Reject hits that no longer hold the hashes they were found under.

        Between get_computed_blocks and allocate_slots another allocation may have evicted
        a freed hit block and handed it to someone else; sharing it would read foreign KV.
        """
        bs = self.block_size
        if num_computed != num_existing * bs:
            raise ValueError(
                f"prefix-hit blocks must extend the table right where computation stands: "
                f"request {request.request_id!r} has {num_existing} blocks but "
                f"{num_computed} computed tokens"
            )
        hashes = self.get_block_hashes(request)
        if num_existing + len(hit_blocks) > len(hashes):
            raise ValueError("more prefix-hit blocks than the request has full blocks")
        for i, block in enumerate(hit_blocks):
            if block.block_hash is None or block.block_hash != hashes[num_existing + i]:
                raise ValueError(
                    f"prefix-hit block {block.block_id} was evicted or reused after "
                    "get_computed_blocks; look the hits up again right before allocating"
                )

    def _cache_full_blocks(
        self, request: CacheRequest, table: list[KVCacheBlock], total_tokens: int
    ) -> None:
        rid = request.request_id
        start = self._num_cached_blocks[rid]
        num_full = min(total_tokens, len(request.all_token_ids)) // self.block_size
        num_full = min(num_full, len(table))
        if num_full <= start:
            return
        hashes = self.get_block_hashes(request)
        self.block_pool.cache_full_blocks(table[start:num_full], hashes[start:num_full])
        self._num_cached_blocks[rid] = num_full

    def free(self, request_id: str) -> None:
        """Release a request's blocks tail first, so its tail is evicted before its prefix."""
        try:
            table = self.req_to_blocks.pop(request_id)
        except KeyError:
            raise KeyError(
                f"request {request_id!r} holds no blocks (never allocated or already freed)"
            ) from None
        del self._num_cached_blocks[request_id]
        self._req_hashes.pop(request_id, None)
        self.block_pool.free_blocks(reversed(table))

    # ------------------------------------------------------------------ queries

    def _table(self, request_id: str) -> list[KVCacheBlock]:
        try:
            return self.req_to_blocks[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} holds no blocks") from None

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._table(request_id)]

    def slot_mapping(self, request_id: str, start: int, end: int) -> list[int]:
        """KV slot of each position in [start, end): table[p // B] * B + p % B."""
        table = self._table(request_id)
        bs = self.block_size
        if not 0 <= start <= end <= len(table) * bs:
            raise ValueError(
                f"positions [{start}, {end}) are outside request {request_id!r}'s "
                f"{len(table) * bs} allocated slots"
            )
        return [table[p // bs].block_id * bs + p % bs for p in range(start, end)]

    def has_request(self, request_id: str) -> bool:
        return request_id in self.req_to_blocks

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Stats since the previous call; the counters restart from zero."""
        stats, self._stats = self._stats, PrefixCacheStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
