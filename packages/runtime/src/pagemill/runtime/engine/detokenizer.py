"""Incremental detokenization with stop strings, one instance per completion.

Decoding each new token alone is wrong twice over: byte-level and byte-fallback vocabularies
split one character over several tokens (each alone decodes to U+FFFD), and some decoders
change a token's text depending on its neighbours (SentencePiece's leading-space rules).
Re-decoding the whole output every step is right but quadratic. The middle way keeps a short
window: text is decoded from `prefix_offset`, the part beyond `read_offset` is new, and it is
emitted only once it no longer ends in an incomplete character.

Fast tokenizers do exactly this in Rust (`tokenizers.decoders.DecodeStream`, ~1 µs a token
against ~7 µs for two Python-level decodes), so they use it; any other tokenizer (slow ones,
test doubles, fast ones whose `decode` post-processes spaces) runs the same algorithm here.
Neither keeps the completion's token ids: those live once, on the request.

Stop strings are searched only in the region the new text can touch. Text that could still
turn out to be the start of a stop string is kept back from `get_delta`, so a streaming
client never sees characters that are later cut — this is the only hold-back on the path
to a client.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagemill.runtime.sampling_params import SamplingParams

# How many prompt tokens the first window reaches back: enough context for decoders whose
# output for a token depends on what precedes it (leading spaces, byte sequences).
PROMPT_CONTEXT_TOKENS = 5

REPLACEMENT_CHAR = "\ufffd"


class _WindowDecoder:
    """The offset-window algorithm over `tokenizer.decode`, for any tokenizer."""

    def __init__(self, tokenizer: Any, context: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._tokens = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def step(self, new_token_ids: Sequence[int]) -> str | None:
        self._tokens.extend(new_token_ids)
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._tokens[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            # Nothing new (a skipped special token) or an incomplete character: wait for
            # more tokens; the window keeps growing until the text is whole again.
            return None
        # Slide the window: the next decode starts where this one's new part began, and
        # ids the window can no longer reach are dropped, so memory stays bounded.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        del self._tokens[: self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0
        return full_text[len(prefix_text) :]


class _StreamDecoder:
    """The same algorithm in Rust, through the fast tokenizer's backend."""

    def __init__(self, backend: Any, context: list[int], skip_special_tokens: bool) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = backend
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)

    def step(self, new_token_ids: Sequence[int]) -> str | None:
        ids = new_token_ids[0] if len(new_token_ids) == 1 else list(new_token_ids)
        return self._stream.step(self._backend, ids) or None


def _rust_backend(tokenizer: Any) -> Any | None:
    """The `tokenizers.Tokenizer` behind a fast HF tokenizer whose decode adds nothing to it."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream  # noqa: F401 - needs tokenizers >= 0.21
    except ImportError:
        return None
    return backend if isinstance(backend, Tokenizer) else None


class IncrementalDetokenizer:
    """Turns the tokens of one completion, as they arrive, into text; watches for stop strings."""

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self.params = params
        self.stop: list[str] = params.stop_strings
        self.max_stop_len = params.max_stop_len
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        backend = _rust_backend(tokenizer)
        if backend is not None:
            self._decoder: _WindowDecoder | _StreamDecoder = _StreamDecoder(
                backend, context, params.skip_special_tokens
            )
        else:
            self._decoder = _WindowDecoder(tokenizer, context, params.skip_special_tokens)
        self.num_output_tokens = 0
        self.output_text = ""
        self.stop_reason: str | None = None
        self._delta_pos = 0

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Adds the completion's next tokens; returns the stop string they completed, if any.

        On a stop, `output_text` is cut at the stop string (or just after it with
        include_stop_str_in_output) and later calls change nothing.
        """
        if self.stop_reason is not None or not new_token_ids:
            return None
        self.num_output_tokens += len(new_token_ids)
        new_text = self._decoder.step(new_token_ids)
        if not new_text:
            return None
        old_len = len(self.output_text)
        self.output_text += new_text
        # min_tokens: a stop string may only end the completion once that many tokens exist.
        if self.stop and self.num_output_tokens >= self.params.min_tokens:
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

    @property
    def sent_text(self) -> str:
        """Everything `get_delta` has released so far (the cumulative view of a stream)."""
        return self.output_text[: self._delta_pos]
