"""Qwen3 (and QwQ): `<think>` … `</think>` then the answer, the model writing `<think>`
itself or the template opening it in the prompt. `chat_template_kwargs.enable_thinking:
false` makes the template write an empty `<think></think>` into the prompt: the whole
output is the answer then, reasoning None. Qwen3.5 may open a tool call inside its
thinking without closing it: `<tool_call>` followed by `<function=` ends the reasoning
too, as in vLLM (a `<tool_call>` mentioned in the thinking and not followed so does not).
Only `</think>` starts a structured-output grammar, though."""

from __future__ import annotations

from pagemill.runtime.reasoning.base import ReasoningParser
from pagemill.runtime.tool_calling.parser import held_back

TOOL_CALL, FUNCTION = "<tool_call>", "<function"


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    @property
    def thinking_enabled(self) -> bool:
        return self.chat_template_kwargs.get("enable_thinking", True) is not False

    def _unended(self, body: str, final: bool) -> tuple[str, str]:
        pos = body.find(TOOL_CALL)
        while pos >= 0:
            after = body[pos + len(TOOL_CALL) :].lstrip()
            if after.startswith(FUNCTION):
                return body[:pos], body[pos:]
            if not final and FUNCTION.startswith(after):
                return body[:pos], ""  # undecided until the next token
            pos = body.find(TOOL_CALL, pos + 1)
        if final:
            return body, ""
        hold = max(held_back(body, self.end_token), held_back(body, TOOL_CALL))
        return body[: len(body) - hold], ""
