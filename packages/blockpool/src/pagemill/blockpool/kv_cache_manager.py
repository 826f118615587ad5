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

Sliding window (`sliding_window`, for models whose every layer attends through the same
window: Mistral, Phi-3 with a window): a query at position p reads the keys p-W+1..p
only, so once a request has computed c tokens, the earliest query it will ever run again
(position c) reads nothing below c-W+1, and the blocks wholly below it are given back to
the pool and replaced in the table by the pool's null block (vLLM's sliding-window
manager). A request then holds about W/B + 1 blocks however long it grows, and it may
grow past the whole pool. Given-back blocks keep their hashes like any freed block; a
prefix hit needs only the blocks of its last window (looked up from the right, the blocks
before it enter the table as null blocks). Models that mix windowed and full-attention
layers (Gemma 2/3) need every block for their full layers and are served without this.
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


class PrefixCacheCounter:
    """Running totals of `PrefixCacheStats`, and the difference since the last report.

    Both managers (one group and hybrid) count the same way; the interval view exists because
    a logger that reports per interval must not reset the totals a metrics endpoint reads.
    """

    def __init__(self) -> None:
        self._totals = PrefixCacheStats()
        self._reported = PrefixCacheStats()

    def admit(self, queries: int, hits: int) -> None:
        """One request admitted for the first time with `queries` tokens, `hits` of them cached."""
        self._totals.requests += 1
        self._totals.queries += queries
        self._totals.hits += hits

    @property
    def totals(self) -> PrefixCacheStats:
        """Totals since creation (a copy: the caller may keep it)."""
        return replace(self._totals)

    def since_last_report(self) -> PrefixCacheStats:
        """Stats since the previous call (for per-interval logging); totals are unaffected."""
        now, before = self._totals, self._reported
        self._reported = replace(now)
        return PrefixCacheStats(
            now.requests - before.requests, now.queries - before.queries, now.hits - before.hits
        )


