"""POST /v1/responses: OpenAI's Responses API over the chat pipeline (stateless).

The request becomes a chat completions request (protocol_responses.chat_body) and runs
through `ChatServing`; its message becomes output items — a `reasoning` item (when the
server has a --reasoning-parser), a `message` with one `output_text` part, and one
`function_call` item per tool call. A stream turns chat's deltas into the Responses
events in OpenAI's order: response.created, response.in_progress, then per item
output_item.added, content_part.added, the deltas, their .done events, content_part.done,
output_item.done, and last response.completed (response.incomplete when the answer was
cut by max_output_tokens), each with a `sequence_number`.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from pagemill.server.entrypoints.chat_bridge import (
    ClosingStream,
    cached_tokens,
    chat_chunks,
    chat_request,
    complete,
    guard,
    json_response,
    read_body,
    stream_error,
)
from pagemill.server.entrypoints.openai.errors import APIError, error_response
from pagemill.server.entrypoints.openai.protocol_responses import (
    ResponsesRequest,
    chat_body,
    item_id,
)
from pagemill.server.entrypoints.openai.serving_chat import ChatServing


class Events:
    """Numbers the events of one stream and writes them as SSE with their `event:` name."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"


class OutputItems:
    """Builds the output items from pieces of the answer, in order, and the events that
    announce them. A piece of another kind (reasoning, text, a new call) closes the item
    being written, so items never interleave."""

    def __init__(self, emit: Events | None = None) -> None:
        self.emit = emit
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.text = ""  # the open item's text (reasoning, output text or arguments)

    def _event(self, kind: str, **fields: Any) -> list[str]:
        return [self.emit(kind, **fields)] if self.emit is not None else []

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _start(self, item: dict[str, Any], part: dict[str, Any] | None) -> list[str]:
        self.items.append(item)
        self.open = item
        self.text = ""
        out = self._event("response.output_item.added", output_index=len(self.items) - 1, item=item)
        if part is not None:
            out += self._event(
                "response.content_part.added", **self._where(), content_index=0, part=part
            )
        return out

    def reasoning(self, delta: str) -> list[str]:
        out: list[str] = []
        if self.open is None or self.open["type"] != "reasoning":
            out += self.close()
            item = {"id": item_id("rs"), "type": "reasoning", "summary": [], "content": []}
            item["status"] = "in_progress"
            out += self._start(item, {"type": "reasoning_text", "text": ""})
        self.text += delta
        return out + self._event(
            "response.reasoning_text.delta", **self._where(), content_index=0, delta=delta
        )

    def output_text(self, delta: str) -> list[str]:
        out: list[str] = []
        if self.open is None or self.open["type"] != "message":
            out += self.close()
            item = {
                "id": item_id("msg"),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            out += self._start(item, _text_part(""))
        self.text += delta
        if not delta:
            return out
        return out + self._event(
            "response.output_text.delta", **self._where(), content_index=0, delta=delta, logprobs=[]
        )

    def call(self, call_id: str, name: str, arguments: str = "") -> list[str]:
        out = self.close()
        item = {
            "id": item_id("fc"),
            "type": "function_call",
            "call_id": call_id,
            "name": name,
            "arguments": "",
            "status": "in_progress",
        }
        out += self._start(item, None)
        return out + (self.arguments(arguments) if arguments else [])

    def arguments(self, delta: str) -> list[str]:
        if self.open is None or self.open["type"] != "function_call":
            return []  # chat sends arguments only after their call's header
        self.text += delta
        return self._event("response.function_call_arguments.delta", **self._where(), delta=delta)

    def close(self, status: str = "completed") -> list[str]:
        """Finish the open item: its .done events, then output_item.done."""
        item, text = self.open, self.text
        if item is None:
            return []
        out: list[str] = []
        where = self._where()
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            out += self._event("response.reasoning_text.done", **where, content_index=0, text=text)
            out += self._event("response.content_part.done", **where, content_index=0, part=part)
            item["content"] = [part]
        elif item["type"] == "message":
            part = _text_part(text)
            out += self._event(
                "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
            )
            out += self._event("response.content_part.done", **where, content_index=0, part=part)
            item["content"] = [part]
        else:
            item["arguments"] = text
            out += self._event(
                "response.function_call_arguments.done",
                **where,
                name=item["name"],
                arguments=text,
            )
        item["status"] = status
        index = where["output_index"]
        out += self._event("response.output_item.done", output_index=index, item=item)
        self.open = None
        return out


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponsesServing:
    def __init__(self, chat: ChatServing) -> None:
        self.chat = chat

    def response(
        self,
        req: ResponsesRequest,
        rid: str,
        created: float,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None,
    ) -> dict[str, Any]:
        fmt = req.text.format if req.text is not None else None
        shown = fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}
        text = {"format": shown}
        return {
            "id": rid,
            "object": "response",
            "created_at": created,
            "status": status,
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.chat.served_model_name,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": req.reasoning.model_dump() if req.reasoning is not None else None,
            "store": False,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "text": text,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [],
            "truncation": "disabled",
            "background": False,
            "metadata": req.metadata or {},
            "user": req.user,
            "usage": usage,
        }

    async def usage(self, chat_usage: dict[str, Any], reasoning: str) -> dict[str, Any]:
        n_in = int(chat_usage.get("prompt_tokens", 0))
        n_out = int(chat_usage.get("completion_tokens", 0))
        # The reasoning re-encoded: the model's own tokens are not split by part.
        n_reasoning = 0
        if reasoning and self.chat.tokenizer is not None:
            n_reasoning = len(
                await self.chat.off_loop(
                    lambda: self.chat.tokenizer.encode(reasoning, add_special_tokens=False)
                )
            )
        return {
            "input_tokens": n_in,
            "input_tokens_details": {"cached_tokens": cached_tokens(chat_usage)},
            "output_tokens": n_out,
            "output_tokens_details": {"reasoning_tokens": min(n_reasoning, n_out)},
            "total_tokens": n_in + n_out,
        }

    async def create(self, req: ResponsesRequest, raw_request: Request) -> Response:
        created = time.time()
        chat_req = chat_request(chat_body(req))
        rid = item_id("resp")
        if req.stream:
            chunks = await chat_chunks(self.chat, chat_req, raw_request)
            from pagemill.server.entrypoints.openai.api_server import SSEResponse

            return SSEResponse(ClosingStream(self._stream(req, rid, created, chunks), chunks))
        result = await complete(self.chat, chat_req, raw_request)
        choice = result.choices[0]
        message = choice.message
        items = OutputItems()
        if message.reasoning_content:
            items.reasoning(message.reasoning_content)
        if message.content or not message.tool_calls:
            items.output_text(message.content or "")
        for call in message.tool_calls:
            items.call(call.id or item_id("call"), call.function.name, call.function.arguments)
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        items.close(status)
        usage = await self.usage(result.usage.model_dump(), message.reasoning_content or "")
        return json_response(self.response(req, rid, created, status, items.items, usage))

    async def _stream(
        self,
        req: ResponsesRequest,
        rid: str,
        created: float,
        chunks: ClosingStream[dict[str, Any]],
    ) -> AsyncIterator[str]:
        emit = Events()
        items = OutputItems(emit)
        started = self.response(req, rid, created, "in_progress", [], None)
        yield emit("response.created", response=started)
        yield emit("response.in_progress", response=started)
        finish: str | None = None
        chat_usage: dict[str, Any] = {}
        reasoning = ""
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    if chunk.get("usage"):
                        chat_usage = chunk["usage"]
                    for choice in chunk.get("choices", []):
                        delta = choice.get("delta") or {}
                        if delta.get("reasoning_content"):
                            reasoning += delta["reasoning_content"]
                            for event in items.reasoning(delta["reasoning_content"]):
                                yield event
                        if delta.get("content"):
                            for event in items.output_text(delta["content"]):
                                yield event
                        for tc in delta.get("tool_calls") or []:
                            fn = tc.get("function") or {}
                            if tc.get("id"):
                                events = items.call(tc["id"], fn["name"], fn.get("arguments", ""))
                            else:
                                events = items.arguments(fn.get("arguments", ""))
                            for event in events:
                                yield event
                        finish = choice.get("finish_reason") or finish
        except Exception as exc:  # the engine or the server failed: say so, then end
            status_code, message, code = stream_error(exc)
            yield emit("error", code=str(code or status_code), message=message, param=None)
            return
        status = "incomplete" if finish == "length" else "completed"
        # As in a whole answer: a message, even an empty one, unless the model called.
        if not any(i["type"] != "reasoning" for i in items.items):
            for event in items.output_text(""):
                yield event
        for event in items.close(status):
            yield event
        usage = await self.usage(chat_usage, reasoning)
        final = self.response(req, rid, created, status, items.items, usage)
        yield emit(f"response.{status}", response=final)


def _openai_error(exc: APIError) -> Response:
    return error_response(
        exc.status_code, exc.message, param=exc.param, code=exc.code, headers=exc.headers
    )


def install_responses(app: FastAPI, chat: ChatServing) -> None:
    """POST /v1/responses (behind the API key like all of /v1)."""
    serving = ResponsesServing(chat)

    @app.post("/v1/responses")
    async def create_response(raw_request: Request) -> Response:
        async def work() -> Response:
            req = await read_body(raw_request, ResponsesRequest)
            return await serving.create(req, raw_request)

        return await guard(work, _openai_error)
