"""Errors in OpenAI's JSON shape, and the handlers that make every failure use it.

OpenAI clients parse `{"error": {"message", "type", "param", "code"}}` to raise typed
exceptions; FastAPI's defaults (422 with a `detail` list, HTML-less 404s) would surface as
generic errors. So validation failures, unknown routes and our own refusals all go through
`error_response`, and bad input is always a 4xx: a 500 means a bug in the server.

What went wrong inside the server is never sent to clients (an exception's text may name
another user's request or a path on the machine): they get a generic message with an
error id (`err-...`), and the log has the details under the same id (`internal_error`).
"""

from __future__ import annotations

import logging
import uuid
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """A refusal the client should see as-is, with an HTTP status."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def internal_error(
    status_code: int, public: str, exc: BaseException | None = None, *, code: str | None = None
) -> APIError:
    """An APIError saying only `public` plus an error id; the details go to the log."""
    error_id = f"err-{uuid.uuid4().hex[:16]}"
    if exc is not None:
        logger.error(
            "%s [%s]: %s: %s",
            public,
            error_id,
            type(exc).__name__,
            exc,
            exc_info=exc if status_code >= 500 else None,
        )
    else:
        logger.error("%s [%s]", public, error_id)
    return APIError(status_code, f"{public} (error id {error_id})", code=code)


def error_body(
    status_code: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(
                status_code, "invalid_request_error" if status_code < 500 else "server_error"
            ),
            "param": param,
            "code": code if code is not None else status_code,
        }
    }


def error_response(
    status_code: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(
        error_body(status_code, message, param, code), status_code=status_code, headers=headers
    )


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line out of pydantic's error list, plus the offending field."""
    parts: list[str] = []
    param: str | None = None
    for err in exc.errors()[:5]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        # Union members show up in the location (e.g. "prompt.str"); the field is the head.
        if err.get("type") == "json_invalid":
            parts.append(f"request body is not valid JSON: {err.get('msg', '')}")
            continue
        field = loc[0] if loc else None
        if param is None:
            param = field
        where = ".".join(loc) if loc else "body"
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{where}: {msg}")
    return ("; ".join(parts) or "invalid request"), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(
            exc.status_code, exc.message, param=exc.param, code=exc.code, headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = "error"
        message = exc.detail if isinstance(exc.detail, str) else phrase
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        err = internal_error(500, "internal server error", exc)
        return error_response(500, err.message)
