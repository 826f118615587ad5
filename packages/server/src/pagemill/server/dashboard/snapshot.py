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

# Ref count -> grid character (index 10 and above: '+').
_IN_USE = "0123456789+"
DEFAULT_MAX_GRID_BLOCKS = 16384
DEFAULT_MAX_WAITING = 64
PROMPT_PREVIEW_CHARS = 240


def _grid(blocks: list[Any], limit: int) -> tuple[str, int, int]:
    """(grid string, free-but-cached blocks, shared blocks) over the first `limit` blocks."""
    codes = _IN_USE
    cells = []
    evictable = shared = 0
    for b in blocks[:limit] if limit < len(blocks) else blocks:
        r = b.ref_cnt
        if r:
            if r > 1:
                shared += 1
            cells.append(codes[r] if r < 10 else "+")
        elif b.block_hash is not None:
            evictable += 1
            cells.append("c")
        else:
            cells.append(".")
    return "".join(cells), evictable, shared


def _request_row(req: Any, blocks: list[Any] | None, prompt_of: Callable[[str], str | None] | None
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
        row["blocks"] = [b.block_id for b in blocks]
    if prompt_of is not None:
        text = prompt_of(req.request_id)
        if text is not None:
            row["prompt"] = text[:PROMPT_PREVIEW_CHARS]
    return row


def snapshot_scheduler(scheduler: Any, *, prompt_of: Callable[[str], str | None] | None = None,
                       max_grid_blocks: int = DEFAULT_MAX_GRID_BLOCKS,
                       max_waiting: int = DEFAULT_MAX_WAITING,
                       now: float | None = None) -> dict[str, Any]:
    """The state of `scheduler` (a `pagemill.scheduler.Scheduler`) and its block pool.

    `now` stamps the picture (wall-clock seconds by default; the simulator passes its
    virtual clock). Waiting requests beyond `max_waiting` are counted, not listed.
    """
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    n = pool.num_blocks
    grid, evictable, shared = _grid(pool.blocks, max_grid_blocks)
    tables = kv.req_to_blocks
    running = [_request_row(r, tables.get(r.request_id), prompt_of) for r in scheduler.running]
    waiting_iter = scheduler.iter_waiting()
    waiting = [_request_row(r, None, prompt_of)
               for r in itertools.islice(waiting_iter, max_waiting)]
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
        "prefix_cache": {"enabled": kv.enable_caching, "queries": stats.queries,
                         "hits": stats.hits, "hit_rate": stats.hit_rate},
        "running": running,
        "waiting": waiting,
        "num_waiting": len(scheduler.waiting),
    }


def snapshot_engine(engine: Any, show_prompts: bool = False, **kwargs: Any) -> dict[str, Any] | None:
    """`snapshot_scheduler` of an `LLMEngine` (None for an engine without a scheduler, such as
    a test double). Module-level, so `AsyncEngine.call(partial(snapshot_engine, ...))` can
    run it in an engine process."""
    scheduler = getattr(engine, "scheduler", None)
    if scheduler is None or not hasattr(scheduler, "kv_cache_manager"):
        return None
    prompt_of = None
    if show_prompts:
        processor = getattr(engine, "output_processor", None)
        prompt_of = getattr(processor, "prompt_of", None)
    return snapshot_scheduler(scheduler, prompt_of=prompt_of, **kwargs)
