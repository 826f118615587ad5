"""Which requests speculate, and their drafts for the next step.

Every sampled request may speculate; verification stays exact because each verified
position is sampled the way a one-token step there would be: its own history for
penalties, bad words and min_tokens (the drafts before it included,
`rejection_sampler.with_draft_history`), the grammar's state after those drafts for
structured output (`StructuredOutputManager.grammar_bitmasks`), and its own logprob row.
Pooling requests never sample, so they never speculate.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pagemill.runtime.sampling_params import SamplingParams
from pagemill.runtime.spec_decode.config import SpeculativeConfig
from pagemill.runtime.spec_decode.ngram_proposer import NgramProposer
from pagemill.scheduler import Request, RequestStatus

if TYPE_CHECKING:
    import torch

    from pagemill.runtime.model_config import ModelConfig


class Proposer(Protocol):
    def propose_requests(
        self, requests: Sequence[Request], rooms: Sequence[int], live: Collection[str]
    ) -> dict[str, list[int]]:
        """Up to rooms[i] drafts for each request; `live` holds every unfinished id (a
        proposer with per-request state drops the others')."""
        ...


@dataclass(frozen=True)
class ProposerSetup:
    """What a proposer with a model of its own (a draft model, an EAGLE head) is built
    from: its checkpoint, and the target engine's device and limits its runner mirrors."""

    model: str  # speculative_config.model
    num_speculative_tokens: int
    target_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    block_size: int
    num_blocks: int  # the target pool's: a draft's or head's pool has as many
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int

    @property
    def runner_budget(self) -> int:
        """Tokens per forward of the proposer's runner: the target's budget and up to k
        drafts of every request."""
        return self.max_num_batched_tokens + self.max_num_seqs * self.num_speculative_tokens


class NgramRequests:
    """The n-gram proposer over a batch (it needs no state)."""

    def __init__(self, proposer: NgramProposer) -> None:
        self.proposer = proposer

    def propose_requests(
        self, requests: Sequence[Request], rooms: Sequence[int], live: Collection[str]
    ) -> dict[str, list[int]]:
        drafts: dict[str, list[int]] = {}
        for req, room in zip(requests, rooms):
            tokens = self.proposer.propose(req.all_token_ids)[:room]
            if tokens:
                drafts[req.request_id] = tokens
        return drafts


def speculates(request: Request) -> bool:
    """Whether this request may verify drafts (see the module docstring)."""
    return isinstance(request.sampling_params, SamplingParams) and request.pooling_params is None


class SpecDecoder:
    """Drafts for the running requests after each step (vLLM's `propose_draft_token_ids`)."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        self.config = config
        if proposer is None:
            if config.method != "ngram":
                raise ValueError(f"no proposer given for method {config.method!r}")
            proposer = NgramRequests(
                NgramProposer(
                    config.num_speculative_tokens,
                    config.prompt_lookup_min,
                    config.prompt_lookup_max,
                )
            )
        self.proposer = proposer

    def propose(
        self, running: Iterable[Request], num_running: int, live: Collection[str]
    ) -> dict[str, list[int]]:
        cap = self.config.disable_by_batch_size
        if cap and num_running >= cap:
            # No drafts; a proposer with a cache of its own (EAGLE) still reads the step.
            return self.proposer.propose_requests([], [], live)
        k = self.config.num_speculative_tokens
        chosen: list[Request] = []
        rooms: list[int] = []
        for req in running:
            # Decoding (all but the newest token computed) and allowed to speculate.
            if req.status != RequestStatus.RUNNING:
                continue
            if req.num_computed_tokens != req.num_tokens - 1 or not speculates(req):
                continue
            room = k
            if req.max_tokens is not None:  # drafts past max_tokens could never be kept
                room = min(room, req.max_tokens - req.num_output_tokens - 1)
            if room <= 0:
                continue
            chosen.append(req)
            rooms.append(room)
        return self.proposer.propose_requests(chosen, rooms, live)
