"""A simulation replayed in the dashboard's page: `pagemill simulate --html OUT`.

Why the same page: the simulator drives the real scheduler and block pool, so the pictures
`snapshot_scheduler` takes of it are the ones a live server shows; watching the planner's
what-ifs (static vs paged, token budgets, prefix caching) in the same grid and charts
makes their differences visible rather than only tabulated.

`ReplayRecorder` is the simulator's observer: after every simulated step it folds the
step into chart data and, every `frame_dt` virtual seconds, takes a picture (when a run
outgrows `max_frames`, every other picture is dropped and the spacing doubles, so a run
of any length fits). `write_replay_html` writes one self-contained file: the page, its
script and style, uPlot and the recording (gzip + base64; the browser inflates it with
`DecompressionStream`), so it opens from disk with no server and no network.
"""

from __future__ import annotations

import base64
import gzip
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pagemill.server.dashboard.assets import read_static
from pagemill.server.dashboard.events import events_between
from pagemill.server.dashboard.series import SeriesRecorder, TokenClock
from pagemill.server.dashboard.snapshot import snapshot_scheduler

DEFAULT_MAX_FRAMES = 120
DEFAULT_MAX_POINTS = 240


class ReplayRecorder:
    """Records one simulated run (see the module docstring); `as_dict()` when it is over."""

    def __init__(
        self,
        name: str,
        *,
        max_frames: int = DEFAULT_MAX_FRAMES,
        frame_dt: float = 1e-3,
        max_grid_blocks: int = 16384,
    ) -> None:
        self.name = name
        self.max_frames = max_frames
        self.frame_dt = frame_dt
        self.max_grid_blocks = max_grid_blocks
        self.frames: list[dict[str, Any]] = []
        self._next_frame = 0.0
        self._steps: list[tuple[Any, ...]] = []
        self._tokens = TokenClock()
        self._clock = 0.0

    def __call__(self, clock: float, scheduler: Any, updates: list[Any], dt: float) -> None:
        """After one simulated step ending at `clock` (virtual seconds) that took `dt`."""
        prompt, gen, ttft, itl = self._tokens.observe(clock, updates, scheduler)
        stats = scheduler.get_stats()
        self._steps.append(
            (
                clock,
                dt,
                stats.num_running,
                stats.num_waiting,
                stats.kv_cache_usage,
                gen,
                prompt,
                ttft,
                itl,
            )
        )
        self._clock = clock
        if clock >= self._next_frame or not scheduler.has_unfinished_requests():
            self._take(clock, scheduler)

    def _take(self, clock: float, scheduler: Any) -> None:
        self.frames.append(
            snapshot_scheduler(scheduler, now=round(clock, 6), max_grid_blocks=self.max_grid_blocks)
        )
        if len(self.frames) > self.max_frames:
            last = self.frames[-1]
            self.frames = [*self.frames[:-1:2], last]
            self.frame_dt *= 2
        self._next_frame = clock + self.frame_dt

    def series(self, max_points: int = DEFAULT_MAX_POINTS) -> list[dict[str, Any]]:
        """The run's chart points, in buckets sized so that there are at most `max_points`."""
        if not self._steps:
            return []
        bucket = max(self._clock / max_points, 1e-4)
        rec = SeriesRecorder(bucket_s=bucket, history=max_points + 8, clock=lambda: 0.0)
        for clock, dt, running, waiting, kv, gen, prompt, ttft, itl in self._steps:
            stats = SimpleNamespace(num_running=running, num_waiting=waiting, kv_cache_usage=kv)
            it = SimpleNamespace(
                num_generation_tokens=gen,
                num_prompt_tokens=prompt,
                time_to_first_tokens=ttft,
                inter_token_latencies=itl,
            )
            rec.add_step(stats, it, dt, now=clock)
        rec.flush(now=self._clock + 2 * bucket + 1e-9)
        return [p for p in rec.history() if not p.get("gap")]

    def as_dict(self) -> dict[str, Any]:
        events: list[dict[str, Any]] = []
        prev = None
        for frame in self.frames:
            events.extend(events_between(prev, frame))
            prev = frame
        return {"name": self.name, "frames": self.frames, "series": self.series(), "events": events}


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def render_replay_html(runs: list[dict[str, Any]], title: str, sections: str = "") -> str:
    """The dashboard page with everything inlined and `runs` (ReplayRecorder.as_dict()s).
    `sections`: HTML (escaped by the caller, no script) placed above the picture, e.g. the
    routers of `simulate --replicas` side by side."""
    recording = {"config": {"mode": "replay", "title": title}, "runs": _finite(runs)}
    blob = gzip.compress(json.dumps(recording, separators=(",", ":")).encode(), mtime=0)
    data = base64.b64encode(blob).decode("ascii")
    page = read_static("index.html")
    styles = read_static("vendor/uPlot.min.css") + "\n" + read_static("dashboard.css")
    scripts = read_static("vendor/uPlot.iife.min.js") + "\n" + read_static("dashboard.js")
    page = page.replace(
        '<link rel="stylesheet" href="dashboard/static/vendor/uPlot.min.css">\n', ""
    )
    page = page.replace(
        '<link rel="stylesheet" href="dashboard/static/dashboard.css">',
        f"<style>\n{styles}\n</style>",
    )
    page = page.replace('<script src="dashboard/static/vendor/uPlot.iife.min.js"></script>\n', "")
    page = page.replace(
        '<script src="dashboard/static/dashboard.js"></script>',
        f'<script type="application/json" id="pagemill-replay">{data}</script>\n'
        f"<script>\n{scripts}\n</script>",
    )
    page = page.replace(
        "<title>pagemill dashboard</title>", f"<title>pagemill simulation: {_escape(title)}</title>"
    )
    if sections:
        page = page.replace('<section class="chips"', sections + '\n<section class="chips"', 1)
    if "dashboard/static/" in page:
        raise RuntimeError("the replay page still refers to a static file")
    return page


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def write_replay_html(
    path: Path, runs: list[dict[str, Any]], title: str, sections: str = ""
) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_replay_html(runs, title, sections), "utf-8")
    return path
