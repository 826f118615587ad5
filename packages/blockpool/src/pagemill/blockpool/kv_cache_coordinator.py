"""Block tables per KV cache group over one pool: full-attention and sliding-window layers.

`HybridKVCacheManager` is `KVCacheManager` for a model whose layers form several groups
(`kv_cache_groups`): a request has one table per group, all of the same length (one entry
per block of its tokens), and a windowed group puts the null block where its window no
longer reaches. What the manager hands the scheduler is a `KVCacheBlocks`: one list of
blocks per group (vLLM's names). One allocation covers every group at once, so it either
succeeds for all or changes nothing.

- Full-attention group: holds every block, like `KVCacheManager` without a window.
- Windowed group (window W): once a request has computed c tokens, no later query reads a
  key below c-W+1, so the blocks wholly below it go back to the pool (they keep their
  hashes, so they stay hittable until evicted). It never holds more than
  ceil((W-1)/B)+1 blocks plus what one step adds.
- Prefix hits: each group has its own hash index (same hashes, other layers' KV). A hit of
  k blocks needs the whole chain in every full group and the blocks of the last window
  before position kB in every windowed group; the blocks a windowed group no longer needs
  enter its table as null blocks, and are never taken from the cache. The longest k is
  found by shrinking: the full groups give the longest cached prefix, each windowed group
  the longest k not above it whose window is cached, repeated until no group shrinks it
  (a full-attention hit is a hit at every shorter length; a windowed one is not).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagemill.blockpool.block_pool import BlockPool, KVCacheBlock
from pagemill.blockpool.hashing import BlockHasher, get_hash_fn
from pagemill.blockpool.kv_cache_groups import KVCacheGroupSpec
from pagemill.blockpool.kv_cache_manager import (
    CacheRequest,
    PrefixCacheCounter,
    PrefixCacheStats,
)


@dataclass(slots=True)
class KVCacheBlocks:
    """Blocks per KV cache group, as they pass between the scheduler and the manager."""

    blocks: tuple[list[KVCacheBlock], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self.blocks)

    @property
    def num_blocks(self) -> int:
        """Entries per group (every group has as many)."""
        return len(self.blocks[0]) if self.blocks else 0


def _skippable(num_computed_tokens: int, window: int | None, block_size: int) -> int:
    """Leading blocks no query at or after `num_computed_tokens` reads through `window`:
    block j is dead once (j+1)B <= c-W+1 (see `KVCacheManager.num_skippable_blocks`)."""
    if window is None:
        return 0
    return max(0, (num_computed_tokens - window + 1) // block_size)


class HybridKVCacheManager:
    """Per-group block tables over one block pool (see the module docstring)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        kv_cache_groups: Sequence[KVCacheGroupSpec],
        enable_caching: bool = True,
        hash_algo: str = "sha256",
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        groups = tuple(kv_cache_groups)
        if not groups:
            raise ValueError("a hybrid KV cache manager needs at least one group")
        self.block_size = block_size
        self.kv_cache_groups = groups
        self.num_kv_cache_groups = len(groups)
        self.windows: tuple[int | None, ...] = tuple(g.sliding_window for g in groups)
        self._full = [i for i, w in enumerate(self.windows) if w is None]
        self._windowed = [i for i, w in enumerate(self.windows) if w is not None]
        # The scheduler reads this as "every layer shares one window": never true here.
        self.sliding_window: int | None = None
        self.block_pool = BlockPool(
            num_blocks,
            enable_caching,
            reserve_null_block=bool(self._windowed),
            num_cache_groups=len(groups),
        )
        self.num_blocks = self.block_pool.num_blocks
        self.num_usable_blocks = self.block_pool.num_usable_blocks
        self._null_block = self.block_pool.null_block
        if self.max_num_tokens(0) < 1:
            raise ValueError(
                f"a pool of {self.num_usable_blocks} usable blocks of {block_size} tokens "
                f"cannot hold one token in each of {len(groups)} KV cache groups"
            )
        self.enable_caching = enable_caching
        self.hash_algo = hash_algo
        hash_fn = get_hash_fn(hash_algo)
        self.block_hasher: BlockHasher | None = (
            BlockHasher(hash_fn, block_size) if enable_caching else None
        )
        # request id -> one table per group, all of one length.
        self.req_to_blocks: dict[str, tuple[list[KVCacheBlock], ...]] = {}
        # Per request and group: leading entries registered in the index / null (given back).
        self._num_cached_blocks: dict[str, list[int]] = {}
        self._num_null_blocks: dict[str, list[int]] = {}
        self._prefix_stats = PrefixCacheCounter()

    # ------------------------------------------------------------------ capacity

    def _blocks_needed(self, num_computed_tokens: int, total_tokens: int) -> int:
        """Blocks the request holds in all after a step from c computed to `total_tokens`."""
        bs = self.block_size
        required = -(-total_tokens // bs)
        held = 0
        for w in self.windows:
            held += required - min(_skippable(num_computed_tokens, w, bs), required)
        return held

    def max_num_tokens(self, num_computed_tokens: int) -> int:
        """Most tokens a request that has computed `num_computed_tokens` can reach in its
        next step with the whole pool to itself (the scheduler caps steps by it)."""
        bs = self.block_size
        usable = self.num_usable_blocks
        c = num_computed_tokens
        # Each block more of context costs one block in every group that has not yet
        # skipped past it. Past every group's skipped blocks, m blocks of context cost
        # G*m - sum(skips): solved directly (this runs per running request per step).
        skips = [_skippable(c, w, bs) for w in self.windows]
        m = (usable + sum(skips)) // len(skips)
        if m >= max(skips):
            return m * bs
        # Otherwise the most whole blocks that fit, by bisection.
        lo, hi = 0, (c // bs) + usable + 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._blocks_needed(c, mid * bs) <= usable:
                lo = mid
            else:
                hi = mid - 1
        return lo * bs

    def request_capacity_tokens(self, chunked_prefill: bool) -> int | None:
        """Most tokens one request can ever hold, with the whole pool (None: no limit).

        Decoding at T tokens holds every block in the full groups and at most a window's
        worth plus one in each windowed group. Without chunked prefill a prompt is
        computed in one step, before any window skips, so it must fit whole.
        """
        bs = self.block_size
        usable = self.num_usable_blocks
        window_blocks = sum(-(-(w - 1) // bs) + 1 for w in self.windows if w is not None)
        if self._full:
            per_block = len(self._full)
            limit = (usable - window_blocks) // per_block * bs
        else:
            limit = None
        if not chunked_prefill:
            whole = usable // len(self.windows) * bs
            limit = whole if limit is None else min(limit, whole)
        return None if limit is None else max(0, limit)

    # ------------------------------------------------------------------ lookup

    def get_computed_blocks(self, request: CacheRequest) -> tuple[KVCacheBlocks, int]:
        """Longest prefix hit in every group at once; the last known token is recomputed."""
        empty = KVCacheBlocks(tuple([] for _ in self.windows))
        if not self.enable_caching:
            return empty, 0
        bs = self.block_size
        max_hit = max(0, (len(request.all_token_ids) - 1) // bs)
        hashes = request.block_hashes[:max_hit]
        pool = self.block_pool
        cached = [[pool.get_cached_block(h, g) for h in hashes] for g in range(len(self.windows))]
        k = len(hashes)
        for g in self._full:
            for i in range(k):
                if cached[g][i] is None:
                    k = i
                    break
        shrunk = True
        while shrunk and k > 0:
            shrunk = False
            for g in self._windowed:
                k2 = self._window_hit(cached[g], k, self.windows[g])
                if k2 < k:
                    k, shrunk = k2, True
        if k == 0:
            return empty, 0
        null = self._null_block
        out: list[list[KVCacheBlock]] = []
        for g, w in enumerate(self.windows):
            lo = _skippable(k * bs, w, bs)
            hits: list[KVCacheBlock] = []
            if lo:
                assert null is not None
                hits = [null] * lo
            for b in cached[g][lo:k]:
                assert b is not None
                hits.append(b)
            out.append(hits)
        return KVCacheBlocks(tuple(out)), k * bs

    def _window_hit(self, cached: list[KVCacheBlock | None], k_max: int, w: int | None) -> int:
        """Longest k <= k_max whose blocks from the window of position kB on are cached."""
        bs = self.block_size
        run = 0
        runs = [0] * k_max
        for i in range(k_max):
            run = run + 1 if cached[i] is not None else 0
            runs[i] = run
        for k in range(k_max, 0, -1):
            if runs[k - 1] >= k - _skippable(k * bs, w, bs):
                return k
        return 0

    # ------------------------------------------------------------------ allocation

    def allocate_slots(
        self,
        request: CacheRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
    ) -> KVCacheBlocks | None:
        """Grow every group's table to cover computed + hit + new tokens; None changes
        nothing. Returns the newly allocated blocks per group (not the hits); raises
        ValueError for inputs that can never succeed, as `KVCacheManager.allocate_slots`.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be non-negative, got {num_new_tokens}")
        if num_new_computed_tokens < 0:
            raise ValueError(
                f"num_new_computed_tokens must be non-negative, got {num_new_computed_tokens}"
            )
        ngroups = len(self.windows)
        bs = self.block_size
        if new_computed_blocks is None or new_computed_blocks.num_blocks == 0:
            hit_lists: list[list[KVCacheBlock]] = [[] for _ in range(ngroups)]
        else:
            if len(new_computed_blocks.blocks) != ngroups:
                raise ValueError(
                    f"prefix hits for {len(new_computed_blocks.blocks)} groups, "
                    f"the manager has {ngroups}"
                )
            hit_lists = [list(g) for g in new_computed_blocks.blocks]
        num_hit = len(hit_lists[0])
        if any(len(h) != num_hit for h in hit_lists) or num_new_computed_tokens != num_hit * bs:
            raise ValueError(
                f"num_new_computed_tokens={num_new_computed_tokens} does not match "
                f"{num_hit} prefix-hit block(s) of {bs} tokens in every group"
            )
        rid = request.request_id
        num_computed = request.num_computed_tokens
        if num_computed < 0:
            raise ValueError(f"request {rid!r} has negative num_computed_tokens {num_computed}")
        tables = self.req_to_blocks.get(rid)
        num_existing = len(tables[0]) if tables is not None else 0
        computed = num_computed + num_new_computed_tokens
        skips = [_skippable(computed, w, bs) for w in self.windows]
        null = self._null_block
        if num_hit:
            self._check_hits(request, hit_lists, num_existing, num_computed, skips)
            for g, skip in enumerate(skips):
                if num_existing < skip:
                    # Hits the window no longer reaches are not taken (nor kept from eviction).
                    assert null is not None
                    cut = min(skip - num_existing, num_hit)
                    hit_lists[g] = [null] * cut + hit_lists[g][cut:]

        total_tokens = computed + num_new_tokens
        num_required = -(-total_tokens // bs)
        if self._blocks_needed(computed, total_tokens) > self.num_usable_blocks:
            raise ValueError(
                f"request {rid!r} needs more blocks for {total_tokens} tokens in "
                f"{ngroups} KV cache groups than the pool's {self.num_usable_blocks} "
                f"blocks of {bs} tokens"
            )
        num_new_blocks = max(0, num_required - num_existing - num_hit)
        nulls = self._num_null_blocks.get(rid)
        released: list[list[KVCacheBlock]] = []
        num_released_free = 0
        num_hits_in_queue = 0
        for g in range(ngroups):
            if tables is not None and nulls is not None:
                rel = tables[g][nulls[g] : min(skips[g], num_existing)]
            else:
                rel = []
            released.append(rel)
            num_released_free += sum(1 for b in rel if b.ref_cnt == 1)
            num_hits_in_queue += sum(1 for b in hit_lists[g] if b.ref_cnt == 0 and b is not null)
        pool = self.block_pool
        free = pool.get_num_free_blocks() + num_released_free - num_hits_in_queue
        if num_new_blocks * ngroups > free:
            return None

        if tables is None:
            tables = self.req_to_blocks[rid] = tuple([] for _ in range(ngroups))
            self._num_cached_blocks[rid] = [0] * ngroups
            nulls = self._num_null_blocks[rid] = [0] * ngroups
            if num_computed == 0 and self.enable_caching:
                self._prefix_stats.admit(len(request.all_token_ids), num_new_computed_tokens)
        assert nulls is not None
        cached_counts = self._num_cached_blocks[rid]
        # Every group's hits are taken before any group's new blocks: a hit of one group
        # may sit in the free queue, where another group's allocation would evict it.
        for g in range(ngroups):
            table = tables[g]
            if released[g]:
                self._release(request, g, table, nulls[g], nulls[g] + len(released[g]))
            hits = hit_lists[g]
            if hits:
                live = [b for b in hits if b is not null]
                pool.touch(live)
                table.extend(hits)
                if null is not None and len(live) < len(hits):
                    nulls[g] = len(table) - len(live)
                cached_counts[g] = max(cached_counts[g], len(table))
        new_blocks: list[list[KVCacheBlock]] = []
        for g in range(ngroups):
            table = tables[g]
            got = pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
            table.extend(got)
            new_blocks.append(got)
            if self.enable_caching:
                self._cache_full_blocks(request, g, table, total_tokens)
        return KVCacheBlocks(tuple(new_blocks))

    def _release(
        self, request: CacheRequest, group: int, table: list[KVCacheBlock], start: int, stop: int
    ) -> None:
        """Give back table[start:stop] of a windowed group, registered first if full and
        hashed (so they stay hittable in the free queue), and put null blocks there."""
        null = self._null_block
        assert null is not None
        if self.enable_caching:
            self._cache_full_blocks(request, group, table, request.num_computed_tokens)
        self.block_pool.free_blocks(reversed(table[start:stop]))
        table[start:stop] = [null] * (stop - start)
        self._num_null_blocks[request.request_id][group] = stop

    def _check_hits(
        self,
        request: CacheRequest,
        hit_lists: list[list[KVCacheBlock]],
        num_existing: int,
        num_computed: int,
        skips: list[int],
    ) -> None:
        """Reject hits that no longer hold the hashes they were found under, and null hits
        where the group's KV must be present (see `KVCacheManager._check_hits`)."""
        bs = self.block_size
        if num_computed != num_existing * bs:
            raise ValueError(
                f"prefix-hit blocks must extend the table right where computation stands: "
                f"request {request.request_id!r} has {num_existing} blocks but "
                f"{num_computed} computed tokens"
            )
        hashes = request.block_hashes
        if num_existing + len(hit_lists[0]) > len(hashes):
            raise ValueError("more prefix-hit blocks than the request has full blocks")
        null = self._null_block
        for g, hits in enumerate(hit_lists):
            index = self.block_pool.group_indexes[g]
            for i, block in enumerate(hits):
                pos = num_existing + i
                if null is not None and block is null:
                    if pos >= skips[g]:
                        raise ValueError(
                            f"a null prefix-hit block at index {pos} of group {g} lies "
                            "where its KV must be present"
                        )
                    continue
                h = hashes[pos]
                if block.block_hash != h or index.get(h) is not block:
                    raise ValueError(
                        f"prefix-hit block {block.block_id} (group {g}) was evicted or reused "
                        "after get_computed_blocks; look the hits up again right before "
                        "allocating"
                    )

    def _cache_full_blocks(
        self, request: CacheRequest, group: int, table: list[KVCacheBlock], total_tokens: int
    ) -> None:
        rid = request.request_id
        cached = self._num_cached_blocks[rid]
        start = max(cached[group], self._num_null_blocks[rid][group])
        hashes = request.block_hashes
        num_full = min(total_tokens, len(request.all_token_ids)) // self.block_size
        num_full = min(num_full, len(table), len(hashes))
        if num_full <= start:
            return
        self.block_pool.cache_full_blocks(
            table[start:num_full], hashes[start:num_full], request, start, group
        )
        cached[group] = num_full

    def free(self, request_id: str) -> None:
        """Release a request's blocks, each group's tail first."""
        try:
            tables = self.req_to_blocks.pop(request_id)
        except KeyError:
            raise KeyError(
                f"request {request_id!r} holds no blocks (never allocated or already freed)"
            ) from None
        del self._num_cached_blocks[request_id]
        nulls = self._num_null_blocks.pop(request_id)
        for g, table in enumerate(tables):
            self.block_pool.free_blocks(reversed(table[nulls[g] :]))

    def trim(self, request_id: str, num_tokens: int) -> int | None:
        """Give back every group's blocks past those of the first `num_tokens` positions
        (rejected drafts' slots, see `KVCacheManager.trim`); the new table length, or None
        when nothing was given back."""
        tables = self.req_to_blocks.get(request_id)
        if tables is None:
            return None
        nulls = self._num_null_blocks[request_id]
        keep = max(-(-num_tokens // self.block_size), *nulls)
        if keep >= len(tables[0]):
            return None
        cached = self._num_cached_blocks[request_id]
        for g, table in enumerate(tables):
            tail = table[keep:]
            del table[keep:]
            cached[g] = min(cached[g], keep)
            self.block_pool.free_blocks(reversed(tail))
        return keep

    def forget_blocks_from(self, request_id: str, first_block: int) -> None:
        """Take the request's blocks from `first_block` on out of every group's index (a
        step that failed never wrote their KV)."""
        tables = self.req_to_blocks.get(request_id)
        if tables is None:
            return
        cached = self._num_cached_blocks[request_id]
        nulls = self._num_null_blocks[request_id]
        for g, table in enumerate(tables):
            self.block_pool.uncache_blocks(table[max(0, first_block, nulls[g]) :])
            cached[g] = min(cached[g], max(0, first_block))

    # ------------------------------------------------------------------ queries

    def _tables(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        try:
            return self.req_to_blocks[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} holds no blocks") from None

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's table in each group (fresh lists)."""
        return tuple([b.block_id for b in t] for t in self._tables(request_id))

    def num_request_blocks(self, request_id: str) -> int:
        """Entries of the request's tables (equal in every group); 0 when it holds none."""
        tables = self.req_to_blocks.get(request_id)
        return 0 if tables is None else len(tables[0])

    def num_held_blocks(self, request_id: str, group: int | None = None) -> int:
        """Blocks the request actually holds (in one group, or all): tables less nulls."""
        tables = self.req_to_blocks.get(request_id)
        if tables is None:
            return 0
        nulls = self._num_null_blocks[request_id]
        groups = range(len(tables)) if group is None else (group,)
        return sum(len(tables[g]) - nulls[g] for g in groups)

    def slot_mapping(self, request_id: str, start: int, end: int, group: int) -> list[int]:
        """KV slot of each position in [start, end) in `group`'s layers."""
        table = self._tables(request_id)[group]
        bs = self.block_size
        lo = self._num_null_blocks[request_id][group] * bs if start < end else 0
        if not lo <= start <= end <= len(table) * bs:
            raise ValueError(
                f"positions [{start}, {end}) are outside request {request_id!r}'s "
                f"allocated slots [{lo}, {len(table) * bs}) in group {group}"
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
        return self._prefix_stats.totals

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        return self._prefix_stats.since_last_report()

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
