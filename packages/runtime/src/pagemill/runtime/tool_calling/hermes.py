"""Hermes tool calls (NousResearch Hermes, Qwen 2.5/3, SmolLM2 prompted in that format):
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call, after
any plain text. A block left open at the end (the output stopped where the call ended)
still counts when its object is complete."""

from __future__ import annotations

from pagemill.runtime.tool_calling.json_calls import finished, read_objects
from pagemill.runtime.tool_calling.parser import (
    ParsedOutput,
    PartialCall,
    ToolParser,
    Tools,
    content_before,
)

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, tools: Tools = None, final: bool = False) -> ParsedOutput:
        content, start = content_before(text, START)
        if start < 0:
            return ParsedOutput(content)
        calls: list[PartialCall] = []
        ok = True
        pos = start
        while ok and pos >= 0:
            body_start = pos + len(START)
            close = text.find(END, body_start)
            body = text[body_start:] if close < 0 else text[body_start:close]
            found, ok, _ = read_objects(body, 0, " \t\r\n")
            # One object per block; a closed block without one is not a call.
            ok = ok and len(found) <= 1 and (close < 0 or len(found) == 1)
            calls += found[:1]
            pos = -1 if close < 0 else text.find(START, close)
        kept = finished(calls, ok, final)
        if kept is None:
            return ParsedOutput(text)
        return ParsedOutput(content, kept)
