"""Qwen3 (and QwQ): `<think>` … `</think>` then the answer, the model writing `<think>`
itself or the template opening it in the prompt. `chat_template_kwargs.enable_thinking:
false` makes the template write an empty `<think></think>` into the prompt: the whole
output is the answer then, reasoning None."""

from __future__ import annotations

from pagemill.runtime.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    @property
    def thinking_enabled(self) -> bool:
        return self.chat_template_kwargs.get("enable_thinking", True) is not False
