"""Tool calling for chat: what `tool_choice` asks, and the calls read back from the output.

"none" leaves the tools out of the prompt. "auto" puts them in and lets the model answer
freely; the server's tool parser (Hermes or Llama-3 JSON) finds calls in the text.
"required" and a named function force a call with a JSON-schema grammar over the
functions' parameters (see `pagemill.runtime.tool_calling.schema`), so the arguments
always parse and match the schema unless the output was cut by max_tokens.

`ToolStream` turns one choice's text deltas into OpenAI chat deltas: a named call streams
its arguments as they come; "required" and "auto" calls are sent whole once parsed (the
text of an "auto" answer streams until a call begins).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagemill.runtime.tool_calling import (
    ToolCall,
    ToolParser,
    calls_from_required,
    named_function_schema,
    required_schema,
)
from pagemill.server.entrypoints.openai.errors import APIError
from pagemill.server.entrypoints.openai.protocol import ChatCompletionRequest
from pagemill.server.entrypoints.openai.protocol_structured import NamedToolChoice


@dataclass
class ToolPlan:
    mode: str
    """"none", "auto", "required" or "named"."""
    tools: list[dict[str, Any]]
    name: str | None = None
    parser: ToolParser | None = None
    schema: dict[str, Any] | None = None

    @classmethod
    def from_request(cls, req: ChatCompletionRequest, parser: ToolParser) -> ToolPlan:
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        choice = req.tool_choice
        if choice is None:
            choice = "auto" if tools else "none"
        if not tools and choice != "none":
            raise APIError(400, "tool_choice needs 'tools'", param="tool_choice")
        if isinstance(choice, NamedToolChoice):
            name = choice.function.name
            try:
                schema = named_function_schema(tools, name)
            except ValueError as exc:
                raise APIError(400, str(exc), param="tool_choice") from exc
            return cls("named", tools, name=name, schema=schema)
        if choice == "required":
            return cls("required", tools, schema=required_schema(tools, req.parallel_tool_calls))
        if choice == "auto":
            return cls("auto", tools, parser=parser)
        return cls("none", tools)

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return self.tools if self.mode != "none" and self.tools else None

    def finish(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole answer."""
        if self.mode == "named":
            assert self.name is not None
            return None, [ToolCall(self.name, text)]
        if self.mode == "required":
            calls = calls_from_required(text)
            return (None, calls) if calls else (text, [])
        if self.mode == "auto":
            assert self.parser is not None
            found = self.parser.extract(text)
            return found.content, found.tool_calls
        return text, []

    def finish_reason(self, reason: str | None, calls: list[ToolCall]) -> str | None:
        # OpenAI: "tool_calls" when the model chose to call; a forced named call is "stop".
        if calls and reason == "stop" and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason


def call_delta(index: int, call: ToolCall, arguments: str | None = None) -> dict[str, Any]:
    return {
        "index": index,
        "id": call.id,
        "type": "function",
        "function": {
            "name": call.name,
            "arguments": call.arguments if arguments is None else arguments,
        },
    }


@dataclass
class ToolStream:
    """One choice's deltas under a tool plan."""

    plan: ToolPlan
    text: str = ""
    sent: int = 0  # characters of `text` already sent as content (auto) or arguments (named)
    named_call: ToolCall | None = None
    calls: list[ToolCall] = field(default_factory=list)

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self.text += delta
        mode = self.plan.mode
        if mode == "named":
            out = []
            if self.named_call is None:
                assert self.plan.name is not None
                self.named_call = ToolCall(self.plan.name, "")
                out.append({"tool_calls": [call_delta(0, self.named_call, "")]})
            if delta:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": delta}}]})
            return out
        if mode == "auto":
            assert self.plan.parser is not None
            safe = self.plan.parser.stream_safe_len(self.text)
            if safe is not None and safe > self.sent:
                piece = self.text[self.sent : safe]
                self.sent = safe
                return [{"content": piece}]
            return []
        if mode == "required":
            return []
        return [{"content": delta}] if delta else []

    def finish(self) -> list[dict[str, Any]]:
        """The deltas still owed once the choice has ended."""
        mode = self.plan.mode
        if mode == "named":
            named: list[dict[str, Any]] = self.feed("") if self.named_call is None else []
            assert self.named_call is not None
            self.named_call.arguments = self.text
            self.calls = [self.named_call]
            return named
        if mode not in ("auto", "required"):
            return []
        content, self.calls = self.plan.finish(self.text)
        out: list[dict[str, Any]] = []
        if not self.calls:
            rest = self.text[self.sent :]
            return [{"content": rest}] if rest else []
        if mode == "auto" and content:
            # Content before the call that was held back (the call's start marker is never sent).
            start = self.text.find(content)
            if start >= 0 and start + len(content) > self.sent:
                out.append({"content": content[max(0, self.sent - start) :]})
        out.append({"tool_calls": [call_delta(i, c) for i, c in enumerate(self.calls)]})
        return out
