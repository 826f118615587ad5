"""Where the engine loop decides, after each step, whether to take a dashboard picture.

Why a separate object in the loop: the picture must be taken where the engine runs (the
engine process by default), but the engine must not pay for a page nobody has open. So
the per-step question is one read of a shared counter ("is a page watching?"): an integer
in shared memory written by the API process (`multiprocessing.RawValue`, no message, no
lock), or a plain attribute in-process. Only while it is non-zero does the tap look at the
clock, and only every `interval` seconds does it take a picture; one more is taken when
the engine goes idle, so the page never keeps showing requests that have finished.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

from pagemill.server.dashboard.snapshot import snapshot_engine

DEFAULT_INTERVAL_S = 0.25


class WatcherCount(Protocol):
    """How many pages are watching; `multiprocessing.RawValue("i")` satisfies it."""

    value: int


class LocalWatchers:
    """A `WatcherCount` for an engine on a thread of this process."""

    def __init__(self) -> None:
        self.value = 0


@dataclass(frozen=True)
class DashboardSettings:
    """What the engine side needs to know (picklable: it crosses to the engine process)."""

    interval_s: float = DEFAULT_INTERVAL_S
    show_prompts: bool = False

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"the dashboard interval must be > 0 s, got {self.interval_s}")


class SnapshotTap:
    """`poll(engine)` after every step: a picture when one is due and someone watches.

    `last_cost_s` is what the last picture cost (the page shows it), so the price of
    watching is measured by the engine itself, on its own thread.
    """

    def __init__(self, settings: DashboardSettings, watchers: WatcherCount) -> None:
        self.settings = settings
        self.watchers = watchers
        self.interval = settings.interval_s
        self._last = 0.0
        self.last_cost_s = 0.0
        self.num_snapshots = 0

    def poll(self, engine: Any) -> dict[str, Any] | None:
        if not self.watchers.value:
            return None
        now = time.monotonic()
        if now - self._last < self.interval and engine.has_unfinished_requests():
            return None
        return self.take(engine, now)

    def take(self, engine: Any, now: float | None = None) -> dict[str, Any] | None:
        t0 = time.perf_counter()
        snap = snapshot_engine(engine, self.settings.show_prompts)
        self._last = time.monotonic() if now is None else now
        self.last_cost_s = time.perf_counter() - t0
        if snap is not None:
            self.num_snapshots += 1
            snap["cost_us"] = round(self.last_cost_s * 1e6, 1)
        return snap
