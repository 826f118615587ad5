"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's API over the chat pipeline.

The answer's parts become content blocks — `thinking` (with a --reasoning-parser; its
`signature` is empty, as nothing here signs it), `text`, and `tool_use` per tool call —
and chat's finish becomes Anthropic's stop_reason: "max_tokens" when cut, "tool_use" when
the model called, "stop_sequence" (with `stop_sequence`) when one of the request's
stop_sequences ended it, else "end_turn". A stream sends Anthropic's events: message_start,
ping, per block content_block_start / _delta / _stop, then message_delta (stop_reason and
the token counts) and message_stop. The prompt's token count is known once the engine has
the request, so message_start reports input_tokens 0 and message_delta the real count.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagemill.server.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    chat_body,
)
from pagemill.server.entrypoints.chat_bridge import (
    ClosingStream,
    arguments_object,
    cached_tokens,
    chat_chunks,
    chat_request,
    complete,
    guard,
    read_body,
    stream_error,
    thinking_fields,
)
from pagemill.server.entrypoints.openai.errors import APIError
from pagemill.server.entrypoints.openai.serving_chat import ChatServing
from pagemill.server.entrypoints.openai.serving_tools import ToolPlan

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(status_code: int, message: str) -> dict[str, Any]:
    fallback = "invalid_request_error" if status_code < 500 else "api_error"
    kind = ERROR_TYPES.get(status_code, fallback)
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_error(exc: APIError) -> Response:
    return JSONResponse(
        error_body(exc.status_code, exc.message), status_code=exc.status_code, headers=exc.headers
    )


def event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"


def stop_reason(
    finish: str | None, matched: Any, stops: list[str], called: bool
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from chat's finish_reason and stop_reason."""
    if finish == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if finish == "stop" and isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    return "end_turn", None


class Blocks:
    """Chat's stream chunks as content block events: a delta of another kind (thinking,
    text, a new tool call) stops the open block and starts the next."""

    def __init__(self) -> None:
        self.index = -1
        self.open_kind: str | None = None  # "thinking", "text" or "tool_use"
        self.finish: str | None = None
        self.matched: Any = None
        self.called = False
        self.usage: dict[str, Any] = {}

    def _start(self, kind: str, content_block: dict[str, Any]) -> list[str]:
        out = []
        if self.open_kind is not None:
            out.append(event("content_block_stop", index=self.index))
        self.index += 1
        self.open_kind = kind
        out.append(event("content_block_start", index=self.index, content_block=content_block))
        return out

    def _delta(self, payload: dict[str, Any]) -> str:
        return event("content_block_delta", index=self.index, delta=payload)

    def feed(self, chunk: dict[str, Any]) -> list[str]:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out: list[str] = []
        for choice in chunk.get("choices", []):
            d = choice.get("delta") or {}
            thinking = d.get("reasoning_content")
            if thinking:
                if self.open_kind != "thinking":
                    empty = {"type": "thinking", "thinking": "", "signature": ""}
                    out += self._start("thinking", empty)
                out.append(self._delta({"type": "thinking_delta", "thinking": thinking}))
            if d.get("content"):
                if self.open_kind != "text":
                    out += self._start("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": d["content"]}))
            for tc in d.get("tool_calls") or []:
                fn = tc.get("function") or {}
                if tc.get("id"):
                    self.called = True
                    name = fn.get("name")
                    start: dict[str, Any] = {
                        "type": "tool_use",
                        "id": tc["id"],
                        "name": name,
                        "input": {},
                    }
                    out += self._start("tool_use", start)
                if fn.get("arguments") and self.open_kind == "tool_use":
                    partial = {"type": "input_json_delta", "partial_json": fn["arguments"]}
                    out.append(self._delta(partial))
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
                self.matched = choice.get("stop_reason")
        return out


