"""What a reasoning parser does: split a model's text into its reasoning and its answer.

Reasoning models write their thinking between markers (`<think>` … `</think>`) before
the answer; the API returns it apart, as `reasoning_content` (and `reasoning`, vLLM's
newer name). Like the tool parsers, a reasoning parser is stateless over the text so far:
`split` of a longer text only ever extends both parts, so a stream sends their growth and
the pieces add up to the whole answer's split. The engine uses the end marker's token id
too: a structured-output grammar starts after it (`end_token_ids`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagemill.runtime.tool_calling.parser import held_back


class ReasoningParser:
    """A `<think>`-style parser; subclasses set the markers and the model's conventions."""

    name = ""
    start_token = "<think>"
    end_token = "</think>"

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None):
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.start_token_id = _single_token_id(tokenizer, self.start_token)
        self.end_token_id = _single_token_id(tokenizer, self.end_token)

    @property
    def thinking_enabled(self) -> bool:
        """Whether this request asked the model to think at all."""
        return True

    @property
    def end_token_ids(self) -> list[int] | None:
        """The token that ends reasoning, for the structured-output gate (None: the marker
        is not one token of this vocabulary, so the engine cannot see where it ends)."""
        return None if self.end_token_id is None else [self.end_token_id]

    def prompt_ends_reasoning(self, prompt_ids: Sequence[int]) -> bool:
        """True when the prompt itself closed the reasoning (a template that writes an
        empty `<think></think>` when thinking is off): the whole output is the answer."""
        if self.start_token_id is not None and self.end_token_id is not None:
            for tid in reversed(prompt_ids):
                if tid == self.end_token_id:
                    return True
                if tid == self.start_token_id:
                    return False
            return False
        if self.tokenizer is None:
            return False
        tail = self.tokenizer.decode(list(prompt_ids[-64:]), skip_special_tokens=False)
        return tail.rfind(self.end_token) > tail.rfind(self.start_token)

    def split(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) of the output so far. Before `final`, text that could be
        the start of a marker is held back."""
        body = self._body(text, final)
        if body is None:
            return "", ""  # perhaps `<think>` still being written
        end = body.find(self.end_token)
        if end >= 0:
            return body[:end], body[end + len(self.end_token) :]
        return self._unended(body, final)

    def _body(self, text: str, final: bool) -> str | None:
        """The text after a leading `<think>` (None while one may still be coming)."""
        start = text.find(self.start_token)
        if start >= 0 and not text[:start].strip():
            return text[start + len(self.start_token) :]
        if not final and text.strip() and self.start_token.startswith(text.lstrip()):
            return None
        return text

    def _unended(self, body: str, final: bool) -> tuple[str, str]:
        """No end marker yet: the model is still thinking (or was cut off while it did), as
        in vLLM's deepseek_r1 and qwen3 parsers (templates open `<think>` in the prompt)."""
        if final:
            return body, ""
        return body[: len(body) - held_back(body, self.end_token)], ""


def _single_token_id(tokenizer: Any, token: str) -> int | None:
    if tokenizer is None:
        return None
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    tid = vocab.get(token)
    return tid if isinstance(tid, int) else None
