"""What a tool-call parser returns, and the registry of parsers by vLLM's names.

A parser reads a model's free text (tool_choice "auto") and splits it into plain content
and function calls, in the format its model family was trained on; each format lives in
its own file. Parsers are stateless: `parse` reads the whole text so far, so the same code
serves a finished answer and every step of a stream. A stream (`stream.ToolCallStreamer`)
diffs successive parses, which is why a `PartialCall`'s `arguments` must only ever grow:
it is the part of the final arguments text that later tokens cannot change.
"""

from __future__ import annotations

import json
import random
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_tool_call_id() -> str:
    """Mistral's templates accept only 9 alphanumeric characters as a call id."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


@dataclass
class ToolCall:
    name: str
    arguments: str
    """The arguments as JSON text (OpenAI's shape)."""
    id: str = field(default_factory=tool_call_id)

    @classmethod
    def make(cls, name: str, arguments: Any) -> ToolCall:
        return cls(name, arguments_json(arguments))

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def arguments_json(arguments: Any) -> str:
    """Arguments as the JSON text a client receives: one spelling for whole answers and
    streams, so a stream's concatenated argument deltas equal the whole answer's."""
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False)


@dataclass
class ExtractedToolCalls:
    tool_calls: list[ToolCall]
    content: str | None

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


@dataclass
class PartialCall:
    """One call as far as the text shows it."""

    name: str | None
    """The function name once it is complete (None before)."""
    arguments: str = ""
    """A prefix of the final arguments JSON that later text cannot change; all of it once
    `complete`."""
    complete: bool = False


@dataclass
class ParsedOutput:
    content: str
    """The plain text so far that is certainly not part of a call (a possible start marker
    at the end is held back until the next token decides)."""
    calls: list[PartialCall] = field(default_factory=list)

    def extracted(self, text: str, new_id: Callable[[], str]) -> ExtractedToolCalls:
        calls = [
            ToolCall(c.name, c.arguments, new_id())
            for c in self.calls
            if c.complete and c.name is not None
        ]
        if not calls:
            return ExtractedToolCalls([], text)
        return ExtractedToolCalls(calls, self.content.strip() or None)


Tools = Sequence[dict[str, Any]] | None


class ToolParser:
    """Base of the formats: `parse` the text so far; `extract` a finished answer."""

    name = ""
    needs_special_tokens = False
    """The format's markers are special tokens (Mistral's `[TOOL_CALLS]`, Llama's
    `<|python_tag|>`): the text must be decoded with them kept, as vLLM does."""

    def new_id(self) -> str:
        return tool_call_id()

    def parse(self, text: str, tools: Tools = None, final: bool = False) -> ParsedOutput:
        """Content and calls of `text`. With `final` the text is the whole answer: a call
        that did not finish is dropped, and a malformed one makes the whole text content."""
        raise NotImplementedError

    def extract(self, text: str, tools: Tools = None) -> ExtractedToolCalls:
        return self.parse(text, tools, final=True).extracted(text, self.new_id)


def held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def content_before(text: str, marker: str) -> tuple[str, int]:
    """(content, where the calls start: -1 if they have not) for a format whose calls begin
    at `marker` anywhere in the text."""
    start = text.find(marker)
    if start >= 0:
        return text[:start], start
    return text[: len(text) - held_back(text, marker)], -1


def leading_call_start(text: str, starts: Sequence[str]) -> int | None:
    """For a format whose answer either is calls or is not (it begins with one of `starts`):
    where the calls begin, None when the text is plain content, -1 while undecided."""
    body = text.lstrip()
    if not body:
        return -1
    for s in starts:
        if body.startswith(s):
            return len(text) - len(body)
    if any(s.startswith(body) for s in starts):
        return -1
    return None


def _registry() -> dict[str, type[ToolParser]]:
    from pagemill.runtime.tool_calling.granite import GraniteToolParser
    from pagemill.runtime.tool_calling.hermes import HermesToolParser
    from pagemill.runtime.tool_calling.llama3_json import Llama3JsonToolParser
    from pagemill.runtime.tool_calling.mistral import MistralToolParser
    from pagemill.runtime.tool_calling.phi4_mini import Phi4MiniToolParser
    from pagemill.runtime.tool_calling.pythonic import PythonicToolParser
    from pagemill.runtime.tool_calling.qwen3_xml import Qwen3XmlToolParser

    return {
        "hermes": HermesToolParser,
        "llama3_json": Llama3JsonToolParser,
        "mistral": MistralToolParser,
        "pythonic": PythonicToolParser,
        "qwen3_xml": Qwen3XmlToolParser,
        "qwen3_coder": Qwen3XmlToolParser,
        "granite": GraniteToolParser,
        "phi4_mini_json": Phi4MiniToolParser,
        "phi4_mini": Phi4MiniToolParser,
    }


TOOL_PARSER_NAMES = (
    "hermes",
    "llama3_json",
    "mistral",
    "pythonic",
    "qwen3_xml",
    "qwen3_coder",
    "granite",
    "phi4_mini_json",
    "phi4_mini",
)


def get_tool_parser(name: str) -> ToolParser:
    parsers = _registry()
    try:
        return parsers[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: {sorted(parsers)}") from None


def parser_for_template(template: str | None) -> str:
    """The parser a chat template's model family writes calls for (Hermes by default)."""
    if not template:
        return "hermes"
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_xml"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_start|>" in template:  # Llama 4
        return "pythonic"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    if "<|tool_call|>" in template:
        return "granite"
    if "functools[" in template:
        return "phi4_mini_json"
    return "hermes"
