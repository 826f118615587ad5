"""From an HTTP body to the request's output constraint and logit biases, or a 400.

One constraint per request: vLLM's `structured_outputs` (or its older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`), OpenAI's `response_format`
(json_object, json_schema), or the schema that forces a tool call (chat `tool_choice`
"required" or a named function). The schema is parsed here, so an invalid or unsupported
one is a 400 that says what is wrong before anything reaches the engine.
"""

from __future__ import annotations

import re
from typing import Any

from pagemill.runtime.sample.structured_output import StructuredOutputsParams
from pagemill.server.entrypoints.openai.errors import APIError
from pagemill.server.entrypoints.openai.protocol import SamplingFields


def structured_params(
    req: SamplingFields, tool_schema: dict[str, Any] | None = None
) -> StructuredOutputsParams | None:
    sources: list[tuple[str, dict[str, Any]]] = []
    so = req.structured_outputs
    if so is not None:
        given = {
            "json": so.json_,
            "regex": so.regex,
            "choice": so.choice,
            "grammar": so.grammar,
            "json_object": so.json_object,
        }
        sources.append(
            ("structured_outputs", {k: v for k, v in given.items() if v not in (None, False)})
        )
    guided = {
        name: value
        for name, value in (
            ("guided_json", req.guided_json),
            ("guided_regex", req.guided_regex),
            ("guided_choice", req.guided_choice),
            ("guided_grammar", req.guided_grammar),
        )
        if value is not None
    }
    if len(guided) > 1:
        raise APIError(
            400,
            f"send only one of {' and '.join(guided)}: each constrains the whole output",
            param=next(iter(guided)),
        )
    for name, value in guided.items():
        sources.append((name, {name.removeprefix("guided_"): value}))
    backend = req.guided_decoding_backend
    if backend is not None and backend not in GUIDED_BACKENDS:
        raise APIError(
            400,
            f"guided_decoding_backend {backend[:40]!r} is not available: this server "
            f"constrains output with xgrammar (send one of {sorted(GUIDED_BACKENDS)})",
            param="guided_decoding_backend",
        )
    compact = bool(so and so.disable_any_whitespace)
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        sources.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        assert fmt.json_schema is not None
        sources.append(("response_format", {"json": fmt.json_schema.schema_}))
    if tool_schema is not None:
        sources.append(("tool_choice", {"json": tool_schema}))
        compact = True  # arguments are read by programs: no free whitespace to ramble in
    if not sources:
        return None
    if len(sources) > 1:
        names = " and ".join(n for n, _ in sources)
        raise APIError(400, f"{names} each constrain the output; send only one")
    param, fields = sources[0]
    try:
        return StructuredOutputsParams(**fields, disable_any_whitespace=compact)
    except ValueError as exc:
        raise APIError(400, f"{param}: {exc}", param=param) from exc


# What guided_decoding_backend may name: the one backend here, or the server's choice.
GUIDED_BACKENDS = frozenset({"auto", "xgrammar"})

_TOKEN_ID = re.compile(r"0|[1-9][0-9]{0,9}")


def logit_bias(req: SamplingFields, vocab_limit: int) -> dict[int, float] | None:
    """OpenAI's {"token id as text": bias}; ids must lie in the vocabulary."""
    if not req.logit_bias:
        return None
    out: dict[int, float] = {}
    for key, value in req.logit_bias.items():
        # Canonical decimal only: int() would also take " 28 ", "2_8" and non-ASCII digits.
        if not _TOKEN_ID.fullmatch(key):
            raise APIError(
                400,
                f"logit_bias keys must be token ids written in decimal "
                f'digits (e.g. "28"), got {key[:32]!r}',
                param="logit_bias",
            )
        token = int(key)
        if not 0 <= token < vocab_limit:
            raise APIError(
                400,
                f"logit_bias token id {token} is outside the vocabulary (ids 0..{vocab_limit - 1})",
                param="logit_bias",
            )
        if not -100 <= value <= 100:
            raise APIError(
                400,
                f"logit_bias values must be in [-100, 100], got {value} for token {token}",
                param="logit_bias",
            )
        out[token] = value
    return out
