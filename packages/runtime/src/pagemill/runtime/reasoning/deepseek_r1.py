"""DeepSeek-R1 (and its distills): `<think>` … `</think>` then the answer. The chat
template opens `<think>` in the prompt, so the output usually starts inside the
reasoning and only `</think>` appears; an output without it is all reasoning (it was cut
off while thinking)."""

from __future__ import annotations

from pagemill.runtime.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
