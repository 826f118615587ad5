"""Incremental detokenization with stop strings, one instance per completion.

Decoding each new token alone is wrong twice over: byte-level and byte-fallback vocabularies
split one character over several tokens (each alone decodes to U+FFFD), and some decoders
change a token's text depending on its neighbours (SentencePiece's leading-space rules).
Re-decoding the whole output every step is right but quadratic. The middle way: keep two
offsets into the token list. Text is decoded from a short window starting at
`prefix_offset`; the part of it that lies beyond `read_offset` is the new text, emitted only
once it no longer ends in an incomplete character. Then the window slides forward.

Stop strings are searched only in the region the new text can touch. Text that could still
turn out to be the start of a stop string is kept back from `get_delta`, so a streaming
client never sees characters that are later cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagemill.runtime.sampling_params import SamplingParams

# How many prompt tokens the first window reaches back: enough context for decoders whose
# output for a token depends on what precedes it (leading spaces, byte sequences).
PROMPT_CONTEXT_TOKENS = 5

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, and watches it for stop strings."""

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.stop: list[str] = params.stop_strings
        self.max_stop_len = params.max_stop_len
        self.skip_special_tokens = params.skip_special_tokens
        # The window's context comes from the prompt tail; only these few ids are kept.
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._tokens: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.output_token_ids: list[int] = []
        self.output_text = ""
        self.stop_reason: str | None = None
        self._delta_pos = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Adds tokens; returns the stop string they completed, if any.

        On a stop, `output_text` is cut at the stop string (or just after it with
        include_stop_str_in_output) and later calls change nothing.
        """
        if self.stop_reason is not None or not new_token_ids:
            return None
        self.output_token_ids.extend(new_token_ids)
        self._tokens.extend(new_token_ids)
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._tokens[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            # Nothing new (a skipped special token) or an incomplete character: wait for
            # more tokens; the window keeps growing until the text is whole again.
            return None
        new_text = full_text[len(prefix_text) :]
        old_len = len(self.output_text)
        self.output_text += new_text
        # Slide the window: the next decode starts where this one's new part began.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        # Drop ids the window can no longer reach, so memory stays bounded.
        if self._prefix_offset > 0:
            del self._tokens[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        if self.stop and len(self.output_token_ids) >= self.params.min_tokens:
            return self._check_stop(old_len)
        return None

    def _check_stop(self, old_len: int) -> str | None:
        # A match must end inside the new text, so it starts at most max_stop_len - 1
        # characters before it.
        start = max(0, old_len - self.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.output_text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        index, s = best
        end = index + len(s) if self.params.include_stop_str_in_output else index
        self.output_text = self.output_text[:end]
        self.stop_reason = s
        return s

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        if self.stop_reason is not None or not self.stop:
            return 0
        text = self.output_text
        for k in range(min(self.max_stop_len - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0

    def get_delta(self, finished: bool = False) -> str:
        """Text added since the previous call, minus a tail that may yet become a stop string.

        Pass `finished=True` when the request ended for another reason (EOS, length, abort):
        nothing can match any more, so the held-back tail is released.
        """
        end = len(self.output_text) if finished else len(self.output_text) - self._held_back()
        if end <= self._delta_pos:
            return ""
        delta = self.output_text[self._delta_pos : end]
        self._delta_pos = end
        return delta
