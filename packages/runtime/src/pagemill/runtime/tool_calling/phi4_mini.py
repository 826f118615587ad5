"""Phi-4-mini tool calls: `functools[{"name": ..., "arguments": {...}}, ...]`, after any
plain text."""

from __future__ import annotations

from pagemill.runtime.tool_calling.json_calls import finished, read_array
from pagemill.runtime.tool_calling.parser import ParsedOutput, ToolParser, Tools, content_before

MARKER = "functools"


class Phi4MiniToolParser(ToolParser):
    name = "phi4_mini_json"

    def parse(self, text: str, tools: Tools = None, final: bool = False) -> ParsedOutput:
        content, start = content_before(text, MARKER + "[")
        if start < 0:
            return ParsedOutput(content)
        calls, ok = read_array(text, start + len(MARKER))
        kept = finished(calls, ok, final)
        if kept is None:
            return ParsedOutput(text)
        return ParsedOutput(content, kept)
