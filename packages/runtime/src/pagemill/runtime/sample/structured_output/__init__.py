"""Grammar-constrained decoding: JSON schema, regex, choice and EBNF through xgrammar.

`StructuredOutputsParams` (on `SamplingParams.structured_outputs`) says what the output
must match; `StructuredOutputManager` (owned by the engine core) compiles grammars off the
engine thread and keeps one matcher per request; the sampler only sees the token bitmask
the manager fills each step (`SamplingMetadata.token_bitmask`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagemill.runtime.sample.structured_output.config import StructuredOutputsConfig
from pagemill.runtime.sample.structured_output.limits import LIMITS
from pagemill.runtime.sample.structured_output.params import (
    GrammarKey,
    StructuredOutputsParams,
    check_grammar,
    choice_grammar,
    validate,
)

if TYPE_CHECKING:
    from pagemill.runtime.sample.structured_output.manager import StructuredOutputManager

__all__ = [
    "LIMITS",
    "GrammarKey",
    "StructuredOutputManager",
    "StructuredOutputsConfig",
    "StructuredOutputsParams",
    "check_grammar",
    "choice_grammar",
    "grammar_failure_message",
    "is_grammar_failure",
    "validate",
]


# Every message of a request ended by its grammar starts so (the server answers 400).
GRAMMAR_FAILURE_PREFIX = "the grammar "


def is_grammar_failure(stop_reason: object) -> bool:
    """Did the request's own grammar end it (finish_reason "error")?"""
    return isinstance(stop_reason, str) and stop_reason.startswith(GRAMMAR_FAILURE_PREFIX)


def grammar_failure_message(error: BaseException) -> str:
    """What a request whose grammar failed after admission is told: pagemill's own words,
    never xgrammar's internals."""
    from pagemill.runtime.sample.structured_output.worker import (
        GrammarCompileError,
        GrammarCompileTimeout,
    )

    if isinstance(error, GrammarCompileTimeout):
        return str(error)
    if isinstance(error, GrammarCompileError):
        return "the grammar cannot be compiled"
    return "the grammar could not be compiled (internal error)"


def __getattr__(name: str) -> Any:
    # The manager needs torch and xgrammar; the params (read by the CLI's config) do not.
    if name == "StructuredOutputManager":
        from pagemill.runtime.sample.structured_output.manager import StructuredOutputManager

        return StructuredOutputManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