class MessagesServing:
    def __init__(self, chat: ChatServing) -> None:
        self.chat = chat

    def translate(self, req: CountTokensRequest) -> dict[str, Any]:
        body = chat_body(req)
        if req.thinking is not None:
            body.update(thinking_fields(self.chat, req.thinking.type != "disabled", "thinking"))
        return body

    async def count_tokens(self, req: CountTokensRequest) -> dict[str, Any]:
        chat_req = chat_request(self.translate(req))
        self.chat.check_model(chat_req.model)
        plan = ToolPlan.from_request(chat_req, self.chat.tool_parser)
        ids = await self.chat.off_loop(self.chat.render, chat_req, plan)
        return {"input_tokens": len(ids)}

    async def create(self, req: MessagesRequest, raw_request: Request) -> Response:
        chat_req = chat_request(self.translate(req))
        msg_id = f"msg_{uuid.uuid4().hex}"
        stops = list(req.stop_sequences or [])
        if req.stream:
            chunks = await chat_chunks(self.chat, chat_req, raw_request)
            from pagemill.server.entrypoints.openai.api_server import SSEResponse

            return SSEResponse(ClosingStream(self._stream(msg_id, stops, chunks), chunks))
        result = await complete(self.chat, chat_req, raw_request)
        choice = result.choices[0]
        message = choice.message
        content: list[dict[str, Any]] = []
        if message.reasoning_content:
            content.append(
                {"type": "thinking", "thinking": message.reasoning_content, "signature": ""}
            )
        if message.content:
            content.append({"type": "text", "text": message.content})
        for call in message.tool_calls:
            content.append(
                {
                    "type": "tool_use",
                    "id": call.id,
                    "name": call.function.name,
                    "input": arguments_object(call.function.arguments),
                }
            )
        reason, sequence = stop_reason(
            choice.finish_reason, choice.stop_reason, stops, bool(message.tool_calls)
        )
        usage = result.usage
        body = {
            "id": msg_id,
            "type": "message",
            "role": "assistant",
            "model": self.chat.served_model_name,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": {
                "input_tokens": usage.prompt_tokens,
                "output_tokens": usage.completion_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached_tokens(usage),
            },
        }
        return JSONResponse(body)

    async def _stream(
        self, msg_id: str, stops: list[str], chunks: ClosingStream[dict[str, Any]]
    ) -> AsyncIterator[str]:
        start: dict[str, Any] = {
            "id": msg_id,
            "type": "message",
            "role": "assistant",
            "model": self.chat.served_model_name,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        yield event("message_start", message=start)
        yield event("ping")
        blocks = Blocks()
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    for e in blocks.feed(chunk):
                        yield e
        except Exception as exc:  # the engine or the server failed: say so, then end
            status_code, message, _ = stream_error(exc)
            yield event("error", error=error_body(status_code, message)["error"])
            return
        usage = blocks.usage
        if blocks.open_kind is not None:
            yield event("content_block_stop", index=blocks.index)
        reason, sequence = stop_reason(blocks.finish, blocks.matched, stops, blocks.called)
        yield event(
            "message_delta",
            delta={"stop_reason": reason, "stop_sequence": sequence},
            usage={
                "input_tokens": int(usage.get("prompt_tokens", 0)),
                "output_tokens": int(usage.get("completion_tokens", 0)),
                "cache_read_input_tokens": cached_tokens(usage),
            },
        )
        yield event("message_stop")


def install_anthropic(app: FastAPI, chat: ChatServing) -> None:
    """POST /v1/messages and /v1/messages/count_tokens (behind the API key; Anthropic
    clients send it as `x-api-key`, see auth)."""
    serving = MessagesServing(chat)

    @app.post("/v1/messages")
    async def create_message(raw_request: Request) -> Response:
        async def work() -> Response:
            req = await read_body(raw_request, MessagesRequest)
            return await serving.create(req, raw_request)

        return await guard(work, anthropic_error)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(raw_request: Request) -> Response:
        async def work() -> Response:
            req = await read_body(raw_request, CountTokensRequest)
            return JSONResponse(await serving.count_tokens(req))

        return await guard(work, anthropic_error)
