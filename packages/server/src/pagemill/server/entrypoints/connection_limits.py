"""Connection limits uvicorn does not have: read deadlines and a cap on open sockets.

uvicorn times out idle keep-alive connections, but a client that opens a socket and sends
half a request line, or announces a body and never sends it, holds its socket (and file
descriptor) forever: a few hundred such clients exhaust the server. This h11 protocol
closes a connection whose request headers are not complete `header_timeout` seconds after
it started sending them (or after it connected), or whose body is not complete
`body_timeout` seconds after its headers, and refuses connections beyond
`max_connections` (closed at once, before anything is read).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_BODY_TIMEOUT = 30.0
DEFAULT_MAX_CONNECTIONS = 2048


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    max_connections: int = DEFAULT_MAX_CONNECTIONS

    def __post_init__(self) -> None:
        if not self.header_timeout > 0 or not self.body_timeout > 0:
            raise ValueError("header and body timeouts must be > 0 seconds")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")

    def protocol(self) -> type[H11Protocol]:
        """An h11 protocol class for `uvicorn.Config(http=...)` enforcing these limits."""
        return type("LimitedH11Protocol", (LimitedH11Protocol,), {"limits": self})


class LimitedH11Protocol(H11Protocol):
    limits: ConnectionLimits = ConnectionLimits()
    refused = 0  # connections closed at once because of the cap (all servers; for tests)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._deadline_kind: str | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            type(self).refused += 1
            transport.abort()
            return
        self._update_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._update_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._update_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def _update_deadline(self) -> None:
        if self.transport is None or self.transport.is_closing():
            self._cancel_deadline()
            return
        state = self.conn.their_state
        if state is h11.IDLE and self.timeout_keep_alive_task is None:
            kind, seconds = "headers", self.limits.header_timeout
        elif state is h11.SEND_BODY:
            kind, seconds = "body", self.limits.body_timeout
        else:  # request complete (or idle under uvicorn's keep-alive timer)
            self._cancel_deadline()
            return
        if self._deadline_kind != kind:
            self._cancel_deadline()
            self._deadline_kind = kind
            self._deadline = self.loop.call_later(seconds, self._expired)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = None
        self._deadline_kind = None

    def _expired(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.logger.info(
                "closing a connection whose request %s did not arrive in time", self._deadline_kind
            )
            self.transport.close()
        self._deadline_kind = None
