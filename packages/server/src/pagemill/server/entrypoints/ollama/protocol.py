"""Ollama's request bodies, and their translation to chat (or, for `raw`, completions).

`options` are Ollama's sampling and runner options. Those pagemill has map onto the chat
fields (temperature, top_p, top_k, min_p, seed, stop, num_predict → max_tokens,
repeat_penalty → repetition_penalty, presence/frequency_penalty). Runner options that say
how Ollama loads a model (num_ctx, num_gpu, num_thread, use_mmap, ...) do not apply to a
server that loaded its model at start: they are ignored with one warning per name, as
Ollama ignores options it does not know. Samplers pagemill lacks (typical_p, tfs_z,
mirostat) are refused unless set to their neutral value.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from pagemill.server.entrypoints.chat_bridge import warn_once
from pagemill.server.entrypoints.openai.errors import APIError
from pagemill.server.entrypoints.openai.limits import STRICT
from pagemill.server.entrypoints.openai.protocol import OpenAIModel


class _Model(OpenAIModel):
    model_config = STRICT


class _GenerateFields(_Model):
    model: str = Field(min_length=1)
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: str | int | float | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class OllamaChatRequest(_GenerateFields):
    messages: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class OllamaGenerateRequest(_GenerateFields):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[Any] | None = None


class ShowRequest(_Model):
    model: str | None = None
    name: str | None = None  # older clients' spelling
    verbose: bool | None = None


OPTION_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
# How Ollama loads and runs a model: settled when this server started.
RUNNER_OPTIONS = {
    "numa",
    "num_ctx",
    "num_batch",
    "num_gpu",
    "main_gpu",
    "low_vram",
    "f16_kv",
    "logits_all",
    "vocab_only",
    "use_mmap",
    "use_mlock",
    "embedding_only",
    "num_thread",
    "num_keep",
    "penalize_newline",
}
# Samplers pagemill does not have, with the value that leaves the output unchanged.
NEUTRAL_ONLY = {"typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0}
_warned: set[str] = set()


def sampling_fields(options: dict[str, Any] | None) -> dict[str, Any]:
    """Chat fields from Ollama's `options` (errors: APIError 400 naming the option)."""
    out: dict[str, Any] = {}
    options = dict(options or {})
    mirostat_off = options.get("mirostat") in (None, 0)
    for name, value in options.items():
        if value is None:
            continue
        if name in OPTION_FIELDS:
            if name == "seed" and value == -1:  # Ollama's "random seed"
                continue
            out[OPTION_FIELDS[name]] = value
        elif name == "num_predict":
            if isinstance(value, bool) or not isinstance(value, int) or value == 0:
                raise APIError(400, "options.num_predict must be a positive integer, -1 or -2")
            if value > 0:
                out["max_tokens"] = value  # -1 (no limit) and -2 (fill the context): none
        elif name in NEUTRAL_ONLY:
            if value != NEUTRAL_ONLY[name]:
                raise APIError(
                    400,
                    f"options.{name} is not supported by this server (only the neutral "
                    f"value {NEUTRAL_ONLY[name]})",
                )
        elif name in ("mirostat_tau", "mirostat_eta") and mirostat_off:
            continue  # only read by mirostat, which is off (Ollama ignores them too)
        elif name == "repeat_last_n":
            penalised = options.get("repeat_penalty") not in (None, 1.0)
            if penalised and value != -1:
                raise APIError(
                    400,
                    "options.repeat_last_n: this server's repeat_penalty covers the whole "
                    "context; send repeat_last_n -1 (or leave it out)",
                )
        elif name in RUNNER_OPTIONS:
            warn_once(_warned, "ollama options", name, "the server loaded its model at start")
        else:
            warn_once(_warned, "ollama options", name, "not an option this server knows")
    if isinstance(out.get("stop"), list) and not out["stop"]:
        out.pop("stop")
    return out


def response_format(fmt: str | dict[str, Any] | None) -> dict[str, Any] | None:
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "response", "schema": fmt}}
    raise APIError(400, f"format must be 'json' or a JSON schema, got {fmt!r}")


def think_flag(think: bool | str | None) -> bool | None:
    """Ollama's `think`: a bool, or a level ("low"/"medium"/"high") meaning on."""
    if think is None or isinstance(think, bool):
        return think
    if think in ("low", "medium", "high"):
        return True
    raise APIError(400, f"think must be true, false, 'low', 'medium' or 'high', got {think!r}")


def refuse_common(req: _GenerateFields) -> None:
    if req.logprobs or req.top_logprobs:
        raise APIError(400, "logprobs are not returned by this server's Ollama API")


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ollama messages as chat messages. Ollama links a tool result to its call by name
    (`tool_name`); chat templates want the call's id, so the result takes the id of the
    latest call of that name."""
    out: list[dict[str, Any]] = []
    call_ids: dict[str, str] = {}
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise APIError(400, f"{where}.role {role!r} is not valid")
        if m.get("images"):
            raise APIError(400, f"{where}.images: this server serves text-only models")
        content = m.get("content") or ""
        if not isinstance(content, str):
            raise APIError(400, f"{where}.content must be a string")
        msg: dict[str, Any] = {"role": role, "content": content}
        calls = []
        if not isinstance(m.get("tool_calls") or [], list):
            raise APIError(400, f"{where}.tool_calls must be a list")
        for j, call in enumerate(m.get("tool_calls") or []):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise APIError(400, f"{where}.tool_calls[{j}] needs function.name")
            args = fn.get("arguments") or {}
            call_id = call.get("id") or f"call_{i}_{j}"
            call_ids[fn["name"]] = call_id
            arguments = args if isinstance(args, str) else json.dumps(args)
            function = {"name": fn["name"], "arguments": arguments}
            calls.append({"id": call_id, "type": "function", "function": function})
        if calls:
            msg["tool_calls"] = calls
        if role == "tool":
            name = m.get("tool_name") or m.get("name")
            msg["tool_call_id"] = m.get("tool_call_id") or call_ids.get(name or "", f"call_{i}")
            if name:
                msg["name"] = name
        out.append(msg)
    return out
