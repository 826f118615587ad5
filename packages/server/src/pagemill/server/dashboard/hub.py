"""The API-process side of the dashboard: latest picture, chart history, events, open pages.

Why one hub: pictures arrive on whatever thread runs the engine (the engine thread
in-process, the reader thread of an engine process) and pages read them on the event loop.
The hub is the one place that crosses: producers call `publish_snapshot` / `on_step`
under a lock, and every page gets its messages through `call_soon_threadsafe` onto its own
bounded queue (a slow page loses old messages, it never slows a producer). JSON is encoded
on the event loop, never on the engine's thread.

With several data-parallel cores every core takes its own pictures (tagged with its
`engine_index` by the client); the hub keeps the latest of each, names each core's events
from its own previous picture, and publishes them merged (see `cores`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections import deque
from typing import Any

from pagemill.server.dashboard.cores import merge_core_snapshots
from pagemill.server.dashboard.events import events_between
from pagemill.server.dashboard.series import SeriesRecorder
from pagemill.server.dashboard.snapshot import PROMPT_PREVIEW_CHARS, snapshot_engine
from pagemill.server.dashboard.tap import (
    DashboardSettings,
    LocalWatchers,
    SnapshotTap,
    WatcherCount,
)

logger = logging.getLogger(__name__)

QUEUE_SIZE = 64
MAX_EVENTS = 200


class Subscription:
    """One open page: its loop and its queue of messages (dicts)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=QUEUE_SIZE)

    def offer(self, msg: dict[str, Any]) -> None:
        """On the subscription's loop: enqueue, dropping the oldest message when full."""
        q = self.queue
        if q.full():
            with contextlib.suppress(asyncio.QueueEmpty):
                q.get_nowait()
        q.put_nowait(msg)


