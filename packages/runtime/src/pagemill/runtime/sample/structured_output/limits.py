"""What pagemill refuses before xgrammar sees a grammar: the documented limits.

A grammar's compile cost can grow much faster than its text (a 300-deep schema takes
xgrammar 7 s to parse, `(.*){1,20}` 5 s to compile, 5,000 optional properties never finish),
so every constraint is measured here first, in pure Python and in time linear in its size,
and refused with a ValueError that names the limit. What passes these checks still compiles
under a deadline (`StructuredOutputsConfig.structured_outputs_compile_timeout`).

Limits (see `LIMITS`): the text of a JSON schema, regex, EBNF grammar or choice list at
most 64 KiB; a JSON schema nested at most 32 subschemas deep; at most 256 properties in one
object and 2,000 in the whole schema; string lengths, item and property counts (minLength,
maxLength, minItems, maxItems, minProperties) at most 1,000; enums at most 1,000 values; a
counted repetition `{m,n}` at most 1,000, and at most 8 when what it repeats can itself
match text of any length (as in `(.*){1,20}`), in regexes, `pattern`s and EBNF alike. JSON
output (schema or JSON object) puts at most 32 whitespace characters between two tokens.

A JSON schema may use only keywords xgrammar enforces: anything else (`not`, `if`/`then`/
`else`, `unevaluatedProperties`, `uniqueItems`, `contains`, `dependentRequired`, an unknown
`format`, ...) is refused by name rather than silently dropped; `$ref` must point inside the
schema (`#/...`), resolve, and not lead back to itself (recursive schemas degrade to "any
JSON" in xgrammar, so they are refused too).
"""

from __future__ import annotations

import re
from typing import Any

MAX_TEXT_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 32
MAX_OBJECT_PROPERTIES = 256
MAX_TOTAL_PROPERTIES = 2_000
MAX_COUNT = 1_000
MAX_ENUM = 1_000
MAX_REPEAT = 1_000
MAX_REPEAT_UNBOUNDED = 8
# Whitespace characters JSON output may put in a row (room for pretty-printing eight
# levels deep): without a cap a sampled model can spend every remaining token on
# whitespace, which the grammar allows anywhere, and end at max_tokens with no value.
# Enforced beside the grammar (`whitespace.WhitespaceCap`), strings included.
MAX_JSON_WHITESPACE = 32
# Newlines in one such run (a blank line at most): blank line after blank line, a token
# each, was how a sampled model still reached max_tokens within 32 characters a gap.
MAX_JSON_NEWLINES = 2

LIMITS = {
    "text_bytes": MAX_TEXT_BYTES,
    "schema_depth": MAX_SCHEMA_DEPTH,
    "object_properties": MAX_OBJECT_PROPERTIES,
    "total_properties": MAX_TOTAL_PROPERTIES,
    "length_and_item_counts": MAX_COUNT,
    "enum_values": MAX_ENUM,
    "repetition": MAX_REPEAT,
    "repetition_of_unbounded": MAX_REPEAT_UNBOUNDED,
    "json_whitespace_run": MAX_JSON_WHITESPACE,
    "json_newlines_in_a_run": MAX_JSON_NEWLINES,
}

