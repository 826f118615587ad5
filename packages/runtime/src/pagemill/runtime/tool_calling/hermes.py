"""Hermes tool calls (NousResearch Hermes, Qwen 2.5/3, SmolLM2 prompted in that format):
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call."""

from __future__ import annotations

import json
import re

from pagemill.runtime.tool_calling.parser import ExtractedToolCalls, ToolCall, ToolParser, held_back

START, END = "<tool_call>", "</tool_call>"
# A closed block, or an unclosed last one (the output was cut where the call ended).
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class HermesToolParser(ToolParser):
    name = "hermes"

    def extract(self, text: str) -> ExtractedToolCalls:
        start = text.find(START)
        if start < 0:
            return ExtractedToolCalls([], text)
        calls = []
        for body in _BLOCK.findall(text[start:]):
            try:
                obj = json.loads(body)
            except ValueError:
                return ExtractedToolCalls([], text)  # not a call after all: keep the text
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return ExtractedToolCalls([], text)
            calls.append(
                ToolCall.make(obj["name"], obj.get("arguments", obj.get("parameters", {})))
            )
        content = text[:start].strip()
        return ExtractedToolCalls(calls, content or None)

    def stream_safe_len(self, text: str) -> int | None:
        if START in text:
            return None
        return len(text) - held_back(text, START)
