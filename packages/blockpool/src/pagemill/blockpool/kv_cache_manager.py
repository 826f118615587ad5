"""Per-request block tables on top of the block pool, with prefix caching.

The manager owns the mapping request -> list of blocks: it is the one block table of each
request (the scheduler keeps none, and hands the model runner only the ids a step adds). The
chained hashes of a request's full blocks live on the request itself (`request.block_hashes`),
extended by the caller with what `block_hasher` returns as tokens arrive: the record that owns
the tokens owns their hashes, so there is no per-request cache here to invalidate, key by id
or leak.

Cache salt: a request's `cache_salt` (when not None) is placed in the extra keys of *every*
block, not only the first. Chaining alone would already propagate it, but per-block salting
keeps each hash self-contained, so tenants with different salts never share a block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

from pagemill.blockpool.block_pool import BlockPool, KVCacheBlock
from pagemill.blockpool.hashing import BlockHash, BlockHasher, get_hash_fn


@runtime_checkable
class CacheRequest(Protocol):
    """What the manager reads from a request (read-only: any object with these attributes).

    `all_token_ids` only ever grows while the manager knows the request, and
    `block_hashes` holds the hashes of a prefix of its full blocks (see
    `KVCacheManager.block_hasher`).
    """

    @property
    def request_id(self) -> str: ...
    @property
    def all_token_ids(self) -> Sequence[int]: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def cache_salt(self) -> str | None: ...
    @property
    def block_hashes(self) -> Sequence[BlockHash]: ...


@dataclass
class PrefixCacheStats:
    """Prefix-cache use in tokens, counted once per successful admission.

    Counting at admission rather than at lookup matters because a head of the waiting queue
    that does not fit is looked up again every step: counting lookups would inflate both
    figures by however long it waited.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


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
        # Resolved even with caching off, so a bad algorithm name fails at start-up either way.
        hash_fn = get_hash_fn(hash_algo)
        # Handed to the requests (the scheduler attaches it): `request.block_hashes.extend(
        # block_hasher(request))` after tokens are appended. None: nothing to hash.
        self.block_hasher: BlockHasher | None = (
            BlockHasher(hash_fn, block_size) if enable_caching else None
        )
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Number of leading blocks of each table already registered in the hash index.
        self._num_cached_blocks: dict[str, int] = {}
        self._stats = PrefixCacheStats()
        # Totals at the previous make_prefix_cache_stats(), which reports the difference.
        self._reported = PrefixCacheStats()

    # ------------------------------------------------------------------ lookup

    def get_computed_blocks(self, request: CacheRequest) -> tuple[list[KVCacheBlock], int]:
        """Longest full-block prefix hit; the last known token is always left to recompute.

        Only `request.block_hashes` is consulted: blocks the caller has not hashed yet
        cannot hit. Nothing is counted here (see PrefixCacheStats).
        """
        if not self.enable_caching:
            return [], 0
        num_tokens = len(request.all_token_ids)
        max_hit_blocks = max(0, (num_tokens - 1) // self.block_size)
        pool = self.block_pool
        hits: list[KVCacheBlock] = []
        for h in request.block_hashes[:max_hit_blocks]:
            block = pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

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
        A successful call for a request with no table and nothing computed is an admission
        (first or after preemption) and is what the prefix-cache stats count.
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
            if num_computed == 0 and self.enable_caching:
                stats = self._stats
                stats.requests += 1
                stats.queries += len(request.all_token_ids)
                stats.hits += num_new_computed_tokens
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
        hashes = request.block_hashes
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
        """Register the table's blocks that are full of computed tokens and already hashed.

        A full block whose hash the caller has not added yet is picked up by a later call.
        """
        rid = request.request_id
        start = self._num_cached_blocks[rid]
        hashes = request.block_hashes
        num_full = min(total_tokens, len(request.all_token_ids)) // self.block_size
        num_full = min(num_full, len(table), len(hashes))
        if num_full <= start:
            return
        self.block_pool.cache_full_blocks(
            table[start:num_full], hashes[start:num_full], request, start
        )
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
        self.block_pool.free_blocks(reversed(table))

    def forget_blocks_from(self, request_id: str, first_block: int) -> None:
        """Take the request's blocks from `first_block` on out of the prefix index.

        For a step that failed: its blocks were registered when they were allocated (before
        the forward), but their KV was never written, so no later request may hit them.
        """
        table = self.req_to_blocks.get(request_id)
        if table is None:
            return
        self.block_pool.uncache_blocks(table[max(0, first_block) :])
        self._num_cached_blocks[request_id] = min(
            self._num_cached_blocks[request_id], max(0, first_block)
        )

    # ------------------------------------------------------------------ queries

    def _table(self, request_id: str) -> list[KVCacheBlock]:
        try:
            return self.req_to_blocks[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} holds no blocks") from None

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (a fresh list of ids; the manager's is the only one)."""
        return [b.block_id for b in self._table(request_id)]

    def num_request_blocks(self, request_id: str) -> int:
        """Length of the request's block table; 0 when it holds none (O(1))."""
        table = self.req_to_blocks.get(request_id)
        return 0 if table is None else len(table)

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

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Totals since the manager was created (a copy: the caller may keep it)."""
        return replace(self._stats)

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Stats since the previous call (for per-interval logging); totals are unaffected."""
        now, before = self._stats, self._reported
        self._reported = replace(now)
        return PrefixCacheStats(
            now.requests - before.requests, now.queries - before.queries, now.hits - before.hits
        )

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
