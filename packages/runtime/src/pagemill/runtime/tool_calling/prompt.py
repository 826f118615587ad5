"""Conversations with tools through a chat template, whether or not it knows tools.

A template that handles tools itself (Qwen, Llama 3.1, Hermes: it reads `tools` and the
messages' `tool_calls`) gets them as transformers passes them, tool-call arguments as
objects (what those templates `tojson`). A template that does not (SmolLM2's GGUF ships one
that only concatenates role and content) gets the conversation rewritten in the Hermes
format the Hermes parser reads back: the tool definitions in the system prompt, past calls
as `<tool_call>` blocks in the assistant's content, and results as `<tool_response>`
blocks in a user turn.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

HERMES_SYSTEM = (
    "You are a function calling AI model. You may call one or more functions to assist "
    "with the user query. Don't make assumptions about what values to plug into functions. "
    "Here are the available tools: <tools>\n{tools}\n</tools>\n"
    "For each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template and "tool_calls" in template  # type: ignore[operator]


def content_text(content: Any) -> str:
    """A message's content as text: a string, None, or OpenAI's list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)


def _arguments(raw: Any) -> Any:
    """Tool-call arguments as an object (templates `tojson` them); text left as is if not JSON."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def _calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        calls.append({"name": fn.get("name"), "arguments": _arguments(fn.get("arguments", {}))})
    return calls


def hermes_messages(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The conversation in the Hermes format, as plain role/content messages."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        text = content_text(m.get("content"))
        if role == "assistant" and m.get("tool_calls"):
            blocks = [
                f"<tool_call>\n{json.dumps(c, ensure_ascii=False)}\n</tool_call>" for c in _calls(m)
            ]
            text = "\n".join(([text] if text else []) + blocks)
            out.append({"role": "assistant", "content": text})
        elif role == "tool":
            block = f"<tool_response>\n{text}\n</tool_response>"
            last = out[-1] if out else None
            if last is not None and last.get("_tool_results"):
                last["content"] += "\n" + block  # consecutive results share one turn
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append({"role": "system" if role == "developer" else role, "content": text})
    for m in out:
        m.pop("_tool_results", None)
    if tools:
        system = HERMES_SYSTEM.format(
            tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        )
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{system}" if out[0]["content"] else system
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def render_chat(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: Sequence[dict[str, Any]] | None = None,
    chat_template: str | None = None,
) -> str:
    """The prompt text of a conversation (with tools, tool calls and tool results), through
    `chat_template` (a Jinja template) where given, else the tokenizer's own."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    messages = list(messages)
    uses_tools = bool(tools) or any(
        m.get("tool_calls") or m.get("role") == "tool" for m in messages
    )
    if not uses_tools:
        plain = [{**m, "content": content_text(m.get("content"))} for m in messages]
        return tokenizer.apply_chat_template(
            plain,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            chat_template=chat_template,
        )
    if template_knows_tools(template):
        native = []
        for m in messages:
            m = {**m, "content": content_text(m.get("content"))}
            if m.get("tool_calls"):
                m["tool_calls"] = [
                    {
                        **c,
                        "function": {
                            **c["function"],
                            "arguments": _arguments(c["function"].get("arguments")),
                        },
                    }
                    for c in m["tool_calls"]
                ]
            native.append(m)
        return tokenizer.apply_chat_template(
            native,
            tools=list(tools or []) or None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            chat_template=chat_template,
        )
    return tokenizer.apply_chat_template(
        hermes_messages(messages, tools),
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        chat_template=chat_template,
    )
