"""Serving until told to stop: graceful drain on SIGTERM/SIGINT, non-zero exit when broken.

uvicorn alone, on SIGTERM, closes the listener, gives in-flight requests 5 s, cancels the
rest mid-stream (no final event) and re-raises the signal, so the process dies with -15.
`GracefulServer` instead:

- on SIGTERM or SIGINT stops accepting connections and lets in-flight requests run for up
  to `shutdown_timeout` seconds; whatever is still running then is aborted in the engine
  and ends with a final error event and `data: [DONE]` (a whole answer gets a 503); the
  process exits 0. A second SIGINT forces an immediate exit.
- polls the `Watchdog`: a dead engine, or a step stuck past its timeout plus grace, ends
  in-flight requests with an error and makes `serve` return 1 (the CLI's exit status), so
  a supervisor restarts the server rather than keeping a process that answers 503
  forever. Should even that hang (a wedged engine thread), the process exits 1 anyway
  `FATAL_EXIT_SECONDS` later.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from pagemill.server.async_engine import ServerShuttingDownError
from pagemill.server.entrypoints.connection_limits import ConnectionLimits
from pagemill.server.entrypoints.watchdog import Watchdog

logger = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_TIMEOUT = 30.0
FATAL_EXIT_SECONDS = 15.0
# The server `serve` runs now (tests stop a server they run on a thread through it).
LAST_SERVER: GracefulServer | None = None


class GracefulServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        client: Any,
        *,
        shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
        watchdog: Watchdog | None = None,
    ) -> None:
        if not shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {shutdown_timeout}")
        # uvicorn's own wait outlives ours: the streams end themselves first.
        config.timeout_graceful_shutdown = shutdown_timeout + 5.0  # type: ignore[assignment]  # uvicorn annotates int, takes float seconds
        super().__init__(config)
        self.client = client
        self.shutdown_timeout = shutdown_timeout
        self.watchdog = watchdog
        self.exit_code = 0
        self.fatal_reason: str | None = None
        self._fatal_timer: threading.Timer | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Like uvicorn's, without re-raising the signal afterwards (that made exit -15)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            if not self.should_exit:
                logger.info(
                    "received %s: draining for up to %g s",
                    signal.Signals(sig).name,
                    self.shutdown_timeout,
                )
            self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.watchdog is not None and self.fatal_reason is None:
            verdict = self.watchdog.check()
            if verdict.fatal:
                self._fatal(verdict.reason or "the engine failed")
        return await super().on_tick(counter)

    def _fatal(self, reason: str) -> None:
        logger.critical(
            "%s; exiting with status 1 so that a supervisor restarts the server", reason
        )
        self.fatal_reason = reason
        self.exit_code = 1
        self.should_exit = True
        # No drain for a broken engine: what is still streaming cannot finish anyway.
        self.shutdown_timeout = 0.0
        self.config.timeout_graceful_shutdown = min(  # type: ignore[assignment]  # float seconds, as above
            self.config.timeout_graceful_shutdown or 2.0, 2.0
        )
        with contextlib.suppress(Exception):
            self.client.fail_all(
                ServerShuttingDownError("the engine failed; the server is restarting")
            )
        # Last resort: a wedged engine thread must not keep the process alive.
        self._fatal_timer = threading.Timer(FATAL_EXIT_SECONDS, os._exit, args=(1,))
        self._fatal_timer.daemon = True
        self._fatal_timer.start()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        from pagemill.server.entrypoints.openai.api_server import close_dashboard

        close_dashboard(self.config.app)  # open dashboard pages must not hold the drain
        drain = asyncio.ensure_future(self._end_stragglers())
        try:
            await super().shutdown(sockets)
        finally:
            drain.cancel()

    async def _end_stragglers(self) -> None:
        await asyncio.sleep(self.shutdown_timeout)
        if self.client.num_pending:
            logger.warning(
                "shutdown timeout: ending %d request(s) still in flight", self.client.num_pending
            )
        self.client.fail_all(ServerShuttingDownError("the server is shutting down"))


def serve(
    app: Any,
    client: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
    watchdog: Watchdog | None = None,
    limits: ConnectionLimits | None = None,
    timeout_keep_alive: float = 5.0,
    sockets: list[socket.socket] | None = None,
) -> int:
    """Serve in the foreground until a signal or a fatal engine error; returns the exit code."""
    limits = limits or ConnectionLimits()
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        http=limits.protocol(),
        # uvicorn annotates int, takes float seconds
        timeout_keep_alive=timeout_keep_alive,  # type: ignore[arg-type]
    )
    global LAST_SERVER
    server = LAST_SERVER = GracefulServer(
        config, client, shutdown_timeout=shutdown_timeout, watchdog=watchdog
    )
    started = time.monotonic()
    try:
        server.run(sockets=sockets)
    finally:
        if server._fatal_timer is not None:  # shut down in time: no forced exit needed
            server._fatal_timer.cancel()
    if server.fatal_reason is None and not server.started:
        return 1  # never came up (port in use, ...): uvicorn logged why
    logger.info(
        "server stopped after %.0f s (exit status %d)", time.monotonic() - started, server.exit_code
    )
    return server.exit_code


__all__ = ["DEFAULT_SHUTDOWN_TIMEOUT", "GracefulServer", "serve"]
