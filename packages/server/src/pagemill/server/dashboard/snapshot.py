"""One picture of the engine's paged memory and batch: scheduler state in, a JSON-able dict out.

Why a pure function of the scheduler: it must run where the engine runs (in the engine
process, on the engine thread, or inside the simulator's loop) and cost next to nothing,
so it reads the live objects once — the block pool's blocks, the scheduler's running list
and waiting queue — copies plain numbers out, and touches nothing. It never sees text: a
prompt appears only when the caller passes `prompt_of` (the server's
`--dashboard-show-prompts`).

The grid is one character per block, so a 16k-block pool is a 16 KB string, not a list of
16k objects: ``.`` free (never cached, or its hash evicted), ``c`` free but cached (a
prefix hit can revive it; evicted first-in first-out from the LRU queue), ``1``-``9`` in
use with that many holders, ``+`` ten or more. Owners are not listed per block: the page
inverts the running requests' block tables, which it receives anyway.

A full picture every time, not a diff: pictures are rate-limited (a few per second), so a
diff would save little, and a full one lets a page join, drop or miss a message and still
be right at the next.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import numpy as np

# Ref count -> grid character (index 10 and above: '+').
_CODES = np.frombuffer(b".123456789+", np.uint8).copy()
DEFAULT_MAX_GRID_BLOCKS = 16384
DEFAULT_MAX_WAITING = 64
PROMPT_PREVIEW_CHARS = 240


def _cached_free_ids(pool: Any) -> list[int]:
    """Ids of the free blocks that still hold a prefix hash (evictable cache), found by
    walking whichever is shorter: the free queue or the prefix index."""
    index = pool.cached_block_hash_to_block
    if pool.get_num_free_blocks() < len(index):
        return [b.block_id for b in pool.free_block_queue if b.block_hash is not None]
    return [b.block_id for b in index.values() if not b.ref_cnt]


def _grid(pool: Any, tables: dict[str, list[int]], limit: int) -> tuple[str, int, int]:
    """(grid over the first `limit` blocks, free-but-cached blocks, shared blocks).

    Costs what is held or cached, not the pool's size: ref counts are the number of block
    tables a block appears in (only requests hold blocks), counted by numpy.
    """
    n = pool.num_blocks
    total = sum(len(t) for t in tables.values())
    flat = np.fromiter(itertools.chain.from_iterable(tables.values()), np.int64, total)
    counts = np.bincount(flat, minlength=n)
    cells = _CODES[np.minimum(counts, 10)]
    cached = _cached_free_ids(pool)
    if cached:
        cells[np.asarray(cached, np.int64)] = ord("c")
    shared = int(np.count_nonzero(counts > 1))
    return cells[:limit].tobytes().decode("ascii"), len(cached), shared


def _request_row(
    req: Any, blocks: list[int] | None, prompt_of: Callable[[str], str | None] | None
) -> dict[str, Any]:
    computed = req.num_computed_tokens
    prompt_len = req.num_prompt_tokens
    row: dict[str, Any] = {
        "id": req.request_id,
        "status": req.status.name.lower(),
        "phase": "prefill" if computed < prompt_len else "decode",
        "prompt_tokens": prompt_len,
        "computed": computed,
        "output_tokens": req.num_tokens - prompt_len,
        "max_tokens": req.max_tokens,
        "cached_tokens": req.num_cached_tokens,
        "preemptions": req.num_preemptions,
        "priority": req.priority,
    }
    if blocks is not None:
        row["blocks"] = blocks
    if prompt_of is not None:
        text = prompt_of(req.request_id)
        if text is not None:
            row["prompt"] = text[:PROMPT_PREVIEW_CHARS]
    return row


def snapshot_scheduler(
    scheduler: Any,
    *,
    prompt_of: Callable[[str], str | None] | None = None,
    max_grid_blocks: int = DEFAULT_MAX_GRID_BLOCKS,
    max_waiting: int = DEFAULT_MAX_WAITING,
    now: float | None = None,
) -> dict[str, Any]:
    """The state of `scheduler` (a `pagemill.scheduler.Scheduler`) and its block pool.

    `now` stamps the picture (wall-clock seconds by default; the simulator passes its
    virtual clock). Waiting requests beyond `max_waiting` are counted, not listed.
    """
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    n = pool.num_blocks
    # Block ids of every request holding blocks (the running ones, in practice), once.
    tables = {rid: [b.block_id for b in t] for rid, t in kv.req_to_blocks.items()}
    grid, evictable, shared = _grid(pool, tables, max_grid_blocks)
    running = [_request_row(r, tables.get(r.request_id), prompt_of) for r in scheduler.running]
    waiting_iter = scheduler.iter_waiting()
    waiting = [
        _request_row(r, None, prompt_of) for r in itertools.islice(waiting_iter, max_waiting)
    ]
    stats = kv.prefix_cache_stats
    free = pool.get_num_free_blocks()
    return {
        "t": time.time() if now is None else now,
        "block_size": kv.block_size,
        "num_blocks": n,
        "grid": grid,
        "free": free,
        "in_use": n - free,
        "evictable": evictable,
        "shared": shared,
        "cached": pool.num_cached_blocks,
        "evictions": pool.num_evictions,
        "preemptions": scheduler.num_preemptions,
        "prefix_cache": {
            "enabled": kv.enable_caching,
            "queries": stats.queries,
            "hits": stats.hits,
            "hit_rate": stats.hit_rate,
        },
        "running": running,
        "waiting": waiting,
        "num_waiting": len(scheduler.waiting),
    }


def snapshot_engine(
    engine: Any, show_prompts: bool = False, **kwargs: Any
) -> dict[str, Any] | None:
    """`snapshot_scheduler` of an engine core, or of an `LLMEngine` (None for an object
    without a scheduler, such as a test double). Module-level, so
    `AsyncEngine.call(partial(snapshot_engine, ...))` can run it in an engine process. The
    core holds no prompt text: `show_prompts` adds it only where the object has an output
    processor (the front end joins prompts otherwise, see `DashboardHub`)."""
    scheduler = getattr(engine, "scheduler", None)
    if scheduler is None or not hasattr(scheduler, "kv_cache_manager"):
        return None
    prompt_of = None
    if show_prompts:
        processor = getattr(engine, "output_processor", None)
        prompt_of = getattr(processor, "prompt_of", None)
    return snapshot_scheduler(scheduler, prompt_of=prompt_of, **kwargs)
