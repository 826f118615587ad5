"""Reasoning for chat (`--reasoning-parser`): the thinking apart from the answer.

The model's text is split by the reasoning parser into reasoning, returned as
`reasoning_content` and `reasoning` (vLLM's older and newer names), and the answer, which
then goes through the tool plan as any answer does. A stream sends the growth of each part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagemill.runtime.reasoning import ReasoningParser
from pagemill.server.entrypoints.openai.serving_tools import ToolPlan, ToolStream


def reasoning_delta(text: str) -> dict[str, Any]:
    return {"reasoning_content": text, "reasoning": text}


@dataclass
class ChoiceStream:
    """One choice's deltas: reasoning first (when a parser reads it), then the answer."""

    plan: ToolPlan
    reasoner: ReasoningParser | None = None
    include_reasoning: bool = True  # False: the reasoning is read (to find the answer), not sent
    text: str = ""
    reasoning_sent: int = 0
    content_fed: int = 0

    def __post_init__(self) -> None:
        self.tools = ToolStream(self.plan)

    @property
    def calls(self) -> list[Any]:
        return self.tools.calls

    def _split(self, final: bool) -> list[dict[str, Any]]:
        assert self.reasoner is not None
        reasoning, content = self.reasoner.split(self.text, final)
        out: list[dict[str, Any]] = []
        if len(reasoning) > self.reasoning_sent:
            if self.include_reasoning:
                out.append(reasoning_delta(reasoning[self.reasoning_sent :]))
            self.reasoning_sent = len(reasoning)
        if len(content) > self.content_fed:
            out += self.tools.feed(content[self.content_fed :])
            self.content_fed = len(content)
        return out

    def feed(self, delta: str) -> list[dict[str, Any]]:
        if self.reasoner is None:
            return self.tools.feed(delta)
        self.text += delta
        return self._split(final=False)

    def finish(self) -> list[dict[str, Any]]:
        out = self._split(final=True) if self.reasoner is not None else []
        return out + self.tools.finish()
