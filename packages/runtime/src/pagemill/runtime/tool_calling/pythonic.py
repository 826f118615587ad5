"""Pythonic tool calls (Llama 3.2/4, ToolACE, xLAM prompted so): the reply is a Python
list of calls with keyword arguments, `[get_weather(city="Paris"), add(a=1, b=2)]`,
Llama 4 wrapping it in `<|python_start|>`/`<|python_end|>`. Argument values are Python
literals, read with `ast.literal_eval` (never evaluated). A reply that does not begin so
is plain content.

A stream shows each call's name once its `(` is written, and each keyword argument once
the comma after it is (a value being written may still change).
"""

from __future__ import annotations

import ast
import re
from typing import Any

from pagemill.runtime.tool_calling.parser import (
    ParsedOutput,
    PartialCall,
    ToolParser,
    Tools,
    arguments_json,
    leading_call_start,
)

START, END = "<|python_start|>", "<|python_end|>"
_CALL_HEAD = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")
_MAYBE_HEAD = re.compile(r"\s*[A-Za-z_][\w.]*\s*")
_OPEN, _CLOSE = "([{", ")]}"


def _split_top(text: str) -> tuple[list[str], str | None, bool]:
    """Split `text` at the commas at its top level: (complete pieces, the piece still being
    written or None if `text` closed, balanced so far). `text` starts just inside an
    opening bracket; a closing bracket at the top level ends it."""
    pieces: list[str] = []
    depth, quote, escaped, begin = 0, "", False, 0
    for i, ch in enumerate(text):
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            if depth == 0:
                pieces.append(text[begin:i])
                return pieces, None, text[i + 1 :].strip() == ""
            depth -= 1
        elif ch == "," and depth == 0:
            pieces.append(text[begin:i])
            begin = i + 1
    return pieces, text[begin:], True


def _keyword(piece: str) -> tuple[str, Any] | None:
    try:
        node = ast.parse(f"f({piece})", mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or node.args or len(node.keywords) != 1:
        return None
    kw = node.keywords[0]
    if kw.arg is None:
        return None
    try:
        return kw.arg, ast.literal_eval(kw.value)
    except ValueError:
        return None


def _call(element: str, complete: bool) -> tuple[PartialCall | None, bool]:
    """One list element `name(k=v, ...)`: (the call so far, well-formed so far)."""
    head = _CALL_HEAD.match(element)
    if head is None:
        return None, not complete and _MAYBE_HEAD.fullmatch(element) is not None
    pieces, rest, ok = _split_top(element[head.end() :])
    if not ok or (complete and rest is not None):
        return None, False
    args: dict[str, Any] = {}
    for piece in pieces:
        if not piece.strip() and piece is pieces[-1] and rest is None:
            continue  # f() or a trailing comma
        kv = _keyword(piece)
        if kv is None:
            return None, False
        args[kv[0]] = kv[1]
    text = arguments_json(args)
    if rest is None:
        return PartialCall(head.group(1), text, complete=True), True
    return PartialCall(head.group(1), text[:-1]), True


class PythonicToolParser(ToolParser):
    name = "pythonic"
    needs_special_tokens = True

    def parse(self, text: str, tools: Tools = None, final: bool = False) -> ParsedOutput:
        start = leading_call_start(text, (START, "["))
        if start is None or (start < 0 and final):
            return ParsedOutput(text)
        if start < 0:
            return ParsedOutput("")
        body = text[start:]
        if body.startswith(START):
            body = body[len(START) :].lstrip()
            if body.endswith(END):
                body = body[: -len(END)].rstrip()
            if not body:
                return ParsedOutput(text if final else "")
            if not body.startswith("["):
                return ParsedOutput(text)
        elements, rest, ok = _split_top(body[1:])
        calls: list[PartialCall] = []
        for element in elements:
            if not element.strip() and element is elements[-1] and rest is None:
                continue
            call, ok = _call(element, complete=True)
            if call is None:
                break
            calls.append(call)
        else:
            if rest is not None and rest.strip():
                call, ok = _call(rest, complete=False)
                if call is not None:
                    calls.append(call)
        if not ok:
            return ParsedOutput(text)  # not a list of calls after all
        if final:
            if rest is not None:
                calls = [c for c in calls if c.complete]
            if not calls:
                return ParsedOutput(text)
        return ParsedOutput("", calls)
