"""One picture of several data-parallel engine cores (`pagemill serve -dp N`).

Why the cores stay apart: each core has its own block pool, so block ids only mean
something within a core and a prefix cached on one core is no hit on another. The picture
keeps each core's grid and figures under `cores` (the page draws a pool per core), tags
every request row with the `engine` that holds it, and puts the totals where a one-core
picture has its own figures, so the chips and anything reading the one-core fields read
the whole server.
"""

from __future__ import annotations

from typing import Any

# The one-core figures that add up over cores.
_SUMMED = ("num_blocks", "free", "in_use", "evictable", "shared", "cached", "evictions")


def _core_view(k: int, snap: dict[str, Any]) -> dict[str, Any]:
    return {
        "engine": k,
        "t": snap["t"],
        "block_size": snap["block_size"],
        "num_blocks": snap["num_blocks"],
        "grid": snap["grid"],
        "free": snap["free"],
        "in_use": snap["in_use"],
        "evictable": snap["evictable"],
        "shared": snap["shared"],
        "preemptions": snap["preemptions"],
        "prefix_cache": snap["prefix_cache"],
        "num_running": len(snap["running"]),
        "num_waiting": snap["num_waiting"],
    }


def merge_core_snapshots(per_core: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The latest picture of each core (by engine index) as one picture."""
    cores = sorted(per_core)
    snaps = [per_core[k] for k in cores]
    queries = sum(s["prefix_cache"]["queries"] for s in snaps)
    hits = sum(s["prefix_cache"]["hits"] for s in snaps)
    merged: dict[str, Any] = {key: sum(s[key] for s in snaps) for key in _SUMMED}
    costs = [s["cost_us"] for s in snaps if s.get("cost_us") is not None]
    merged.update(
        t=max(s["t"] for s in snaps),
        block_size=snaps[0]["block_size"],
        preemptions=sum(s["preemptions"] for s in snaps),
        prefix_cache={
            "enabled": any(s["prefix_cache"]["enabled"] for s in snaps),
            "queries": queries,
            "hits": hits,
            "hit_rate": hits / queries if queries else 0.0,
        },
        running=[{**r, "engine": k} for k, s in zip(cores, snaps) for r in s["running"]],
        waiting=[{**r, "engine": k} for k, s in zip(cores, snaps) for r in s["waiting"]],
        num_waiting=sum(s["num_waiting"] for s in snaps),
        cores=[_core_view(k, s) for k, s in zip(cores, snaps)],
    )
    if costs:
        merged["cost_us"] = max(costs)
    return merged
