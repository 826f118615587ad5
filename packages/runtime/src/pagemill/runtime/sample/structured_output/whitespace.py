"""The cap on runs of whitespace in JSON output, kept beside the grammar, not in it.

JSON allows whitespace between any two tokens, and a sampled model can spend every
remaining token on it and end at max_tokens with no value. xgrammar can cap it in the
grammar (`max_whitespace_cnt`), but that turns each gap into one grammar state per
character still allowed, each with its own token mask over the whole vocabulary: on a 49k
vocabulary a two-property schema capped at 32 became a 41 MB compiled grammar (58 MB and
seconds to hand back from a compile worker), a twelve-property one 1.1 GB. The grammar
here allows any whitespace, and this table bans the tokens that would take the current
run of whitespace characters (space, tab, newline, carriage return) past `cap`
characters or past `newline_cap` newlines: 32 characters of blank lines in every gap was
how the default model still rambled to max_tokens (a token per newline).

The run counts whitespace anywhere in the output, inside strings too: a JSON string holds
no raw tab or newline, and 32 spaces in a row there is the same ramble. The grammar never
needs whitespace (every gap may be empty, strings go on with any character), so a row
never loses all its tokens to the cap.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

_WS = b" \t\n\r"
_RUN = re.compile(rb"[ \t\n\r]+")

Run = tuple[int, int]
"""The whitespace a text ends in: (characters, newlines)."""


def _run(ws: bytes) -> Run:
    return len(ws), ws.count(b"\n")


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """A [..., V] bool tensor as xgrammar's token bitmask: int32 words, bit j of word i
    set when token 32 i + j is allowed (V padded with banned tokens)."""
    v = allowed.shape[-1]
    words = (v + 31) // 32
    padded = torch.zeros((*allowed.shape[:-1], words * 32), dtype=torch.int64)
    padded[..., :v] = allowed.to(torch.int64)
    bits = padded.view(*allowed.shape[:-1], words, 32) << torch.arange(32, dtype=torch.int64)
    packed = bits.sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


class WhitespaceCap:
    """Per-token whitespace counts of one vocabulary, and the mask for each run."""

    def __init__(
        self, decoded_vocab: Sequence[bytes], vocab_size: int, cap: int, newline_cap: int
    ) -> None:
        self.cap = cap
        self.newline_cap = newline_cap
        tokens = [bytes(t) for t in decoded_vocab][:vocab_size]
        tokens += [b""] * (vocab_size - len(tokens))  # padding rows of the LM head
        # What a token adds to the run it follows: all of itself when it is whitespace
        # (or empty: padding rows), else its leading whitespace, which ends the run (the
        # run after it is its trailing whitespace); a token that holds a run past the
        # caps further in is never allowed.
        n = len(tokens)
        self._all_ws = [False] * n
        self._need: list[Run] = [(0, 0)] * n
        self._trailing: list[Run] = [(0, 0)] * n
        never = (cap + 1, 0)
        for i, t in enumerate(tokens):
            rest = t.lstrip(_WS)
            lead = t[: len(t) - len(rest)]
            if not rest:
                self._all_ws[i] = True
                self._need[i] = _run(t)
            elif len(rest.translate(None, _WS)) == len(rest):
                self._need[i] = _run(lead)  # most tokens: " word" or "word"
            else:
                inside = [_run(r) for r in _RUN.findall(rest)]
                fits = all(c <= cap and nl <= newline_cap for c, nl in inside)
                self._need[i] = _run(lead) if fits else never
                tail = rest[len(rest.rstrip(_WS)) :]
                self._trailing[i] = _run(tail)
        chars = torch.tensor([c for c, _ in self._need], dtype=torch.int64)
        newlines = torch.tensor([nl for _, nl in self._need], dtype=torch.int64)
        # masks[c][nl]: the tokens allowed after a run of c characters holding nl
        # newlines; None where all are.
        most_chars = int(chars.max()) if n else 0
        most_newlines = int(newlines.max()) if n else 0
        self._masks: list[list[torch.Tensor | None]] = [
            [
                None
                if c + most_chars <= cap and nl + most_newlines <= newline_cap
                else pack_bitmask((chars <= cap - c) & (newlines <= newline_cap - nl))
                for nl in range(newline_cap + 1)
            ]
            for c in range(cap + 1)
        ]

    def mask(self, run: Run) -> torch.Tensor | None:
        """The bitmask row to AND into a row whose output ends in `run`, or None when
        the caps ban nothing there."""
        return self._masks[min(run[0], self.cap)][min(run[1], self.newline_cap)]

    def allows(self, run: Run, token: int) -> bool:
        chars, newlines = self._need[token]
        return run[0] + chars <= self.cap and run[1] + newlines <= self.newline_cap

    def advance(self, run: Run, token: int) -> Run:
        """The run after `token` is emitted."""
        if self._all_ws[token]:
            chars, newlines = self._need[token]
            return run[0] + chars, run[1] + newlines
        return self._trailing[token]
