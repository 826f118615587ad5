"""Preemptions and evictions, read off two consecutive pictures of the engine.

Why from pictures: both are counted by the engine anyway (the scheduler's preemption total,
each request's own preemption count, the block pool's eviction total), so comparing two
pictures names what happened in between without a hook in the scheduler's hot path.
"""

from __future__ import annotations

from typing import Any

MAX_IDS = 8


def _preemptions_by_id(snap: dict[str, Any]) -> dict[str, int]:
    return {r["id"]: r["preemptions"] for part in ("running", "waiting") for r in snap[part]}


def events_between(prev: dict[str, Any] | None, cur: dict[str, Any]) -> list[dict[str, Any]]:
    """What happened between `prev` and `cur` (nothing when there is no `prev`)."""
    if prev is None:
        return []
    out: list[dict[str, Any]] = []
    t = cur["t"]
    preempted = cur["preemptions"] - prev["preemptions"]
    if preempted > 0:
        before = _preemptions_by_id(prev)
        ids = [rid for rid, n in _preemptions_by_id(cur).items() if n > before.get(rid, 0)]
        out.append({"t": t, "kind": "preempt", "count": preempted, "ids": ids[:MAX_IDS]})
    evicted = cur["evictions"] - prev["evictions"]
    if evicted > 0:
        out.append({"t": t, "kind": "evict", "count": evicted})
    return out