class KVCacheManager:
    """Grants KV blocks to requests, shares prefix-cache hits, and releases blocks in LRU order."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        sliding_window: int | None = None,
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int):
            raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        if sliding_window is not None:
            if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
                raise TypeError(
                    f"sliding_window must be None or an int, got {type(sliding_window).__name__}"
                )
            if sliding_window <= 0:
                raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(
            num_blocks, enable_caching, reserve_null_block=sliding_window is not None
        )
        self.num_blocks = self.block_pool.num_blocks
        # Blocks requests can hold: all but the null block when there is one.
        self.num_usable_blocks = self.block_pool.num_usable_blocks
        if sliding_window is not None and (
            self.num_usable_blocks * block_size < sliding_window + block_size - 1
        ):
            # Below this a request at the end of its window could not take one more token
            # even with the whole pool to itself.
            raise ValueError(
                f"a pool of {self.num_usable_blocks} usable blocks of {block_size} tokens "
                f"cannot hold a sliding window of {sliding_window} tokens plus a block"
            )
        self._null_block = self.block_pool.null_block
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
        # Number of leading entries of each table that are the null block (given back).
        self._num_null_blocks: dict[str, int] = {}
        self._prefix_stats = PrefixCacheCounter()

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
        if self.sliding_window is not None:
            return self._get_window_hit(request.block_hashes[:max_hit_blocks])
        hits: list[KVCacheBlock] = []
        for h in request.block_hashes[:max_hit_blocks]:
            block = pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def _get_window_hit(self, hashes: Sequence[BlockHash]) -> tuple[list[KVCacheBlock], int]:
        """Longest hit of k blocks whose last window is cached: blocks before the window of
        position k*B (the first query to run) are not needed and come back as null blocks."""
        assert self._null_block is not None
        pool = self.block_pool
        cached = [pool.get_cached_block(h) for h in hashes]
        # run[i]: how many cached blocks end at i without a gap.
        run = [0] * len(cached)
        length = 0
        for i, block in enumerate(cached):
            length = length + 1 if block is not None else 0
            run[i] = length
        bs = self.block_size
        for k in range(len(cached), 0, -1):
            lo = self.num_skippable_blocks(k * bs)
            if run[k - 1] >= k - lo:
                hits = [self._null_block] * lo
                hits += [b for b in cached[lo:k] if b is not None]
                return hits, k * bs
        return [], 0

    def num_skippable_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks no query at or after `num_computed_tokens` reads (0 without a
        window): a query at p reads keys from p-W+1 on, so block j (positions jB..jB+B-1)
        is dead once (j+1)B <= c-W+1."""
        window = self.sliding_window
        if window is None:
            return 0
        return max(0, (num_computed_tokens - window + 1) // self.block_size)

    def max_num_tokens(self, num_computed_tokens: int) -> int:
        """Most tokens a request that has computed `num_computed_tokens` can reach in its
        next step with the whole pool to itself (the scheduler caps steps by it): the whole
        pool without a window, else the blocks past its dead ones."""
        skip = self.num_skippable_blocks(num_computed_tokens)
        return (skip + self.num_usable_blocks) * self.block_size

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
        (first or after preemption) and is what the prefix-cache stats count. With a sliding
        window, a successful call first gives back the blocks that fell out of the window
        (see the module docstring), and those count as free for this allocation.
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
        # Leading blocks that no query of this step or a later one reads.
        skip = self.num_skippable_blocks(num_computed + num_new_computed_tokens)
        if hit_blocks:
            self._check_hits(request, hit_blocks, num_existing, num_computed, skip)
            null = self._null_block
            if null is not None and num_existing < skip:
                # Hits the window no longer reaches are not taken (nor kept from eviction).
                cut = skip - num_existing
                hit_blocks = [null] * min(cut, len(hit_blocks)) + list(hit_blocks[cut:])

        total_tokens = num_computed + num_new_computed_tokens + num_new_tokens
        num_required = -(-total_tokens // bs)
        if num_required - min(skip, num_required) > self.num_usable_blocks:
            raise ValueError(
                f"request {rid!r} needs {num_required} blocks for {total_tokens} tokens but the "
                f"pool only has {self.num_usable_blocks} blocks of {bs} tokens"
            )
        num_new_blocks = max(0, num_required - num_existing - len(hit_blocks))
        # Blocks of the table that fell out of the window: given back below, and those only
        # this request holds join the free queue in time for this allocation.
        num_null = self._num_null_blocks.get(rid, 0)
        released = table[num_null : min(skip, num_existing)] if table is not None else []
        num_released_free = sum(1 for b in released if b.ref_cnt == 1)
        # Hit blocks with ref count 0 sit in the free queue: touching them takes them out,
        # so they cannot also be counted as free for the new blocks.
        num_hits_in_queue = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        pool = self.block_pool
        if num_new_blocks > pool.get_num_free_blocks() + num_released_free - num_hits_in_queue:
            return None

        if table is None:
            table = self.req_to_blocks[rid] = []
            self._num_cached_blocks[rid] = 0
            self._num_null_blocks[rid] = 0
            if num_computed == 0 and self.enable_caching:
                self._prefix_stats.admit(len(request.all_token_ids), num_new_computed_tokens)
        if released:
            self._release(request, table, num_null, num_null + len(released))
        if hit_blocks:
            null = self._null_block
            live_hits = [b for b in hit_blocks if b is not null]
            pool.touch(live_hits)
            table.extend(hit_blocks)
            if null is not None:
                self._num_null_blocks[rid] = len(table) - len(live_hits)
            # Hit blocks are already in the index under exactly these hashes.
            self._num_cached_blocks[rid] = max(self._num_cached_blocks[rid], len(table))
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        table.extend(new_blocks)

        if self.enable_caching:
            self._cache_full_blocks(request, table, total_tokens)
        return new_blocks

    def _release(
        self, request: CacheRequest, table: list[KVCacheBlock], start: int, stop: int
    ) -> None:
        """Give back table[start:stop] (out of the window) and put the null block there.

        They are registered first if they are full and hashed, so they stay hittable while
        they wait in the free queue, like the blocks of a finished request.
        """
        null = self._null_block
        assert null is not None
        if self.enable_caching:
            self._cache_full_blocks(request, table, request.num_computed_tokens)
        self.block_pool.free_blocks(reversed(table[start:stop]))
        table[start:stop] = [null] * (stop - start)
        self._num_null_blocks[request.request_id] = stop

    def _check_hits(
        self,
        request: CacheRequest,
        hit_blocks: Sequence[KVCacheBlock],
        num_existing: int,
        num_computed: int,
        skip: int,
    ) -> None:
        """Reject hits that no longer hold the hashes they were found under.

        Between get_computed_blocks and allocate_slots another allocation may have evicted
        a freed hit block and handed it to someone else; sharing it would read foreign KV.
        A null block (sliding window) may stand only where the window no longer reaches.
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
        null = self._null_block
        for i, block in enumerate(hit_blocks):
            if null is not None and block is null:
                if num_existing + i >= skip:
                    raise ValueError(
                        f"a null prefix-hit block at index {num_existing + i} lies inside "
                        "the sliding window, whose KV must be present"
                    )
                continue
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
        # Null entries (given back) are skipped: their blocks were registered, or not, then.
        start = max(self._num_cached_blocks[rid], self._num_null_blocks[rid])
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
        num_null = self._num_null_blocks.pop(request_id)
        self.block_pool.free_blocks(reversed(table[num_null:]))

    def trim(self, request_id: str, num_tokens: int) -> int | None:
        """Give back the table's blocks past those of its first `num_tokens` positions.

        For a verified speculative step: the blocks that held only rejected drafts' slots
        return to the pool in the same step instead of waiting for the request to grow
        into them again. They were never registered in the prefix index (a block is
        registered only once full of the request's own tokens, and drafts are not among
        them), so nothing hashed is lost. Returns the new table length when blocks were
        given back (a runner that mirrors the table cuts it there), else None.
        """
        table = self.req_to_blocks.get(request_id)
        if table is None:
            return None
        keep = max(-(-num_tokens // self.block_size), self._num_null_blocks[request_id])
        if keep >= len(table):
            return None
        tail = table[keep:]
        del table[keep:]
        self._num_cached_blocks[request_id] = min(self._num_cached_blocks[request_id], keep)
        self.block_pool.free_blocks(reversed(tail))
        return keep

    def forget_blocks_from(self, request_id: str, first_block: int) -> None:
        """Take the request's blocks from `first_block` on out of the prefix index.

        For a step that failed: its blocks were registered when they were allocated (before
        the forward), but their KV was never written, so no later request may hit them.
        """
        table = self.req_to_blocks.get(request_id)
        if table is None:
            return
        first = max(0, first_block, self._num_null_blocks[request_id])
        self.block_pool.uncache_blocks(table[first:])
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
        lo = self._num_null_blocks[request_id] * bs if start < end else 0
        if not lo <= start <= end <= len(table) * bs:
            raise ValueError(
                f"positions [{start}, {end}) are outside request {request_id!r}'s "
                f"allocated slots [{lo}, {len(table) * bs})"
            )
        return [table[p // bs].block_id * bs + p % bs for p in range(start, end)]

    def has_request(self, request_id: str) -> bool:
        return request_id in self.req_to_blocks

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request actually holds: its table less the null entries."""
        table = self.req_to_blocks.get(request_id)
        return 0 if table is None else len(table) - self._num_null_blocks[request_id]

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Totals since the manager was created (a copy: the caller may keep it)."""
        return self._prefix_stats.totals

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Stats since the previous call (for per-interval logging); totals are unaffected."""
        return self._prefix_stats.since_last_report()

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
