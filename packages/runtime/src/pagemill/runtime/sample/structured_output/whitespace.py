"""The cap on runs of whitespace in JSON output, kept beside the grammar, not in it.

JSON allows whitespace between any two tokens, and a sampled model can spend every
remaining token on it and end at max_tokens with no value. xgrammar can cap it in the
grammar (`max_whitespace_cnt`), but that turns each gap into one grammar state per
character still allowed, each with its own token mask over the whole vocabulary: on a 49k
vocabulary a two-property schema capped at 32 became a 41 MB compiled grammar (58 MB and
seconds to hand back from a compile worker), a twelve-property one 1.1 GB. The grammar
here allows any whitespace, and this table bans the tokens that would take the current
run of whitespace characters (space, tab, newline, carriage return) past the cap.

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


def _leading(token: bytes) -> int:
    return len(token) - len(token.lstrip(_WS))


def _trailing(token: bytes) -> int:
    return len(token) - len(token.rstrip(_WS))


def _longest_inside(token: bytes) -> int:
    """The longest whitespace run in a token past its leading run."""
    runs = re.findall(rb"[ \t\n\r]+", token[_leading(token) :])
    return max(map(len, runs), default=0)


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
    """Per-token whitespace counts of one vocabulary, and the mask for each run length."""

    def __init__(self, decoded_vocab: Sequence[bytes], vocab_size: int, cap: int) -> None:
        self.cap = cap
        tokens = [bytes(t) for t in decoded_vocab][:vocab_size]
        tokens += [b""] * (vocab_size - len(tokens))  # padding rows of the LM head
        # What a token adds to the run it follows: all of itself when it is whitespace
        # (or empty: special tokens decode to nothing here), else its leading whitespace,
        # which ends the run; a token holding a longer run further in is never allowed.
        n = len(tokens)
        self._all_ws = [False] * n
        self._need = [0] * n
        self._trailing = [0] * n
        for i, t in enumerate(tokens):
            rest = t.lstrip(_WS)
            if not rest:
                self._all_ws[i] = True
                self._need[i] = len(t)
            elif len(rest.translate(None, _WS)) == len(rest):
                self._need[i] = len(t) - len(rest)  # most tokens: " word" or "word"
            else:
                self._need[i] = _leading(t) if _longest_inside(t) <= cap else cap + 1
                self._trailing[i] = _trailing(t)
        need = torch.tensor(self._need, dtype=torch.int64)
        # masks[r]: the tokens allowed after a run of r characters; None where all are.
        self._masks: list[torch.Tensor | None] = []
        longest = int(need.max()) if vocab_size else 0
        for run in range(cap + 1):
            if run + longest <= cap:
                self._masks.append(None)
            else:
                self._masks.append(pack_bitmask(need <= cap - run))

    def mask(self, run: int) -> torch.Tensor | None:
        """The bitmask row to AND into a row whose output ends in `run` whitespace
        characters, or None when the cap bans nothing there."""
        return self._masks[min(run, self.cap)]

    def allows(self, run: int, token: int) -> bool:
        return run + self._need[token] <= self.cap

    def advance(self, run: int, token: int) -> int:
        """The run after `token` is emitted."""
        if self._all_ws[token]:
            return run + self._need[token]
        return self._trailing[token]
