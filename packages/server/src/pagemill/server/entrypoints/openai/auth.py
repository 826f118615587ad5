"""The API key, checked before anything else about a request.

As a FastAPI dependency the check ran only after the body was read and parsed, so a
client without a key could still make the server buffer and parse 4 MiB of JSON and tell
malformed from well-formed bodies (400 before 401). This middleware answers 401 from the
headers alone, before the body is read or a route is matched.

The dashboard (`/dashboard...`) is behind the same key. A browser cannot add a Bearer
header to a page load or an EventSource, so there the key is also accepted as the password
of HTTP Basic auth (any user name): the 401 asks for it, the browser prompts once and then
sends it with every request of the page.
"""

from __future__ import annotations

import base64
import binascii
import secrets
from collections.abc import Awaitable, Callable

from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from pagemill.server.entrypoints.openai.errors import error_response

PROTECTED_PREFIX = "/v1"
OLLAMA_PREFIX = "/api/"  # Ollama's API, behind the same key
DASHBOARD_PREFIX = "/dashboard"
METRICS_PATH = "/metrics"


def key_matches(header: str, api_key: str) -> bool:
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(
        token.strip().encode(), api_key.encode()
    )


def basic_key_matches(header: str, api_key: str) -> bool:
    """`Authorization: Basic base64(user:key)` with any user name (the dashboard's way)."""
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "basic":
        return False
    try:
        decoded = base64.b64decode(token.strip(), validate=True)
    except (binascii.Error, ValueError):
        return False
    _, sep, password = decoded.partition(b":")
    return bool(sep) and secrets.compare_digest(password, api_key.encode())


def _is_dashboard(path: str) -> bool:
    return path == DASHBOARD_PREFIX or path.startswith(DASHBOARD_PREFIX + "/")


class APIKeyMiddleware:
    def __init__(
        self,
        app: Callable[[Scope, Receive, Send], Awaitable[None]],
        api_key: str,
        protect_metrics: bool = False,
    ) -> None:
        self.app = app
        self.api_key = api_key
        # /metrics behind the key too (`--metrics-require-api-key`): Bearer only.
        self.protect_metrics = protect_metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        dashboard = _is_dashboard(path)
        metrics = self.protect_metrics and (
            path == METRICS_PATH or path.startswith(METRICS_PATH + "/")
        )
        ollama = path.startswith(OLLAMA_PREFIX)
        if path.startswith(PROTECTED_PREFIX) or ollama or dashboard or metrics:
            header = x_api_key = ""
            for name, value in scope.get("headers", []):
                if name == b"authorization":
                    header = value.decode("latin-1")
                elif name == b"x-api-key":  # Anthropic's clients send the key this way
                    x_api_key = value.decode("latin-1")
            ok = (
                key_matches(header, self.api_key)
                or (bool(x_api_key) and secrets.compare_digest(x_api_key, self.api_key))
                or (dashboard and basic_key_matches(header, self.api_key))
            )
            if not ok:
                challenge = (
                    'Basic realm="pagemill dashboard (password: the API key)"'
                    if dashboard
                    else "Bearer"
                )
                refuse = error_response(
                    401,
                    "missing or invalid API key (send 'Authorization: Bearer <key>')",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": challenge},
                )
                if ollama or path.startswith("/v1/messages"):  # those APIs' error shapes
                    message = "missing or invalid API key"
                    body: dict[str, object] = {"error": message}
                    if not ollama:
                        kind = {"type": "authentication_error", "message": message}
                        body = {"type": "error", "error": kind}
                    refuse = JSONResponse(body, 401, headers={"WWW-Authenticate": challenge})
                await refuse(scope, receive, send)
                return
        await self.app(scope, receive, send)