# Keywords whose meaning xgrammar enforces (or that carry no constraint).
_SUPPORTED = frozenset(
    {
        "type",
        "properties",
        "required",
        "additionalProperties",
        "patternProperties",
        "propertyNames",
        "minProperties",
        "items",
        "prefixItems",
        "minItems",
        "maxItems",
        "enum",
        "const",
        "anyOf",
        "oneOf",
        "allOf",
        "$ref",
        "$defs",
        "definitions",
        "minLength",
        "maxLength",
        "pattern",
        "format",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "nullable",
        # annotations: no constraint on the output
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "contentMediaType",
        "contentEncoding",
        "strict",
    }
)
# Bounds xgrammar enforces on an "integer" or a "number" (a "number" in decimal notation:
# it refuses an exponent, never a value past the bound; 0.1 let values past an integer's
# bound through, 0.2.9 does not). On a node of another or no type it drops them and lets any
# value through, so there they are refused rather than ignored. (`multipleOf` it ignores on
# every type, so it is not in _SUPPORTED.)
_NUMERIC_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_FORMATS = frozenset(
    {
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "uuid",
        "ipv4",
        "ipv6",
        "hostname",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)
# Keywords whose value is a map of name -> subschema / a list of subschemas / a subschema.
_MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions")
_LIST_KEYS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_KEYS = ("items", "additionalProperties", "propertyNames")
_COUNT_KEYS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties")


def check_text(kind: str, text: str) -> None:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_TEXT_BYTES:
        raise ValueError(f"the {kind} is {size:,} bytes; at most {MAX_TEXT_BYTES:,} are accepted")


def check_schema(schema: Any) -> None:
    """Depth, size, keyword and $ref checks of a parsed JSON schema."""
    state = {"properties": 0}
    _walk(schema, schema, "#", 0, state)
    _check_refs(schema)


def _walk(node: Any, root: Any, path: str, depth: int, state: dict[str, int]) -> None:
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        raise ValueError(f"{path}: a subschema must be an object or a bool")
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels (at {path})")
    unknown = sorted(k for k in node if k not in _SUPPORTED)
    if unknown:
        raise ValueError(
            f"{path}: unsupported JSON schema keyword(s) {', '.join(unknown)} "
            "(pagemill enforces only what it can; remove them)"
        )
    bounds = [k for k in _NUMERIC_BOUNDS if k in node]
    if bounds and node.get("type") not in ("integer", "number"):
        raise ValueError(
            f'{path}: {", ".join(bounds)} can be enforced only beside "type": "integer" '
            'or "type": "number" (elsewhere the grammar engine would drop them); add the '
            "type or remove them"
        )
    fmt = node.get("format")
    if fmt is not None and fmt not in _FORMATS:
        raise ValueError(
            f"{path}: unsupported format {fmt!r} (supported: {', '.join(sorted(_FORMATS))})"
        )
    for key in _COUNT_KEYS:
        value = node.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > MAX_COUNT:
            raise ValueError(f"{path}: {key}={value} exceeds the limit of {MAX_COUNT:,}")
    for key in ("enum",):
        value = node.get(key)
        if isinstance(value, list) and len(value) > MAX_ENUM:
            raise ValueError(f"{path}: enum has {len(value):,} values; at most {MAX_ENUM:,}")
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        check_regex(pattern, f"{path}/pattern")
    for key in _MAP_KEYS:
        value = node.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ValueError(f"{path}/{key} must be an object")
        if key == "properties":
            if len(value) > MAX_OBJECT_PROPERTIES:
                raise ValueError(
                    f"{path}: an object with {len(value):,} properties; at most "
                    f"{MAX_OBJECT_PROPERTIES} are accepted"
                )
            state["properties"] += len(value)
            if state["properties"] > MAX_TOTAL_PROPERTIES:
                raise ValueError(
                    f"the JSON schema has more than {MAX_TOTAL_PROPERTIES:,} properties in all"
                )
        if key == "patternProperties":
            for name in value:
                check_regex(name, f"{path}/patternProperties")
        for name, sub in value.items():
            _walk(sub, root, f"{path}/{key}/{name}", depth + 1, state)
    for key in _LIST_KEYS:
        value = node.get(key)
        if value is None:
            continue
        if not isinstance(value, list):
            raise ValueError(f"{path}/{key} must be a list")
        for i, sub in enumerate(value):
            _walk(sub, root, f"{path}/{key}/{i}", depth + 1, state)
    for key in _SCHEMA_KEYS:
        if key in node:
            _walk(node[key], root, f"{path}/{key}", depth + 1, state)


def _resolve(root: Any, ref: str) -> Any:
    if ref == "#":
        raise ValueError(
            "$ref '#' (the whole schema inside itself) is a recursive schema, "
            "which structured output cannot enforce"
        )
    if not ref.startswith("#/"):
        raise ValueError(f"$ref {ref!r}: only references inside the schema ('#/...') are supported")
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise ValueError(f"$ref {ref!r} does not resolve inside the schema")
    return node


def _refs_under(node: Any, out: list[str]) -> None:
    """Every $ref string inside `node` (iteratively: depth is already bounded)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            ref = n.get("$ref")
            if isinstance(ref, str):
                out.append(ref)
            elif ref is not None:
                raise ValueError("$ref must be a string")
            stack.extend(v for k, v in n.items() if k not in ("$defs", "definitions"))
        elif isinstance(n, list):
            stack.extend(n)


def _check_refs(root: Any) -> None:
    """Every $ref resolves, and none leads (through other $refs) back to a schema that
    contains it: xgrammar cannot enforce a recursive schema."""
    refs: list[str] = []
    _refs_under(root, refs)
    if not refs:
        return
    edges: dict[str, list[str]] = {}
    todo = list(dict.fromkeys(refs))
    while todo:
        ref = todo.pop()
        if ref in edges:
            continue
        target = _resolve(root, ref)
        inner: list[str] = []
        _refs_under(target, inner)
        edges[ref] = list(dict.fromkeys(inner))
        todo.extend(r for r in edges[ref] if r not in edges)
    # A cycle in the ref graph = a recursive schema.
    colour: dict[str, int] = {}
    for start in edges:
        if colour.get(start):
            continue
        stack = [(start, iter(edges[start]))]
        colour[start] = 1
        while stack:
            ref, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                colour[ref] = 2
                stack.pop()
            elif colour.get(nxt) == 1:
                raise ValueError(
                    f"$ref {nxt!r} refers back to itself: recursive schemas are "
                    "not supported by structured output"
                )
            elif not colour.get(nxt):
                colour[nxt] = 1
                stack.append((nxt, iter(edges[nxt])))


_QUANT = re.compile(r"\{(\d*)(?:(,)(\d*))?\}")


def check_regex(text: str, what: str = "regex") -> None:
    """Counted repetitions: at most MAX_REPEAT, and MAX_REPEAT_UNBOUNDED for a group (or
    atom) that can itself match any length. Linear scan; no regex engine involved."""
    # Per open group: whether it contains an unbounded quantifier.
    stack: list[bool] = [False]
    last_unbounded = False  # the atom just closed (a group) could match any length
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            last_unbounded = False
            continue
        if c == '"' and what == "grammar":  # an EBNF string literal: no operators inside
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            i = j + 1
            last_unbounded = False
            continue
        if c == "[":
            j = i + 1
            if j < n and text[j] == "^":
                j += 1
            if j < n and text[j] == "]":
                j += 1
            while j < n and text[j] != "]":
                j += 2 if text[j] == "\\" else 1
            i = j + 1
            last_unbounded = False
            continue
        if c == "(":
            stack.append(False)
            last_unbounded = False
        elif c == ")":
            inner = stack.pop() if len(stack) > 1 else False
            if inner:
                stack[-1] = True
            last_unbounded = inner
        elif c in "*+":
            stack[-1] = True
            last_unbounded = False
        elif c == "{":
            m = _QUANT.match(text, i)
            if m:
                lo, comma, hi = m.group(1), m.group(2), m.group(3)
                if lo or hi:
                    top = int(hi) if hi else (int(lo) if lo and not comma else None)
                    if top is None:  # {m,}: unbounded
                        stack[-1] = True
                        bound = int(lo)
                    else:
                        bound = top
                    if bound > MAX_REPEAT:
                        raise ValueError(
                            f"{what}: the repetition {m.group(0)} exceeds the "
                            f"limit of {MAX_REPEAT:,}"
                        )
                    if last_unbounded and bound > MAX_REPEAT_UNBOUNDED:
                        raise ValueError(
                            f"{what}: {m.group(0)} repeats a part that can match any length; "
                            f"at most {MAX_REPEAT_UNBOUNDED} repetitions of such a part"
                        )
                    i = m.end()
                    last_unbounded = False
                    continue
            last_unbounded = False
        else:
            last_unbounded = False
        i += 1
