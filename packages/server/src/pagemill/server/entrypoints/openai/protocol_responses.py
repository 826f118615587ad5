"""The Responses API's request body (POST /v1/responses), and its translation to chat.

The server is stateless: nothing is stored, so `store: true`, `previous_response_id`,
`conversation` and `background` are refused by name (a client that relies on them would
otherwise lose its history without a sign). Built-in tools (web search, file search,
computer use, MCP, ...) run on OpenAI's side and are refused by type; function tools go
through the chat pipeline's tool calling.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import ConfigDict, Field

from pagemill.server.entrypoints.openai.errors import APIError
from pagemill.server.entrypoints.openai.limits import STRICT
from pagemill.server.entrypoints.openai.protocol import OpenAIModel


class _Model(OpenAIModel):
    model_config = STRICT


class FormatText(_Model):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(**STRICT, populate_by_name=True)


class TextConfig(_Model):
    format: FormatText | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Model):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Model):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_tool_calls: int | None = None
    prompt: dict[str, Any] | None = None
    # vLLM's extras, as on chat completions
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = None


def refuse_unsupported(req: ResponsesRequest) -> None:
    """Fields whose feature this stateless server lacks: a 400 naming each."""
    refusals = {
        "store": (
            req.store is True,
            "this server keeps no responses (stateless); send store: false or leave it out",
        ),
        "previous_response_id": (
            req.previous_response_id is not None,
            "this server keeps no responses (stateless); send the earlier turns in 'input'",
        ),
        "conversation": (
            req.conversation is not None,
            "this server keeps no conversations; send the earlier turns in 'input'",
        ),
        "background": (req.background is True, "background responses are not supported"),
        "include": (
            bool(req.include),
            "no extra output data can be included (e.g. reasoning.encrypted_content)",
        ),
        "truncation": (
            req.truncation == "auto",
            "automatic truncation is not supported; an input over the context is a 400",
        ),
        "top_logprobs": (bool(req.top_logprobs), "logprobs are not returned by /v1/responses"),
        "max_tool_calls": (req.max_tool_calls is not None, "max_tool_calls is not supported"),
        "prompt": (req.prompt is not None, "stored prompt templates are not supported"),
    }
    for name, (refused, why) in refusals.items():
        if refused:
            raise APIError(400, f"'{name}': {why}", param=name)


def _text_of(content: Any, where: str) -> str:
    """A message item's content: a string or input_text/output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of parts", param="input")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise APIError(
                400,
                f"{where}.content[{i}]: part type {kind!r} is not supported "
                "(this server takes input_text and output_text)",
                param="input",
            )
    return "".join(texts)


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """`instructions` and `input` as chat messages. Consecutive function_call items become
    one assistant turn with several tool calls, as chat templates expect. Reasoning items
    of earlier turns are not fed back (chat templates drop earlier reasoning too)."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
        return messages
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role {role!r} is not valid", param="input")
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not (isinstance(name, str) and isinstance(args, str) and isinstance(call_id, str)):
                raise APIError(
                    400,
                    f"{where}: a function_call needs string 'call_id', 'name', 'arguments'",
                    param="input",
                )
            function = {"name": name, "arguments": args}
            call = {"id": call_id, "type": "function", "function": function}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise APIError(400, f"{where}: 'call_id' must be a string", param="input")
            if not isinstance(output, str):
                output = _text_of(output, where) if isinstance(output, list) else None
            if output is None:
                raise APIError(400, f"{where}: 'output' must be a string", param="input")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue
        else:
            raise APIError(
                400,
                f"{where}: item type {kind!r} is not supported (this server takes message, "
                "function_call, function_call_output and reasoning items)",
                param="input",
            )
    if not messages:
        raise APIError(400, "'input' holds no messages", param="input")
    return messages


def chat_tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    if req.tools is None:
        return None
    out = []
    for i, tool in enumerate(req.tools):
        kind = tool.get("type")
        if kind != "function":
            raise APIError(
                400,
                f"tools[{i}]: the built-in tool {kind!r} is not available on this server "
                "(only function tools are)",
                param="tools",
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(
        400,
        f"tool_choice {json.dumps(choice)[:100]} is not supported "
        "(use none, auto, required or {'type': 'function', 'name': ...})",
        param="tool_choice",
    )


def chat_response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise APIError(400, "text.format of type json_schema needs 'schema'", param="text")
    schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": schema}


def chat_body(req: ResponsesRequest) -> dict[str, Any]:
    """The chat completions body this request stands for."""
    refuse_unsupported(req)
    body: dict[str, Any] = {
        "model": req.model,
        "messages": input_messages(req),
        "parallel_tool_calls": req.parallel_tool_calls,
    }
    optional = {
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "seed": req.seed,
        "user": req.user,
        "tools": chat_tools(req),
        "tool_choice": chat_tool_choice(req.tool_choice),
        "response_format": chat_response_format(req),
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    if isinstance(req.tool_choice, str) and req.tool_choice not in ("none", "auto", "required"):
        raise APIError(400, f"tool_choice {req.tool_choice!r} is not valid", param="tool_choice")
    if req.tools is not None and not req.tools:
        body.pop("tools")
    for tool in body.get("tools", []):
        name = tool["function"].get("name")
        if not isinstance(name, str):
            raise APIError(400, "every function tool needs a 'name'", param="tools")
    return body


def item_id(prefix: str) -> str:
    """OpenAI's id style: `resp_...`, `msg_...`, `fc_...`, `rs_...`."""
    return f"{prefix}_{uuid.uuid4().hex}"
