"""Ollama's native API: /api/chat, /api/generate, /api/tags, /api/show, /api/ps,
/api/version.

/api/chat and /api/generate run through the chat pipeline (a `raw` generate through
completions: the prompt goes to the model untemplated) and answer in Ollama's shape,
streamed as NDJSON unless `stream` is false. Ollama sends a tool call whole, once its
arguments are complete, so calls are gathered from chat's incremental deltas first.
Durations are in nanoseconds, measured here: prompt_eval_duration runs from the request's
arrival to the first generated text (queueing included), eval_duration from there to the
end; load_duration is 0 (the model is loaded when the server starts). A request with no
messages (or no prompt) is Ollama's "load the model" call and answers done_reason "load"
("unload" with keep_alive 0; the model stays loaded, it is the only one).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagemill.server.entrypoints.chat_bridge import (
    ClosingStream,
    arguments_object,
    chat_chunks,
    chat_request,
    guard,
    read_body,
    stream_error,
    thinking_fields,
    until_disconnect,
)
from pagemill.server.entrypoints.ollama.protocol import (
    OllamaChatRequest,
    OllamaGenerateRequest,
    ShowRequest,
    chat_messages,
    refuse_common,
    response_format,
    sampling_fields,
    think_flag,
)
from pagemill.server.entrypoints.openai.errors import APIError
from pagemill.server.entrypoints.openai.protocol import CompletionRequest
from pagemill.server.entrypoints.openai.serving_chat import ChatServing
from pagemill.server.entrypoints.openai.serving_completion import CompletionServing

# The Ollama release whose API these endpoints follow (clients check it for features).
OLLAMA_API_VERSION = "0.12.0"


def ollama_error(exc: APIError) -> Response:
    return JSONResponse({"error": exc.message}, status_code=exc.status_code, headers=exc.headers)


def created_at() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


class OllamaServing:
    def __init__(self, chat: ChatServing, completions: CompletionServing) -> None:
        self.chat = chat
        self.completions = completions

    # ------------------------------------------------------------ models

    def resolve(self, name: str | None) -> str:
        """The served name a request means; Ollama clients add a ":latest" tag."""
        names = self.chat.served_model_names
        if name in names:
            return name
        if name is not None and name.endswith(":latest") and name[: -len(":latest")] in names:
            return name[: -len(":latest")]
        raise APIError(404, f"model '{name}' not found (this server serves {', '.join(names)})")

    def _path(self) -> Path | None:
        assets = getattr(self.chat.client, "assets", None)
        path = getattr(assets, "path", None)
        return Path(path) if path is not None else None

    def details(self) -> dict[str, Any]:
        model_config = getattr(self.chat.client, "model_config", None)
        family = str(getattr(model_config, "model_type", "") or "")
        path = self._path()
        gguf = path is not None and path.suffix == ".gguf"
        return {
            "parent_model": "",
            "format": "gguf" if gguf else "safetensors",
            "family": family,
            "families": [family] if family else None,
            "parameter_size": "",
            "quantization_level": "",
        }

    def model_entry(self, name: str) -> dict[str, Any]:
        path = self._path()
        size = 0
        modified = datetime.now(UTC)
        if path is not None and path.exists():
            files = [path] if path.is_file() else list(path.iterdir())
            size = sum(
                f.stat().st_size
                for f in files
                if f.is_file() and f.suffix in (".safetensors", ".gguf", ".bin", ".pt")
            )
            modified = datetime.fromtimestamp(path.stat().st_mtime, UTC)
        # An identifier of the served model (name and location), not a hash of the weights.
        digest = hashlib.sha256(f"{name}\0{path}".encode()).hexdigest()
        return {
            "name": name,
            "model": name,
            "modified_at": modified.isoformat().replace("+00:00", "Z"),
            "size": size,
            "digest": digest,
            "details": self.details(),
        }

    def tags(self) -> dict[str, Any]:
        return {"models": [self.model_entry(n) for n in self.chat.served_model_names]}

    def ps(self) -> dict[str, Any]:
        models = []
        forever = (datetime.now(UTC) + timedelta(days=3650)).isoformat().replace("+00:00", "Z")
        for name in self.chat.served_model_names:
            entry = self.model_entry(name)
            gpu = str(getattr(self.chat.client.config, "device", "") or "").startswith("cuda")
            entry.update(
                expires_at=forever,
                size_vram=entry["size"] if gpu else 0,
                context_length=self.chat.max_model_len,
            )
            models.append(entry)
        return {"models": models}

    def show(self, req: ShowRequest) -> dict[str, Any]:
        name = self.resolve(req.model or req.name)
        template = getattr(self.chat.tokenizer, "chat_template", None)
        family = self.details()["family"] or "llama"
        capabilities = ["completion", "tools"]
        if self.chat.reasoning_parser is not None:
            capabilities.append("thinking")
        entry = self.model_entry(name)
        return {
            "modelfile": "",
            "parameters": "",
            "template": template if isinstance(template, str) else "",
            "details": entry["details"],
            "model_info": {
                "general.architecture": family,
                f"{family}.context_length": self.chat.max_model_len,
            },
            "capabilities": capabilities,
            "modified_at": entry["modified_at"],
        }

    # ------------------------------------------------------------ generation

    def _chat_fields(self, req: OllamaChatRequest | OllamaGenerateRequest) -> dict[str, Any]:
        refuse_common(req)
        body: dict[str, Any] = {"model": self.resolve(req.model)}
        body.update(sampling_fields(req.options))
        fmt = response_format(req.format)
        if fmt is not None:
            body["response_format"] = fmt
        return body

    def _loaded(self, model: str, keep_alive: Any, key: str) -> Response:
        unload = keep_alive in (0, "0", "0s", "0m")
        reply: dict[str, Any] = {"model": model, "created_at": created_at()}
        reply[key] = {"role": "assistant", "content": ""} if key == "message" else ""
        reply.update(done=True, done_reason="unload" if unload else "load")
        return JSONResponse(reply)

    async def chat_api(self, req: OllamaChatRequest, raw_request: Request) -> Response:
        arrival = time.monotonic_ns()
        body = self._chat_fields(req)
        if not req.messages:
            return self._loaded(req.model, req.keep_alive, "message")
        think = think_flag(req.think)
        body.update(thinking_fields(self.chat, think, "think"))
        body["messages"] = chat_messages(req.messages)
        if req.tools:
            body["tools"] = req.tools
        chunks = await chat_chunks(self.chat, chat_request(body), raw_request)
        return await self._answer(req, "message", think, chunks, arrival, raw_request)

    async def generate_api(self, req: OllamaGenerateRequest, raw_request: Request) -> Response:
        arrival = time.monotonic_ns()
        refusals = {
            "template": req.template is not None,
            "suffix": bool(req.suffix),
            "context": bool(req.context),
            "images": bool(req.images),
        }
        for name, refused in refusals.items():
            if refused:
                raise APIError(400, f"'{name}' is not supported by this server")
        body = self._chat_fields(req)
        if not req.prompt:
            return self._loaded(req.model, req.keep_alive, "response")
        think = think_flag(req.think)
        if req.raw:
            if think:
                raise APIError(400, "'think' cannot be used with 'raw' (no template)")
            if req.system:
                raise APIError(400, "'system' cannot be used with 'raw' (no template)")
            body["prompt"] = req.prompt
            if "max_tokens" not in body:
                body["max_tokens"] = None  # completions' default is 16; Ollama's is no cap
            try:
                completion = CompletionRequest.model_validate(body)
            except Exception as exc:
                raise APIError(400, str(exc)) from exc
            chunks = await chat_chunks(self.completions, completion, raw_request)
        else:
            body.update(thinking_fields(self.chat, think, "think"))
            messages = [{"role": "user", "content": req.prompt}]
            if req.system:
                messages.insert(0, {"role": "system", "content": req.system})
            body["messages"] = messages
            chunks = await chat_chunks(self.chat, chat_request(body), raw_request)
        return await self._answer(req, "response", think, chunks, arrival, raw_request)

    async def _answer(
        self,
        req: OllamaChatRequest | OllamaGenerateRequest,
        key: str,
        think: bool | None,
        chunks: ClosingStream[dict[str, Any]],
        arrival: int,
        raw_request: Request,
    ) -> Response:
        parts = ClosingStream(self._parts(req.model, key, think, chunks, arrival), chunks)
        if req.stream:
            from pagemill.server.entrypoints.openai.api_server import SSEResponse

            lines = ClosingStream(_ndjson(parts), parts)
            response = SSEResponse(lines)
            response.headers["content-type"] = "application/x-ndjson"
            return response
        merged = await until_disconnect(raw_request, _merge(parts, key))
        return JSONResponse(merged)

    async def _parts(
        self,
        model: str,
        key: str,
        think: bool | None,
        chunks: ClosingStream[dict[str, Any]],
        arrival: int,
    ) -> AsyncIterator[dict[str, Any]]:
        """Ollama's stream objects for one answer; the last has done: true and the counts."""
        first: int | None = None
        finish: str | None = None
        usage: dict[str, Any] = {}
        pending: dict[str, Any] | None = None  # the tool call being written

        def piece(content: str = "", thinking: str = "", calls: Any = None) -> dict[str, Any]:
            out: dict[str, Any] = {"model": model, "created_at": created_at()}
            if key == "message":
                message: dict[str, Any] = {"role": "assistant", "content": content}
                if thinking:
                    message["thinking"] = thinking
                if calls:
                    message["tool_calls"] = calls
                out["message"] = message
            else:
                out["response"] = content
                if thinking:
                    out["thinking"] = thinking
            out["done"] = False
            return out

        def finished_call() -> list[dict[str, Any]]:
            if pending is None:
                return []
            fn = {"name": pending["name"], "arguments": arguments_object(pending["arguments"])}
            return [{"function": fn}]

        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta") or {}
                    content = delta.get("content") or choice.get("text") or ""
                    thinking = delta.get("reasoning_content") or ""
                    if think is False:
                        thinking = ""
                    calls: list[dict[str, Any]] = []
                    for tc in delta.get("tool_calls") or []:
                        fn = tc.get("function") or {}
                        if tc.get("id"):
                            calls += finished_call()
                            pending = {"name": fn.get("name"), "arguments": ""}
                        if pending is not None:
                            pending["arguments"] += fn.get("arguments") or ""
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
                        calls += finished_call()
                        pending = None
                    if content or thinking or calls:
                        if first is None:
                            first = time.monotonic_ns()
                        yield piece(content, thinking, calls)
        end = time.monotonic_ns()
        first = first if first is not None else end
        last = piece()
        last.update(
            done=True,
            done_reason="length" if finish == "length" else "stop",
            total_duration=end - arrival,
            load_duration=0,
            prompt_eval_count=int(usage.get("prompt_tokens", 0)),
            prompt_eval_duration=first - arrival,
            eval_count=int(usage.get("completion_tokens", 0)),
            eval_duration=end - first,
        )
        yield last


