"""Llama 3.x JSON tool calls: the whole reply is `{"name": ..., "parameters": {...}}`,
optionally after `<|python_tag|>`, several calls separated by `;`."""

from __future__ import annotations

import json

from pagemill.runtime.tool_calling.parser import ExtractedToolCalls, ToolCall, ToolParser

PYTHON_TAG = "<|python_tag|>"
_decoder = json.JSONDecoder()


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def extract(self, text: str) -> ExtractedToolCalls:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG) :].lstrip()
        if not body.startswith("{"):
            return ExtractedToolCalls([], text)
        calls, pos = [], 0
        while pos < len(body):
            try:
                obj, end = _decoder.raw_decode(body, pos)
            except ValueError:
                return ExtractedToolCalls([], text)
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return ExtractedToolCalls([], text)
            args = obj.get("parameters", obj.get("arguments", {}))
            calls.append(ToolCall.make(obj["name"], args))
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return ExtractedToolCalls(calls, None)

    def stream_safe_len(self, text: str) -> int | None:
        head = text.lstrip()
        if not head:
            return 0
        if head.startswith("{") or head.startswith(PYTHON_TAG) or PYTHON_TAG.startswith(head):
            return None if head.startswith(("{", PYTHON_TAG)) else 0
        return len(text)
