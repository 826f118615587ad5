"""What the non-OpenAI-chat front ends share: they speak chat completions underneath.

The Responses, Anthropic Messages and Ollama APIs are other spellings of one chat turn.
Each front end translates its body into a `ChatCompletionRequest` and runs it through
`ChatServing.create` — the same template rendering, tool prompt and parsing, reasoning
split, structured output, sampling checks and engine stream as /v1/chat/completions — and
translates the answer (or each streamed chunk) back. Generation is never reimplemented,
so the three APIs give token-for-token the chat endpoint's output for the same request.

Errors: every front end answers in its own error shape, so handlers run their work under
`guard`, which turns `APIError` (and pydantic's `ValidationError` of the front end's own
request model, or of the translated chat request) into that shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Generic, TypeVar

import partial_json_parser
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagemill.server.entrypoints.openai.errors import APIError, internal_error
from pagemill.server.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    SamplingFields,
    StreamOptions,
)
from pagemill.server.entrypoints.openai.serving_base import failure
from pagemill.server.entrypoints.openai.serving_chat import ChatServing

logger = logging.getLogger(__name__)

T = TypeVar("T")
ErrorShape = Callable[[APIError], Response]


def validation_error(exc: ValidationError, prefix: str = "") -> APIError:
    """A 400 naming the first offending field of a pydantic error."""
    parts: list[str] = []
    param: str | None = None
    for err in exc.errors()[:5]:
        loc = [str(x) for x in err.get("loc", ())]
        where = prefix + ".".join(loc) if loc else (prefix.rstrip(".") or "body")
        if param is None and loc:
            param = prefix + loc[0]
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{where}: {msg}")
    return APIError(400, "; ".join(parts) or "invalid request", param=param)


async def read_body(request: Request, model: type[BaseModel]) -> Any:
    """The body parsed as JSON and validated by `model` (errors: APIError 400)."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from exc
    if isinstance(data, dict):  # fields outside the API this server speaks: said, not silent
        known = {field.alias or name for name, field in model.model_fields.items()}
        for name in data:
            if isinstance(name, str) and name not in known:
                warn_once(_unknown, request.url.path, name, "not a field this server knows")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from exc


_unknown: set[str] = set()


async def guard(work: Callable[[], Awaitable[Response]], shape: ErrorShape) -> Response:
    """Run a handler; any refusal or failure is answered in the API's own error shape."""
    try:
        return await work()
    except APIError as exc:
        return shape(exc)
    except ValidationError as exc:
        return shape(validation_error(exc))
    except StarletteHTTPException as exc:  # e.g. the body-size limit while reading
        detail = exc.detail if isinstance(exc.detail, str) else "request refused"
        return shape(APIError(exc.status_code, detail))
    except Exception as exc:
        return shape(internal_error(500, "internal server error", exc))


def chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    """The translated request, validated by chat's own rules (errors: APIError 400)."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from exc


async def complete(
    chat: ChatServing, req: ChatCompletionRequest, raw_request: Request
) -> ChatCompletionResponse:
    result = await chat.create(req.model_copy(update={"stream": False}), raw_request)
    assert isinstance(result, ChatCompletionResponse)
    return result


class ChatFailedError(Exception):
    """The chat stream ended with an error event instead of [DONE]."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(error.get("message", "error"))
        self.error = error


async def chat_chunks(
    serving: Any, req: SamplingFields, raw_request: Request
) -> ClosingStream[dict[str, Any]]:
    """The stream of `serving` (chat, or completions for raw prompts) as chunk dicts. The
    usage chunk is asked for and comes last; an error event raises `ChatFailedError`."""
    req = req.model_copy(
        update={"stream": True, "stream_options": StreamOptions(include_usage=True)}
    )
    result = await serving.create(req, raw_request)
    assert not isinstance(result, BaseModel)
    inner: AsyncIterator[str] = result

    async def parse() -> AsyncIterator[dict[str, Any]]:
        async for event in inner:
            data = event.removeprefix("data: ").strip()
            if data == "[DONE]":
                continue
            payload = json.loads(data)
            if "error" in payload and "choices" not in payload:
                raise ChatFailedError(payload["error"])
            yield payload

    return ClosingStream(parse(), inner)


class ClosingStream(Generic[T]):
    """An async iterator whose `aclose` also closes the stream it was made from, even if
    it never started (a never-started generator runs no cleanup, so the chat stream's
    engine requests would otherwise stay running after an early hang-up)."""

    def __init__(self, body: AsyncIterator[T], inner: Any) -> None:
        self._body = body
        self._inner = inner

    def __aiter__(self) -> ClosingStream[T]:
        return self

    async def __anext__(self) -> T:
        return await self._body.__anext__()

    async def aclose(self) -> None:
        try:
            with contextlib.suppress(RuntimeError):
                await self._body.aclose()  # type: ignore[attr-defined]
        finally:
            aclose = getattr(self._inner, "aclose", None)
            if aclose is not None:
                await aclose()


def stream_error(exc: BaseException) -> tuple[int, str, str | None]:
    """(status, message, code) for an error that ends a stream, without internals."""
    if isinstance(exc, ChatFailedError):
        err = exc.error
        code = err.get("code")
        status = code if isinstance(code, int) else 500
        return status, str(err.get("message", "error")), None if isinstance(code, int) else code
    api = failure(exc)
    return api.status_code, api.message, api.code


async def until_disconnect(raw_request: Request, work: Awaitable[Any]) -> Any:
    """Await `work`, cancelling it if the client hangs up first (APIError 499 then)."""

    async def watch() -> None:
        while (await raw_request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
    if task.cancelled():
        raise APIError(499, "client disconnected")
    return task.result()


def json_response(body: Any, status_code: int = 200) -> JSONResponse:
    return JSONResponse(body, status_code=status_code)


def cached_tokens(usage: Any) -> int:
    """Prefix-cache hits from chat's usage, where the server reports them."""
    if isinstance(usage, BaseModel):
        usage = usage.model_dump()
    details = (usage or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def warn_once(seen: set[str], what: str, name: str, why: str) -> None:
    """One log warning per ignored field name (not per request); names come from
    clients, so the set of names remembered is bounded."""
    name = name[:64]
    key = f"{what}\0{name}"
    if key not in seen and len(seen) < 256:
        seen.add(key)
        logger.warning("%s: ignoring '%s' (%s)", what, name, why)


def thinking_fields(chat: ChatServing, enabled: bool | None, param: str) -> dict[str, Any]:
    """Chat fields for a front end's thinking switch (None: the model's default).

    Thinking on needs a --reasoning-parser to return it apart from the answer; thinking
    off is the chat template's `enable_thinking` switch (the qwen3 and deepseek convention).
    """
    if enabled is None:
        return {}
    if enabled and chat.reasoning_parser is None:
        raise APIError(
            400,
            f"'{param}': this server returns no thinking (it was started without "
            "--reasoning-parser)",
            param=param,
        )
    if not enabled and chat.reasoning_parser is not None:
        return {"chat_template_kwargs": {"enable_thinking": False}}
    return {}


def arguments_object(arguments: str) -> dict[str, Any]:
    """A call's JSON arguments as an object (Anthropic's `input`, Ollama's `arguments`);
    arguments cut short by max_tokens give their complete part (partial_json_parser)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        try:
            value = partial_json_parser.loads(arguments) if arguments.strip() else {}
        except Exception:
            value = {}
    return value if isinstance(value, dict) else {"value": value}