class DashboardHub:
    """A `StepObserver` plus the state the page reads. `attach(client)` once, before serving."""

    def __init__(
        self,
        settings: DashboardSettings | None = None,
        *,
        model_name: str = "",
        series: SeriesRecorder | None = None,
    ) -> None:
        self.settings = settings if settings is not None else DashboardSettings()
        self.model_name = model_name
        self.series = series if series is not None else SeriesRecorder()
        self.events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)
        self.latest: dict[str, Any] | None = None
        self.core_latest: dict[int, dict[str, Any]] = {}  # data parallel: per engine index
        self.watchers: WatcherCount = LocalWatchers()
        self.client: Any = None
        self._tap: SnapshotTap | None = None
        self._lock = threading.Lock()
        # Replaced, never mutated: producers on other threads iterate it without a lock.
        self._subs: tuple[Subscription, ...] = ()
        self.closed = False

    def attach(self, client: Any) -> None:
        """Take pictures from `client`'s engine core, in the core's own thread or process
        (a core process must have been launched with dashboard settings); prompts, which
        only the front end holds, are joined here (`--dashboard-show-prompts`)."""
        self.client = client
        shared = getattr(client, "dashboard_watchers", None)
        if shared is not None:
            self.watchers = shared
        else:
            tap = SnapshotTap(self.settings, self.watchers)
            attach = getattr(client, "attach_core_observer", None)
            if attach is None or not attach(tap):
                self._tap = tap  # a client without a core thread: pictures in on_step
        client.on_dashboard = self.publish_snapshot

    # ------------------------------------------------------------ producers (any thread)

    def on_step(self, engine: Any, step_seconds: float | None = None) -> None:
        """`StepObserver`: fold the step into the charts; in-process, maybe take a picture."""
        if step_seconds is not None:
            with self._lock:
                points = self.series.add_step(
                    engine.get_stats(), getattr(engine, "iteration_stats", None), step_seconds
                )
            if points:
                self._broadcast({"type": "points", "points": points})
        tap = self._tap
        if tap is not None:
            snap = tap.poll(engine)
            if snap is not None:
                self.publish_snapshot(snap)

    def publish_snapshot(self, snap: dict[str, Any]) -> None:
        self._add_prompts(snap)
        core = snap.pop("engine_index", None)
        if core is not None:
            self._publish_core(core, snap)
            return
        with self._lock:
            latest = self.latest
            if latest is not None and snap["t"] < latest["t"]:
                return  # an on-demand picture overtaken by a newer one (engine thread)
            events = events_between(latest, snap)
            self.latest = snap
            self.events.extend(events)
        self._broadcast({"type": "snapshot", "snapshot": snap, "events": events})

    def _publish_core(self, core: int, snap: dict[str, Any]) -> None:
        with self._lock:
            prev = self.core_latest.get(core)
            if prev is not None and snap["t"] < prev["t"]:
                return
            events = [{**e, "engine": core} for e in events_between(prev, snap)]
            self.core_latest[core] = snap
            merged = self.latest = merge_core_snapshots(self.core_latest)
            self.events.extend(events)
        self._broadcast({"type": "snapshot", "snapshot": merged, "events": events})

    def _add_prompts(self, snap: dict[str, Any]) -> None:
        prompt_of = getattr(self.client, "prompt_of", None)
        if not self.settings.show_prompts or prompt_of is None:
            return
        for row in (*snap.get("running", ()), *snap.get("waiting", ())):
            if "prompt" not in row:
                text = prompt_of(row["id"])
                if text is not None:
                    row["prompt"] = text[:PROMPT_PREVIEW_CHARS]

    def flush(self) -> None:
        """Close a chart bucket whose time is over (pages call it while idle)."""
        with self._lock:
            points = self.series.flush()
        if points:
            self._broadcast({"type": "points", "points": points})

    def close(self) -> None:
        """End every page's stream now (server shutdown: an open page must not hold the
        drain open); pages that come later get an empty stream."""
        self.closed = True
        self._broadcast({"type": "close"})

    def _broadcast(self, msg: dict[str, Any]) -> None:
        for sub in self._subs:
            with contextlib.suppress(RuntimeError):  # that page's loop is gone
                sub.loop.call_soon_threadsafe(sub.offer, msg)

    # ------------------------------------------------------------ pages (event loop)

    @property
    def config(self) -> dict[str, Any]:
        return {
            "mode": "live",
            "model": self.model_name,
            "interval_ms": round(self.settings.interval_s * 1e3),
            "bucket_s": self.series.bucket_s,
            "show_prompts": self.settings.show_prompts,
        }

    def subscribe(self) -> Subscription:
        sub = Subscription(asyncio.get_running_loop())
        self._subs = (*self._subs, sub)
        self.watchers.value = len(self._subs)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subs = tuple(s for s in self._subs if s is not sub)
        self.watchers.value = len(self._subs)

    def init_message(self) -> dict[str, Any]:
        with self._lock:
            return {
                "type": "init",
                "config": self.config,
                "history": self.series.history(),
                "events": list(self.events),
                "snapshot": self.latest,
            }

    async def refresh(self, timeout: float = 10.0) -> dict[str, Any] | None:
        """A picture taken now, between two steps (the engine may be idle and silent)."""
        client = self.client
        if client is None:
            return self.latest
        fn = functools.partial(snapshot_engine, show_prompts=self.settings.show_prompts)
        # Data parallel: one picture from each core (`call` would answer with one core's).
        call_each = getattr(getattr(client, "client", None), "call_each", None)
        try:
            if call_each is not None:
                snaps = await asyncio.wait_for(asyncio.wrap_future(call_each(fn)), timeout)
            else:
                snaps = [await asyncio.wait_for(client.call(fn), timeout)]
        except Exception as exc:  # a dead or busy engine: the page keeps the last picture
            logger.debug("dashboard refresh failed: %r", exc)
            return self.latest
        for k, snap in enumerate(snaps):
            if snap is not None:
                if call_each is not None:
                    snap["engine_index"] = k
                self.publish_snapshot(snap)
        return self.latest if call_each is not None else snaps[0]
