"""JSON schemas that force tool calls: `tool_choice` "required" and a named function.

vLLM's approach: a named function constrains the output to that function's arguments
object; "required" constrains it to a JSON array of {"name", "arguments"} objects, each
item one of the tools (`anyOf`), at least one item (exactly one without parallel calls).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pagemill.runtime.tool_calling.parser import ToolCall

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


def calls_from_required(text: str) -> list[ToolCall]:
    """The calls of an output constrained by `required_schema`.

    An output cut short (max_tokens) still holds every call it completed: the grammar
    makes the text a prefix of a JSON array of call objects, so the complete objects are
    read one by one and the unfinished last one is dropped.
    """
    try:
        items = json.loads(text)
    except ValueError:
        items = _complete_items(text)
    if not isinstance(items, list):
        return []
    return [
        ToolCall.make(i["name"], i.get("arguments", {}))
        for i in items
        if isinstance(i, dict) and isinstance(i.get("name"), str)
    ]


def _complete_items(text: str) -> list[Any]:
    """The complete elements of a JSON array that was cut short."""
    decoder = json.JSONDecoder()
    pos = text.find("[")
    if pos < 0:
        return []
    pos += 1
    items: list[Any] = []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            item, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return items
        items.append(item)
