"""Anthropic's Messages request body, and its translation to a chat completions body.

Content blocks map onto chat messages: `text` blocks are the message text; an assistant's
`tool_use` blocks are its tool calls (input as JSON arguments); a user's `tool_result`
blocks become `tool` messages, placed before that user turn's text as Anthropic requires
them first. Earlier `thinking` blocks are not fed back (chat templates drop earlier
reasoning). Images, documents and Anthropic's server tools (web search, code execution,
computer use, ...) are refused by name.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import ConfigDict, Field

from pagemill.server.entrypoints.openai.errors import APIError
from pagemill.server.entrypoints.openai.limits import STRICT
from pagemill.server.entrypoints.openai.protocol import MAX_STOP_STRINGS, OpenAIModel


class _Model(OpenAIModel):
    model_config = STRICT


class AnthropicTool(_Model):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class AnthropicToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(_Model):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)


class JSONOutputFormat(_Model):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")

    model_config = ConfigDict(**STRICT, populate_by_name=True)


class OutputConfig(_Model):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JSONOutputFormat | None = None


class CountTokensRequest(_Model):
    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    mcp_servers: list[Any] | None = None
    container: Any = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    # The engine's cap on stop strings (chat's), named here in this API's terms.
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None
    stream: bool = False
    service_tier: str | None = None
    # Structured output (format) and effort (accepted: it does not change a local model).
    output_config: OutputConfig | None = None
    # Prompt caching: the prefix cache reuses every repeated prefix without being asked.
    cache_control: dict[str, Any] | None = None


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise APIError(400, f"{where}: content must be a string or a list of blocks", param=where)
    return content


def _text(content: Any, where: str) -> str:
    """The text of a string or of text blocks (system prompts, tool results)."""
    texts = []
    for i, block in enumerate(_blocks(content, where)):
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise APIError(
                400,
                f"{where}[{i}]: block type {block.get('type')!r} is not supported here "
                "(only text blocks are)",
                param=where,
            )
        texts.append(block["text"])
    return "".join(texts)


def _unsupported(kind: Any, where: str) -> APIError:
    return APIError(
        400,
        f"{where}: content block type {kind!r} is not supported by this server "
        "(it takes text, tool_use, tool_result and thinking blocks)",
        param="messages",
    )


def chat_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if req.system is not None:
        system = _text(req.system, "system")
        if system:
            messages.append({"role": "system", "content": system})
    for i, message in enumerate(req.messages):
        where = f"messages[{i}]"
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise APIError(400, f"{where}.role must be 'user' or 'assistant'", param="messages")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(_blocks(message.get("content"), f"{where}.content")):
            at = f"{where}.content[{j}]"
            kind = block.get("type")
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise APIError(400, f"{at}: tool_use needs 'id' and 'name'", param="messages")
                arguments = json.dumps(block.get("input") or {})
                fn = {"name": block["name"], "arguments": arguments}
                calls.append({"id": block["id"], "type": "function", "function": fn})
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise APIError(400, f"{at}: tool_result needs 'tool_use_id'", param="messages")
                content = block.get("content")
                result = _text(content, f"{at}.content") if content is not None else ""
                messages.append(
                    {"role": "tool", "tool_call_id": block["tool_use_id"], "content": result}
                )
            else:
                raise _unsupported(kind, at)
        if texts or calls or not message.get("content"):
            turn: dict[str, Any] = {"role": role, "content": "".join(texts)}
            if calls:
                turn["tool_calls"] = calls
            messages.append(turn)
    return messages


def chat_tools(req: CountTokensRequest) -> tuple[list[dict[str, Any]] | None, Any, bool]:
    """(tools, tool_choice, parallel_tool_calls) in chat's spelling."""
    tools = None
    if req.tools:
        tools = []
        for i, tool in enumerate(req.tools):
            if tool.type not in (None, "custom"):
                raise APIError(
                    400,
                    f"tools[{i}]: the server tool {tool.type!r} is not available on this "
                    "server (only custom tools with an input_schema are)",
                    param="tools",
                )
            fn: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema or {}}
            if tool.description is not None:
                fn["description"] = tool.description
            tools.append({"type": "function", "function": fn})
    choice = req.tool_choice
    if choice is None:
        return tools, None, True
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        if not choice.name:
            raise APIError(400, "tool_choice of type 'tool' needs 'name'", param="tool_choice")
        return tools, {"type": "function", "function": {"name": choice.name}}, parallel
    if tools is None and choice.type == "none":
        return None, None, parallel
    return tools, {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def refuse_unsupported(req: CountTokensRequest) -> None:
    if req.mcp_servers:
        raise APIError(400, "'mcp_servers' is not supported by this server", param="mcp_servers")
    if req.container is not None:
        raise APIError(400, "'container' is not supported by this server", param="container")


def chat_body(req: CountTokensRequest) -> dict[str, Any]:
    refuse_unsupported(req)
    tools, choice, parallel = chat_tools(req)
    body: dict[str, Any] = {
        "model": req.model,
        "messages": chat_messages(req),
        "parallel_tool_calls": parallel,
    }
    if tools is not None:
        body["tools"] = tools
    if choice is not None:
        body["tool_choice"] = choice
    if isinstance(req, MessagesRequest):
        body["max_tokens"] = req.max_tokens
        optional = {
            "stop": req.stop_sequences or None,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
        }
        body.update({k: v for k, v in optional.items() if v is not None})
        fmt = req.output_config.format if req.output_config is not None else None
        if fmt is not None:
            schema = {"name": "output", "schema": fmt.schema_}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        user = (req.metadata or {}).get("user_id")
        if isinstance(user, str):
            body["user"] = user
    return body
