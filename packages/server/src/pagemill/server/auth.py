"""The API key, checked before anything else about a request.

As a FastAPI dependency the check ran only after the body was read and parsed, so a
client without a key could still make the server buffer and parse 4 MiB of JSON and tell
malformed from well-formed bodies (400 before 401). This middleware answers 401 from the
headers alone, before the body is read or a route is matched.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable

from starlette.types import Receive, Scope, Send

from .errors import error_response

PROTECTED_PREFIX = "/v1"


def key_matches(header: str, api_key: str) -> bool:
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(),
                                                                 api_key.encode())


class APIKeyMiddleware:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]],
                 api_key: str) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path", "").startswith(PROTECTED_PREFIX):
            header = ""
            for name, value in scope.get("headers", []):
                if name == b"authorization":
                    header = value.decode("latin-1")
                    break
            if not key_matches(header, self.api_key):
                refuse = error_response(
                    401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await refuse(scope, receive, send)
                return
        await self.app(scope, receive, send)
