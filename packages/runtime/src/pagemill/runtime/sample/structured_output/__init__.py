"""Grammar-constrained decoding: JSON schema, regex, choice and EBNF through xgrammar.

`StructuredOutputsParams` (on `SamplingParams.structured_outputs`) says what the output
must match; `StructuredOutputManager` (owned by the engine core) compiles grammars off the
engine thread and keeps one matcher per request; the sampler only sees the token bitmask
the manager fills each step (`SamplingMetadata.token_bitmask`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagemill.runtime.sample.structured_output.params import (
    GrammarKey,
    StructuredOutputsParams,
    check_grammar,
    choice_grammar,
)

if TYPE_CHECKING:
    from pagemill.runtime.sample.structured_output.manager import StructuredOutputManager

__all__ = [
    "GrammarKey",
    "StructuredOutputManager",
    "StructuredOutputsParams",
    "check_grammar",
    "choice_grammar",
]


def __getattr__(name: str) -> Any:
    # The manager needs torch and xgrammar; the params (read by the CLI's config) do not.
    if name == "StructuredOutputManager":
        from pagemill.runtime.sample.structured_output.manager import StructuredOutputManager

        return StructuredOutputManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
