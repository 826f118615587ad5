"""Mistral tool calls, after the `[TOOL_CALLS]` special token:

- tokenizers before v11 (Mistral 7B v0.3, Mixtral): a JSON array,
  `[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}]`;
- v11 and later (Mistral Small 3.x, Devstral, Magistral): the name, then the arguments
  object, `[TOOL_CALLS]add{"a": 1}` (v13 puts `[ARGS]` between), the token repeated per call.

Call ids are 9 alphanumeric characters, the only kind Mistral's templates accept back.
"""

from __future__ import annotations

import json
import re

from partial_json_parser import loads as partial_loads

from pagemill.runtime.tool_calling.json_calls import PARTIAL, finished, read_array, stable_prefix
from pagemill.runtime.tool_calling.parser import (
    ParsedOutput,
    PartialCall,
    ToolParser,
    Tools,
    arguments_json,
    content_before,
    mistral_tool_call_id,
)

BOT = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*(?:\[ARGS\])?\s*(?=\{)")
_decoder = json.JSONDecoder()


def _named_call(segment: str) -> tuple[PartialCall | None, bool]:
    """A v11 call `name{...}`: (the call, well-formed so far)."""
    m = _NAME.match(segment)
    if m is None:
        # Still writing the name (or `[ARGS]`): nothing to show yet.
        head = segment.strip()
        ok = re.fullmatch(r"[A-Za-z0-9_.\-]*\s*\[?A?R?G?S?\]?", head) is not None
        return None, ok
    name, pos = m.group(1), m.end()
    try:
        args, stop = _decoder.raw_decode(segment, pos)
    except ValueError:
        try:
            partial = partial_loads(segment[pos:], PARTIAL)
        except Exception:
            return None, False
        return PartialCall(name, stable_prefix(partial) if isinstance(partial, dict) else ""), True
    if not isinstance(args, dict) or segment[stop:].strip():
        return None, False
    return PartialCall(name, arguments_json(args), complete=True), True


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    def new_id(self) -> str:
        return mistral_tool_call_id()

    def parse(self, text: str, tools: Tools = None, final: bool = False) -> ParsedOutput:
        content, start = content_before(text, BOT)
        if start < 0:
            return ParsedOutput(content)
        calls: list[PartialCall] = []
        ok = True
        for segment in text[start + len(BOT) :].split(BOT):
            body = segment.lstrip()
            if body.startswith("["):
                found, ok = read_array(body, 0)
                calls += found
            else:
                call, ok = _named_call(segment)
                if call is not None:
                    calls.append(call)
            if not ok:
                break
        kept = finished(calls, ok, final)
        if kept is None:
            return ParsedOutput(text)
        return ParsedOutput(content, kept)
