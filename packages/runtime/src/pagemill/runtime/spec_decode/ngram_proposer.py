"""Prompt-lookup drafts (vLLM's `ngram` method): when the context's last n tokens occurred
before, guess that what followed them then follows them again.

Input-grounded work (rewriting, summarising, editing code, quoting a document) repeats long
runs of the prompt, and finding them costs a pass over the context on the host, no model.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """The longest suffix n-gram (prompt_lookup_min <= n <= prompt_lookup_max) that occurs
    earlier in the context; of its earlier occurrences the latest, whose next tokens are
    the likeliest continuation (the nearest copy of the text being reproduced)."""

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n or num_speculative_tokens < 1:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, k >= 1")
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int]) -> list[int]:
        """Up to k drafts following the context `token_ids` (none without a match)."""
        num = len(token_ids)
        if num <= self.min_n:
            return []
        arr = np.asarray(token_ids, dtype=np.int64)
        last = num - 1
        # Ends of earlier occurrences of the last token, then of ever longer suffixes: each
        # round keeps the candidates whose preceding token matches too.
        ends = np.flatnonzero(arr[:last] == arr[last])
        best = -1
        length = 1
        while ends.size:
            if length >= self.min_n:
                best = int(ends[-1])
            if length == self.max_n:
                break
            ends = ends[ends >= length]
            ends = ends[arr[ends - length] == arr[last - length]]
            length += 1
        if best < 0:
            return []
        return arr[best + 1 : best + 1 + self.k].tolist()
