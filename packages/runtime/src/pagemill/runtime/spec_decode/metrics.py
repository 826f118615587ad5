"""Acceptance counters of speculative decoding, under vLLM's meaning.

A *draft* is one request's proposal verified in one step (vLLM's `num_drafts`); its draft
tokens are counted in `num_draft_tokens` and the accepted ones in `num_accepted_tokens`, and
`accepted_per_pos[i]` counts drafts whose token i was accepted (vLLM's
`num_accepted_tokens_per_pos`). Acceptance rate = accepted / draft tokens; mean accepted
length = 1 + accepted / drafts (the verified step's own token always counts).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Totals since the engine started (counters: a reader takes differences)."""

    num_spec_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's verified draft."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.accepted_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for i in range(num_accepted_tokens):
            per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
