"""IBM Granite 3.x tool calls: the reply is `<|tool_call|>` then a JSON array of
`{"name": ..., "arguments": {...}}` (older templates spell the marker `<tool_call>`; a
reply that is the bare array counts too, as in vLLM)."""

from __future__ import annotations

from pagemill.runtime.tool_calling.json_calls import finished, read_array
from pagemill.runtime.tool_calling.parser import (
    ParsedOutput,
    ToolParser,
    Tools,
    leading_call_start,
)

MARKERS = ("<|tool_call|>", "<tool_call>")


class GraniteToolParser(ToolParser):
    name = "granite"
    needs_special_tokens = True

    def parse(self, text: str, tools: Tools = None, final: bool = False) -> ParsedOutput:
        start = leading_call_start(text, (*MARKERS, "["))
        if start is None or (start < 0 and final):
            return ParsedOutput(text)
        if start < 0:
            return ParsedOutput("")
        marker = next((m for m in MARKERS if text.startswith(m, start)), "")
        body = text[start + len(marker) :]
        head = body.lstrip()
        if not head:
            return ParsedOutput("") if not final else ParsedOutput(text)
        if not head.startswith("["):
            return ParsedOutput(text)
        calls, ok = read_array(head, 0)
        kept = finished(calls, ok, final)
        if kept is None:
            return ParsedOutput(text)
        return ParsedOutput("", kept)
