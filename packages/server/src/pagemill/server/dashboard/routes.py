"""The dashboard's HTTP routes: the page, its static files, a JSON picture and the SSE feed.

Why these and nothing else: the page is read-only, so every route is a GET and none takes
input but the static file's name (looked up in a fixed table, never joined to a path).
Everything is served from the package (no CDN: the page works with no network, and its
Content-Security-Policy forbids loading from anywhere else). With an API key the whole
`/dashboard` tree is behind it (see `auth`: a browser sends it as Basic auth).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from pagemill.server.dashboard.assets import read_static
from pagemill.server.dashboard.hub import DashboardHub

STATIC_FILES = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "vendor/uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "vendor/uPlot.min.css": "text/css; charset=utf-8",
    "vendor/uPlot.LICENSE": "text/plain; charset=utf-8",
}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
    "style-src 'self' 'unsafe-inline'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}
KEEPALIVE_S = 15.0


def sse(event: str, data: Any) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


async def feed(hub: DashboardHub) -> AsyncIterator[str]:
    """One page's stream: `init` (config, chart history, events, last picture), a fresh
    picture, then pictures and chart points as they come. While subscribed, the engine side
    takes pictures (see `tap`); when the page goes, this generator's cleanup unsubscribes."""
    if hub.closed:
        return
    sub = hub.subscribe()
    try:
        yield sse("init", hub.init_message())
        await hub.refresh()  # arrives through the queue like any other picture
        idle = 0.0
        tick = hub.series.bucket_s
        while True:
            try:
                msg = await asyncio.wait_for(sub.queue.get(), tick)
            except TimeoutError:
                hub.flush()
                idle += tick
                if idle >= KEEPALIVE_S:
                    idle = 0.0
                    yield ": keepalive\n\n"
                continue
            idle = 0.0
            if msg["type"] == "close":
                return
            yield sse(msg["type"], msg)
    finally:
        hub.unsubscribe(sub)


def install_dashboard(app: FastAPI, hub: DashboardHub) -> None:
    """Add GET /dashboard, /dashboard/static/{name}, /dashboard/snapshot, /dashboard/events."""
    from pagemill.server.entrypoints.openai.api_server import (
        SSEResponse,  # here: api_server imports this module
    )

    page = read_static("index.html")
    files = {name: (read_static(name), media) for name, media in STATIC_FILES.items()}

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)

    @app.get("/dashboard/static/{name:path}", include_in_schema=False)
    async def dashboard_static(name: str) -> Response:
        found = files.get(name)
        if found is None:
            return Response("not found", status_code=404, media_type="text/plain")
        body, media = found
        return Response(body, media_type=media, headers=SECURITY_HEADERS)

    @app.get("/dashboard/snapshot", include_in_schema=False)
    async def dashboard_snapshot() -> Response:
        snap = await hub.refresh()
        return JSONResponse(
            {"config": hub.config, "snapshot": snap, "events": list(hub.events)},
            headers=SECURITY_HEADERS,
        )

    @app.get("/dashboard/events", include_in_schema=False)
    async def dashboard_events() -> Response:
        response = SSEResponse(feed(hub))
        response.headers.update(SECURITY_HEADERS)
        response.headers["Cache-Control"] = "no-cache"
        return response
