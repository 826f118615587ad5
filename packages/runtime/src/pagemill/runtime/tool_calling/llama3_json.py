"""Llama 3.x JSON tool calls: the whole reply is `{"name": ..., "parameters": {...}}`,
optionally after `<|python_tag|>`, several calls separated by `;`. A reply that does not
begin that way is plain content."""

from __future__ import annotations

from pagemill.runtime.tool_calling.json_calls import finished, read_objects
from pagemill.runtime.tool_calling.parser import (
    ParsedOutput,
    ToolParser,
    Tools,
    leading_call_start,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    needs_special_tokens = True

    def parse(self, text: str, tools: Tools = None, final: bool = False) -> ParsedOutput:
        start = leading_call_start(text, (PYTHON_TAG, "{"))
        if start is None or (start < 0 and final):
            return ParsedOutput(text)
        if start < 0:
            return ParsedOutput("")
        pos = start + len(PYTHON_TAG) if text.startswith(PYTHON_TAG, start) else start
        calls, ok, stop = read_objects(text, pos)
        kept = finished(calls, ok and stop == len(text), final)
        if kept is None or (final and not kept):
            return ParsedOutput(text)
        return ParsedOutput("", kept)
