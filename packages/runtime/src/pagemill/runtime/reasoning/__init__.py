"""Reasoning parsers by vLLM's names (`--reasoning-parser`): deepseek_r1, qwen3.

`get_reasoning_parser(name)` returns the parser class; the server makes one per request
(it reads the request's `chat_template_kwargs`).
"""

from pagemill.runtime.reasoning.base import ReasoningParser
from pagemill.runtime.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from pagemill.runtime.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}
REASONING_PARSER_NAMES = tuple(REASONING_PARSERS)


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        known = ", ".join(REASONING_PARSER_NAMES)
        raise ValueError(f"unknown reasoning parser {name!r}; known: {known}") from None


__all__ = [
    "REASONING_PARSERS",
    "REASONING_PARSER_NAMES",
    "DeepSeekR1ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "get_reasoning_parser",
]
