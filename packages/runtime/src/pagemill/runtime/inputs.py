"""The prompt forms `LLM.generate` takes, under vLLM's names (`vllm.inputs`).

A prompt is a string, a `TextPrompt` (`{"prompt": "..."}`) or a `TokensPrompt`
(`{"prompt_token_ids": [...]}`); a bare list of token ids is still taken, as pagemill always
did. Keys of vLLM's prompt dicts that pagemill cannot honour (multi-modal data, prompt
embeddings) are refused by name rather than dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NotRequired, TypedDict

__all__ = [
    "ParsedPrompt",
    "PromptType",
    "SingletonPrompt",
    "TextPrompt",
    "TokensPrompt",
    "is_token_ids",
    "parse_prompt",
]


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the engine."""

    prompt: str
    cache_salt: NotRequired[str]
    """Keeps this prompt's prefix-cache blocks apart from other salts' (vLLM's meaning)."""


class TokensPrompt(TypedDict):
    """A prompt already tokenized."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    """The text the ids came from, if known: reported back as `RequestOutput.prompt`."""
    cache_salt: NotRequired[str]


SingletonPrompt = str | TextPrompt | TokensPrompt
PromptType = SingletonPrompt

# vLLM's prompt keys for features pagemill does not have.
_UNSUPPORTED = {
    "multi_modal_data": "pagemill serves text-only models",
    "mm_processor_kwargs": "pagemill serves text-only models",
    "multi_modal_uuids": "pagemill serves text-only models",
    "prompt_embeds": "prompts are text or token ids",
    "token_type_ids": "pagemill runs no cross-encoder models",
}


@dataclass(frozen=True, slots=True)
class ParsedPrompt:
    """What the engine is given: the text or the ids, and the request's cache salt."""

    prompt: str | list[int]
    cache_salt: str | None = None
    # What the output reports as its prompt when the engine is given ids.
    text: str | None = None


def is_token_ids(x: object) -> bool:
    return isinstance(x, (list, tuple)) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in x
    )


def parse_prompt(p: object) -> ParsedPrompt:
    """One prompt in any accepted form; TypeError/ValueError naming what is wrong."""
    if isinstance(p, str):
        return ParsedPrompt(p)
    if is_token_ids(p):
        return ParsedPrompt(list(p))  # type: ignore[call-overload]
    if not isinstance(p, dict):
        raise TypeError(
            "each prompt must be a string or a list of token ids, or a dict: "
            f"{{'prompt': str}} or {{'prompt_token_ids': [int, ...]}}; got {type(p).__name__}"
        )
    for key in p:
        if key in _UNSUPPORTED:
            raise ValueError(f"prompt key {key!r} is not supported: {_UNSUPPORTED[key]}")
        if key not in ("prompt", "prompt_token_ids", "cache_salt"):
            raise ValueError(
                f"unknown prompt key {key!r}; a prompt dict takes 'prompt' or "
                "'prompt_token_ids' (and optionally 'cache_salt')"
            )
    salt = p.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"'cache_salt' must be a non-empty string, got {salt!r}")
    text = p.get("prompt")
    if text is not None and not isinstance(text, str):
        raise TypeError(f"'prompt' must be a string, got {type(text).__name__}")
    if "prompt_token_ids" in p:
        ids = p["prompt_token_ids"]
        if not is_token_ids(ids):
            raise TypeError("'prompt_token_ids' must be a list of ints")
        return ParsedPrompt(list(ids), salt, text)
    if text is None:
        raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
    return ParsedPrompt(text, salt)


def as_prompt_list(prompts: object) -> list[object]:
    """One prompt (any form) or a sequence of them -> the list."""
    if isinstance(prompts, (str, dict)) or is_token_ids(prompts):
        return [prompts]
    if isinstance(prompts, Sequence):
        return list(prompts)
    raise TypeError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
