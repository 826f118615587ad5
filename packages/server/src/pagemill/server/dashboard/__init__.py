"""A live picture of the engine in a web page (`pagemill serve` → /dashboard).

The block pool as a grid (free, in use with its holders, cached and evictable), the running
and waiting requests with their block tables and progress, preemptions and evictions as they
happen, the prefix-cache hit rate and charts of throughput, batch size, KV usage, TTFT and
inter-token latency. `pagemill simulate --html` replays a simulation in the same page.

Where each piece runs: `snapshot` (a pure function of the scheduler) and `tap` (the rate
limit) run with the engine — in the engine process by default; `series`, `events` and
`hub` run in the API process; `routes` serves the page and the SSE feed; `replay` writes
the self-contained page of a simulation; `static/` holds the page (and the vendored uPlot).
"""

from pagemill.server.dashboard.hub import DashboardHub
from pagemill.server.dashboard.snapshot import snapshot_engine, snapshot_scheduler
from pagemill.server.dashboard.tap import DashboardSettings, LocalWatchers, SnapshotTap

__all__ = [
    "DashboardHub",
    "DashboardSettings",
    "LocalWatchers",
    "SnapshotTap",
    "snapshot_engine",
    "snapshot_scheduler",
]
