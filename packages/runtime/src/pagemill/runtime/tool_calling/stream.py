"""Tool calls streamed as they are written, in OpenAI's chat-delta shape.

Each step the parser reads the whole text so far; the streamer sends what grew since the
last step: content, a call's header (`index`, `id`, `type`, `function.name`, empty
arguments) once its name is complete, then pieces of `function.arguments`. Parsers only
report argument text that later tokens cannot change, so the pieces of a call concatenate
to exactly the arguments of the whole answer; `finish` sends whatever the end settled
(the rest of each call, or the held-back text when no call came after all).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pagemill.runtime.tool_calling.parser import ParsedOutput, ToolCall, ToolParser, Tools

logger = logging.getLogger(__name__)


@dataclass
class _Sent:
    call: ToolCall
    arguments: str = ""


@dataclass
class ToolCallStreamer:
    parser: ToolParser
    tools: Tools = None
    max_calls: int | None = None
    """At most this many calls are sent (1 for `parallel_tool_calls: false`)."""
    text: str = ""
    content_sent: int = 0
    sent: list[_Sent] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    """The calls of the whole answer, once `finish` has run."""

    def feed(self, delta: str) -> list[dict[str, Any]]:
        """The deltas `delta` (new text) releases."""
        self.text += delta
        if not delta:
            return []
        return self._diff(self.parser.parse(self.text, self.tools), final=False)

    def finish(self) -> list[dict[str, Any]]:
        """The deltas still owed once the text is complete."""
        parsed = self.parser.parse(self.text, self.tools, final=True)
        if not any(c.complete for c in parsed.calls):
            parsed = ParsedOutput(self.text)  # no call after all: everything is content
        out = self._diff(parsed, final=True)
        return out

    def _limit(self, n: int) -> int:
        return n if self.max_calls is None else min(n, self.max_calls)

    def _diff(self, parsed: ParsedOutput, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if len(parsed.content) > self.content_sent and not self.sent:
            # Content after a call has begun is not sent (as in vLLM's parsers).
            out.append({"content": parsed.content[self.content_sent :]})
            self.content_sent = len(parsed.content)
        calls = parsed.calls[: self._limit(len(parsed.calls))]
        pieces: list[dict[str, Any]] = []
        for i, partial in enumerate(calls):
            if partial.name is None:
                break
            piece: dict[str, Any] = {"index": i}
            if i == len(self.sent):
                call = ToolCall(partial.name, "", self.parser.new_id())
                self.sent.append(_Sent(call))
                piece.update(id=call.id, type="function", function={"name": call.name})
            state = self.sent[i]
            args = partial.arguments
            if not args.startswith(state.arguments):
                # A parser broke its promise; never send text that contradicts what went.
                logger.warning("tool call %d: arguments no longer extend what was streamed", i)
                args = state.arguments
            if len(args) > len(state.arguments) or "id" in piece:
                piece.setdefault("function", {})["arguments"] = args[len(state.arguments) :]
                state.arguments = args
                pieces.append(piece)
        if pieces:
            out.append({"tool_calls": pieces})
        if final:
            self.calls = [
                ToolCall(s.call.name, s.arguments, s.call.id)
                for s, c in zip(self.sent, calls)
                if c.complete
            ]
        return out
