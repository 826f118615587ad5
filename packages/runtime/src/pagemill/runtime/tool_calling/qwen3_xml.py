"""Qwen3-Coder's XML tool calls (vLLM's `qwen3_xml` and `qwen3_coder`)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are raw text (one newline either side is the format's, not the value's),
converted by the type the tool's JSON schema gives the parameter: strings stay text,
integers and numbers become numbers, booleans `true`/`false`, objects and arrays are read
as JSON (else as a Python literal); `null` is null whatever the type; a value that does not
convert stays text, as in vLLM. A stream shows the name once `<function=NAME>` is written
and each parameter once it is closed; text parameters (code, often long) stream as they
are written.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from pagemill.runtime.tool_calling.parser import (
    ParsedOutput,
    PartialCall,
    ToolParser,
    Tools,
    arguments_json,
    held_back,
)

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
FN_START, FN_END = "<function=", "</function>"
PARAM_START, PARAM_END = "<parameter=", "</parameter>"


def _param_types(tools: Tools, name: str) -> dict[str, Any] | None:
    for tool in tools or []:
        fn = tool.get("function", tool)
        if fn.get("name") == name:
            params = fn.get("parameters") or {}
            return params.get("properties", params) if isinstance(params, dict) else {}
    return None


def convert(value: str, schema: Any) -> Any:
    if value.lower() == "null":
        return None
    kind = str(schema.get("type", "string")).lower() if isinstance(schema, dict) else "string"
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return value
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return value
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(value)
        except ValueError:
            pass
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return value


def _is_text(types: dict[str, Any], name: str) -> bool:
    """Whether a parameter's value stays text (a string, or one the schema does not type)."""
    schema = types.get(name)
    if not isinstance(schema, dict):
        return True
    return str(schema.get("type", "string")).lower() in ("string", "str", "text", "varchar")


def _partial_text(value: str) -> str | None:
    """The part of a text value being written that is certainly its: without the format's
    leading newline, a trailing newline (it may be the format's), or the start of a tag;
    None while it may still be `null` (which is no text)."""
    if value.startswith("\n"):
        value = value[1:]
    hold = max(held_back(value, t) for t in (PARAM_END, PARAM_START, FN_END))
    value = value[: len(value) - hold]
    value = value[:-1] if value.endswith("\n") else value
    if value and "null".startswith(value.lower()):
        return None
    return value


def _strip_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _function(body: str, tools: Tools) -> PartialCall | None:
    """`NAME>...parameters...` (after `<function=`), closed or still being written."""
    close = body.find(">")
    if close < 0 or "\n" in body[:close]:
        return None
    name = body[:close].strip()
    end = body.find(FN_END, close)
    params_text = body[close + 1 :] if end < 0 else body[close + 1 : end]
    types = _param_types(tools, name) or {}
    args: dict[str, Any] = {}
    pos = params_text.find(PARAM_START)
    while pos >= 0:
        head = pos + len(PARAM_START)
        gt = params_text.find(">", head)
        if gt < 0:
            break
        pname = params_text[head:gt].strip()
        # A parameter ends at its closing tag, or (models forget it) at the next one.
        stops = [
            i
            for i in (params_text.find(PARAM_END, gt), params_text.find(PARAM_START, gt))
            if i >= 0
        ]
        if not stops:
            value = params_text[gt + 1 :]
            if end >= 0:  # the function closed: the value runs to its end
                args[pname] = convert(_strip_newline(value), types.get(pname))
            elif _is_text(types, pname):
                partial = _partial_text(value)  # text streams as it is written
                if partial is not None:
                    args[pname] = partial
            break
        stop = min(stops)
        args[pname] = convert(_strip_newline(params_text[gt + 1 : stop]), types.get(pname))
        pos = params_text.find(PARAM_START, stop)
    text = arguments_json(args)
    if end >= 0:
        return PartialCall(name, text, complete=True)
    # Cut the closing quote and brace: the value being written may go on.
    return PartialCall(name, text.rstrip('"}'))


class Qwen3XmlToolParser(ToolParser):
    name = "qwen3_xml"

    def parse(self, text: str, tools: Tools = None, final: bool = False) -> ParsedOutput:
        start = text.find(CALL_START)
        fn = text.find(FN_START)
        if start < 0 or (0 <= fn < start):
            start = fn  # a call written without its <tool_call> wrapper
        if start < 0:
            hold = max(held_back(text, CALL_START), held_back(text, FN_START))
            return ParsedOutput(text[: len(text) - hold])
        calls: list[PartialCall] = []
        pos = text.find(FN_START, start)
        while pos >= 0:
            call = _function(text[pos + len(FN_START) :], tools)
            if call is None:
                break
            calls.append(call)
            pos = text.find(FN_START, pos + len(FN_START))
        if final:
            calls = [c for c in calls if c.complete]
            if not calls:
                return ParsedOutput(text)
        return ParsedOutput(text[:start], calls)