async def _ndjson(parts: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    try:
        async for part in parts:
            yield json.dumps(part) + "\n"
    except Exception as exc:  # the engine or the server failed: say so, then end
        _, message, _ = stream_error(exc)
        yield json.dumps({"error": message}) + "\n"


async def _merge(parts: ClosingStream[dict[str, Any]], key: str) -> dict[str, Any]:
    """A whole answer out of the stream objects (stream: false)."""
    content: list[str] = []
    thinking: list[str] = []
    calls: list[Any] = []
    last: dict[str, Any] = {}
    async with contextlib.aclosing(parts):
        async for part in parts:
            last = part
            body = part[key] if key == "message" else part
            text = body["content"] if key == "message" else body["response"]
            content.append(text)
            thinking.append(body.get("thinking", ""))
            calls += body.get("tool_calls", []) if key == "message" else []
    merged = dict(last)
    if key == "message":
        message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
        if any(thinking):
            message["thinking"] = "".join(thinking)
        if calls:
            message["tool_calls"] = calls
        merged["message"] = message
    else:
        merged["response"] = "".join(content)
        if any(thinking):
            merged["thinking"] = "".join(thinking)
    return merged


def install_ollama(app: FastAPI, chat: ChatServing, completions: CompletionServing) -> None:
    """Ollama's /api/* routes (behind the API key when the server has one)."""
    serving = OllamaServing(chat, completions)

    @app.post("/api/chat")
    async def ollama_chat(raw_request: Request) -> Response:
        async def work() -> Response:
            req = await read_body(raw_request, OllamaChatRequest)
            return await serving.chat_api(req, raw_request)

        return await guard(work, ollama_error)

    @app.post("/api/generate")
    async def ollama_generate(raw_request: Request) -> Response:
        async def work() -> Response:
            req = await read_body(raw_request, OllamaGenerateRequest)
            return await serving.generate_api(req, raw_request)

        return await guard(work, ollama_error)

    @app.post("/api/show")
    async def ollama_show(raw_request: Request) -> Response:
        async def work() -> Response:
            req = await read_body(raw_request, ShowRequest)
            return JSONResponse(serving.show(req))

        return await guard(work, ollama_error)

    @app.get("/api/tags")
    async def ollama_tags() -> Response:
        return JSONResponse(serving.tags())

    @app.get("/api/ps")
    async def ollama_ps() -> Response:
        return JSONResponse(serving.ps())

    @app.get("/api/version")
    async def ollama_version() -> Response:
        return JSONResponse({"version": OLLAMA_API_VERSION})
