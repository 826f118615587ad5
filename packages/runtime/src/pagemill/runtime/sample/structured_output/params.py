"""What a request asks its output to match: a JSON schema, a regex, a choice, a grammar.

`StructuredOutputsParams` follows vLLM's names. Exactly one constraint is set. Building
one checks only types and sizes (constant time); `validate` (called by
`InputProcessor.process` for every request, whatever its entry point) checks the documented
limits (`limits.py`) and parses the grammar without a tokenizer, so an invalid, unsupported
or too costly grammar fails as a ValueError naming the problem before the engine queues it.
A grammar that passes still compiles under a deadline on the engine's side.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pagemill.runtime.sample.structured_output import limits

_KINDS = ("json", "regex", "choice", "grammar", "json_object")

# What a grammar is compiled from: (kind, text). Equal keys share one compiled grammar.
GrammarKey = tuple[str, str]


def choice_grammar(choices: list[str]) -> str:
    """EBNF that matches exactly one of `choices` (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@dataclass
class StructuredOutputsParams:
    """One constraint on the generated text.

    json: a JSON schema (dict or its JSON text). regex: a regular expression. choice: the
    output is one of these strings. grammar: EBNF (GBNF-style, as xgrammar reads it).
    json_object: any JSON object. `disable_any_whitespace` makes JSON output compact (no
    free whitespace between tokens), which small models need to not ramble in spaces.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    reasoning_end_token_ids: list[int] | None = None
    """Set by a server with a reasoning parser: the constraint starts after one of these
    tokens (the end of the model's reasoning, `</think>`), never on the reasoning itself,
    as in vLLM. Not part of the grammar's key: the same grammar, started later."""

    def __post_init__(self) -> None:
        set_ = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(
                "StructuredOutputsParams takes exactly one of json, regex, choice, grammar, "
                f"json_object; got {set_ or 'none'}"
            )
        if isinstance(self.json, dict):
            self.json = _dumps(self.json)
        if self.json is not None and not isinstance(self.json, str):
            raise ValueError("structured_outputs.json must be a JSON schema (object or string)")
        if self.choice is not None:
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise ValueError(
                    "structured_outputs.choice must be a non-empty list of non-empty strings"
                )
            self.choice = list(self.choice)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a bool")
        ends = self.reasoning_end_token_ids
        if ends is not None and (
            not isinstance(ends, list)
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ends)
        ):
            raise ValueError("reasoning_end_token_ids must be a list of token ids")
        # Sizes only here (constant time): the rest is `validate`, off the caller's loop.
        _kind, text = self.key
        limits.check_text(self.kind if self.kind != "json" else "JSON schema", text)

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> GrammarKey:
        """What the compiled grammar depends on, as hashable text."""
        kind = self.kind
        if kind == "json":
            assert isinstance(self.json, str)
            text = self.json
        elif kind == "choice":
            assert self.choice is not None
            kind, text = "grammar", choice_grammar(self.choice)
        elif kind == "json_object":
            text = ""
        else:
            text = getattr(self, kind)
        if kind in ("json", "json_object") and self.disable_any_whitespace:
            kind += ":compact"
        return kind, text


def _dumps(schema: dict[str, Any]) -> str:
    try:
        return json.dumps(schema, ensure_ascii=False)  # key order is the output's order
    except (TypeError, ValueError) as exc:
        raise ValueError(f"structured_outputs.json is not JSON-serialisable: {exc}") from exc


# Keys that passed `validate` lately: a completions request with 16 prompts (or a client
# that repeats its schema) is checked once.
_VALID: OrderedDict[GrammarKey, None] = OrderedDict()
_VALID_LOCK = threading.Lock()
_VALID_SIZE = 256


def validate(params: StructuredOutputsParams) -> None:
    """The one check of a request's constraint: limits, keywords, references, then a parse
    without a tokenizer (bounded by the limits: milliseconds). A ValueError names the
    problem. Blocking: callers on an event loop run it on a worker thread."""
    key = params.key
    with _VALID_LOCK:
        if key in _VALID:
            _VALID.move_to_end(key)
            return
    check_grammar(key, params.disable_any_whitespace)
    with _VALID_LOCK:
        _VALID[key] = None
        while len(_VALID) > _VALID_SIZE:
            _VALID.popitem(last=False)


def check_grammar(key: GrammarKey, compact: bool = False) -> None:
    """Limits, then a parse without a tokenizer; a ValueError says what is wrong."""
    import xgrammar as xgr  # here, not at import: SamplingParams stays torch-free

    kind, text = key
    kind = kind.split(":")[0]
    try:
        if kind == "json":
            try:
                schema = json.loads(text)
            except ValueError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from exc
            except RecursionError:
                raise ValueError("the JSON schema nests too deeply") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object (or a bool)")
            limits.check_schema(schema)
            xgr.Grammar.from_json_schema(text, any_whitespace=not compact)
        elif kind == "regex":
            limits.check_regex(text)
            xgr.Grammar.from_regex(text)
        elif kind == "grammar":
            limits.check_regex(text, "grammar")
            xgr.Grammar.from_ebnf(text)
    except ValueError:
        raise
    except Exception as exc:  # xgrammar reports bad input as RuntimeError
        raise ValueError(
            f"invalid or unsupported {kind} for structured output: {_short(exc)}"
        ) from exc


def _short(exc: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    msg = str(exc).strip()
    if msg.startswith("[") and ": " in msg:
        head, _, rest = msg.partition(": ")
        if head.count(":") >= 2:
            msg = rest
    return msg.splitlines()[0] if msg else type(exc).__name__
