"""Calls written as JSON objects `{"name": ..., "arguments": {...}}`, whole or cut short.

Most formats (Hermes, Llama 3, Mistral before v11, Granite, Phi-4-mini, the array a
"required" tool choice forces) write each call as such an object. A stream sees the last
one half-written: `partial-json-parser` reads what is there, and the arguments sent so far
are the JSON spelling of that partial object with its closing quotes and brackets cut off
(numbers and literals still being written are left out), which is always a prefix of the
final spelling: the text only grows, and dumping is deterministic.
"""

from __future__ import annotations

import json
import re
from typing import Any

from partial_json_parser import Allow
from partial_json_parser import loads as partial_loads

from pagemill.runtime.tool_calling.parser import PartialCall, arguments_json

_decoder = json.JSONDecoder()
# Strings may be cut (their text so far is final), containers too; a number or literal
# being written is left out until it ends (`12` may become `123`).
PARTIAL = Allow.STR | Allow.OBJ | Allow.ARR
_WHOLE_STRINGS = Allow.OBJ | Allow.ARR
_CLOSERS = '"]}'


def stable_prefix(partial_value: Any) -> str:
    """The part of the spelling of a partially read value that later text cannot change."""
    return arguments_json(partial_value).rstrip(_CLOSERS)


def _args_of(obj: dict[str, Any]) -> Any:
    if "arguments" in obj:
        return obj["arguments"]
    return obj.get("parameters")


def call_from_object(obj: Any) -> PartialCall | None:
    """A complete call object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = _args_of(obj)
    if args is None:
        args = {}
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return PartialCall(obj["name"], arguments_json(args), complete=True)


# The name written first, closed (the usual order): found without a second partial parse.
_NAME_FIRST = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')


def partial_call(text: str) -> PartialCall:
    """The call an unfinished object's text shows so far."""
    try:
        loose = partial_loads(text, PARTIAL)
        first = _NAME_FIRST.match(text)
        if first is not None:
            name = json.loads(first.group(1))
        else:
            strict = partial_loads(text, _WHOLE_STRINGS)
            name = strict.get("name") if isinstance(strict, dict) else None
    except Exception:  # not JSON at all: nothing to show
        return PartialCall(None)
    if not isinstance(name, str):
        return PartialCall(None)
    args = _args_of(loose) if isinstance(loose, dict) else None
    return PartialCall(name, stable_prefix(args) if isinstance(args, dict) else "")


def read_objects(
    text: str, pos: int, separators: str = " \t\r\n;,", end: str = ""
) -> tuple[list[PartialCall], bool, int]:
    """The call objects from `pos`: (calls, all well-formed, where reading stopped).

    Reading stops at a character in `end` (outside objects), at text that is not an object,
    or at the end of the text, where an unfinished object becomes a partial call.
    """
    calls: list[PartialCall] = []
    while True:
        while pos < len(text) and text[pos] in separators:
            pos += 1
        if pos >= len(text) or text[pos] in end:
            return calls, True, pos
        if text[pos] != "{":
            return calls, False, pos
        try:
            obj, stop = _decoder.raw_decode(text, pos)
        except ValueError:
            calls.append(partial_call(text[pos:]))
            return calls, True, len(text)
        call = call_from_object(obj)
        if call is None:
            return calls, False, pos
        calls.append(call)
        pos = stop


def read_array(text: str, pos: int) -> tuple[list[PartialCall], bool]:
    """The calls of a JSON array of call objects starting at `pos` (its `[`), whole or cut."""
    calls, ok, _ = read_objects(text, pos + 1, " \t\r\n,", end="]")
    return calls, ok


def finished(calls: list[PartialCall], ok: bool, final: bool) -> list[PartialCall] | None:
    """The calls as a parse reports them: None when the text turned out malformed (then
    it is all content); at the end, only the calls that were finished."""
    if not ok and final:
        return None
    if final:
        return [c for c in calls if c.complete]
    return calls
