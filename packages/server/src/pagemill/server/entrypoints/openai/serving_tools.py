"""Tool calling for chat: what `tool_choice` asks, and the calls read back from the output.

"none" leaves the tools out of the prompt. "auto" puts them in and lets the model answer
freely; the server's tool parser (`--tool-call-parser`, vLLM's names) finds calls in the
text. "required" and a named function force a call with a JSON-schema grammar over the
functions' parameters (see `pagemill.runtime.tool_calling.schema`), so the arguments
always parse and match the schema unless the output was cut by max_tokens; then the
complete calls of a "required" array are returned (finish_reason still "length") and the
unfinished last one is dropped.

`parallel_tool_calls: false` allows one call: "required" constrains the array to one item;
"auto" keeps the model's first call and drops the rest (the model is not constrained).

`ToolStream` turns one choice's text deltas into OpenAI chat deltas: content streams as it
comes; a call's header (id, name) is sent once its name is complete, then its arguments in
pieces as they are written, for "auto", "required" and a named function alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagemill.runtime.tool_calling import (
    RequiredCallsParser,
    ToolCall,
    ToolCallStreamer,
    ToolParser,
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
    parallel: bool = True

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
            return cls("named", tools, name=name, schema=schema, parallel=False)
        parallel = req.parallel_tool_calls
        if choice == "required":
            schema = required_schema(tools, parallel)
            return cls("required", tools, None, RequiredCallsParser(), schema, parallel)
        if choice == "auto":
            return cls("auto", tools, parser=parser, parallel=parallel)
        return cls("none", tools)

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return self.tools if self.mode != "none" and self.tools else None

    def finish(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole answer."""
        if self.mode == "named":
            assert self.name is not None
            return None, [ToolCall(self.name, text)]
        if self.mode in ("auto", "required"):
            assert self.parser is not None
            found = self.parser.extract(text, self.tools)
            calls = found.tool_calls if self.parallel else found.tool_calls[:1]
            return found.content, calls
        return text, []

    def finish_reason(self, reason: str | None, calls: list[ToolCall]) -> str | None:
        # OpenAI: "tool_calls" when the model chose to call; a forced named call is "stop".
        if calls and reason == "stop" and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason


@dataclass
class ToolStream:
    """One choice's deltas under a tool plan."""

    plan: ToolPlan
    text: str = ""
    named_call: ToolCall | None = None
    calls: list[ToolCall] = field(default_factory=list)
    streamer: ToolCallStreamer | None = None

    def __post_init__(self) -> None:
        if self.plan.mode in ("auto", "required"):
            assert self.plan.parser is not None
            self.streamer = ToolCallStreamer(
                self.plan.parser, self.plan.tools, None if self.plan.parallel else 1
            )

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self.text += delta
        if self.streamer is not None:
            return self.streamer.feed(delta)
        if self.plan.mode == "named":
            out = []
            if self.named_call is None:
                assert self.plan.name is not None
                self.named_call = ToolCall(self.plan.name, "")
                header = {"name": self.named_call.name, "arguments": delta}
                head = {"index": 0, "id": self.named_call.id, "type": "function"}
                return [{"tool_calls": [{**head, "function": header}]}]
            if delta:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": delta}}]})
            return out
        return [{"content": delta}] if delta else []

    def finish(self) -> list[dict[str, Any]]:
        """The deltas still owed once the choice has ended."""
        if self.streamer is not None:
            out = self.streamer.finish()
            self.calls = self.streamer.calls
            return out
        if self.plan.mode == "named":
            named: list[dict[str, Any]] = self.feed("") if self.named_call is None else []
            assert self.named_call is not None
            self.named_call.arguments = self.text
            self.calls = [self.named_call]
            return named
        return []


def call_delta(index: int, call: ToolCall, arguments: str | None = None) -> dict[str, Any]:
    """A whole call as one stream delta (its header and all its arguments)."""
    return {
        "index": index,
        "id": call.id,
        "type": "function",
        "function": {
            "name": call.name,
            "arguments": call.arguments if arguments is None else arguments,
        },
    }
