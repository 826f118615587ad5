"""JSON schemas that force tool calls: `tool_choice` "required" and a named function.

vLLM's approach: a named function constrains the output to that function's arguments
object; "required" constrains it to a JSON array of {"name", "arguments"} objects, each
item one of the tools (`anyOf`), at least one item (exactly one without parallel calls).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagemill.runtime.tool_calling.json_calls import finished, read_array
from pagemill.runtime.tool_calling.parser import ParsedOutput, ToolCall, ToolParser, Tools

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def function_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool.get("function", tool).get("parameters")
    return params if params else ANY_OBJECT


def named_function_schema(tools: Sequence[dict[str, Any]], name: str) -> dict[str, Any]:
    """The arguments schema of the function called `name`; ValueError if there is none."""
    for tool in tools:
        if tool.get("function", tool).get("name") == name:
            return function_parameters(tool)
    known = [t.get("function", t).get("name") for t in tools]
    raise ValueError(f"tool_choice names function {name!r}, which is not among the tools {known}")


def required_schema(tools: Sequence[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.get("function", t)["name"]]},
                "arguments": function_parameters(t),
            },
            "required": ["name", "arguments"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": items[0] if len(items) == 1 else {"anyOf": items},
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


class RequiredCallsParser(ToolParser):
    """The output `required_schema` forces: a JSON array of call objects. An output cut
    short (max_tokens) still holds every call it completed; the unfinished last one is
    dropped from a whole answer (a stream has shown what there was of it)."""

    name = "required"

    def parse(self, text: str, tools: Tools = None, final: bool = False) -> ParsedOutput:
        start = text.find("[")
        if start < 0:
            return ParsedOutput(text if final else "")
        calls, ok = read_array(text, start)
        kept = finished(calls, ok, final)
        if kept is None or (final and not kept):
            return ParsedOutput(text)
        return ParsedOutput("", kept)


def calls_from_required(text: str) -> list[ToolCall]:
    """The complete calls of an output constrained by `required_schema`."""
    return RequiredCallsParser().extract(text).tool_calls
