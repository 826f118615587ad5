"""What a tool-call parser returns, and the registry of parsers by name.

A parser reads a model's free text (tool_choice "auto") and splits it into plain content
and function calls, in the format its model family was trained on. Each format lives in
its own file (`hermes.py`, `llama3_json.py`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str
    """The arguments as JSON text (OpenAI's shape)."""
    id: str = field(default_factory=tool_call_id)

    @classmethod
    def make(cls, name: str, arguments: Any) -> ToolCall:
        text = (
            arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        )
        return cls(name, text)

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ExtractedToolCalls:
    tool_calls: list[ToolCall]
    content: str | None

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


class ToolParser:
    """Base: `extract` for a whole output, `stream_safe_len` for what may stream as text."""

    name = ""

    def extract(self, text: str) -> ExtractedToolCalls:
        raise NotImplementedError

    def stream_safe_len(self, text: str) -> int | None:
        """How much of `text` is certainly plain content; None once a tool call has begun."""
        raise NotImplementedError


def held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def get_tool_parser(name: str) -> ToolParser:
    from pagemill.runtime.tool_calling.hermes import HermesToolParser
    from pagemill.runtime.tool_calling.llama3_json import Llama3JsonToolParser

    parsers: dict[str, type[ToolParser]] = {
        "hermes": HermesToolParser,
        "llama3_json": Llama3JsonToolParser,
    }
    try:
        return parsers[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: {sorted(parsers)}") from None


def parser_for_template(template: str | None) -> str:
    """The parser a chat template's model family writes calls for: Llama 3 or Hermes."""
    if template and ("<|python_tag|>" in template or "ipython" in template):
        return "llama3_json"
    return "hermes"
