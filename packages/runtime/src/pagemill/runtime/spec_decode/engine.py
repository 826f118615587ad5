"""The engine core's side of speculative decoding: drafts after each step, their
verification in the next, and the acceptance counters."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pagemill.runtime.spec_decode.config import SpeculativeConfig
from pagemill.runtime.spec_decode.metrics import SpecDecodingStats
from pagemill.runtime.spec_decode.proposer import Proposer, SpecDecoder

if TYPE_CHECKING:
    from pagemill.runtime.config import EngineConfig
    from pagemill.runtime.sample.rejection_sampler import RejectionSampler
    from pagemill.runtime.worker.model_runner import ModelRunnerOutput
    from pagemill.scheduler import Scheduler

logger = logging.getLogger(__name__)


class SpecDecoding:
    def __init__(
        self,
        config: SpeculativeConfig,
        rejection_sampler: RejectionSampler,
        proposer: Proposer | None = None,
    ) -> None:
        self.config = config
        self.decoder = SpecDecoder(config, proposer)
        self.rejection_sampler = rejection_sampler
        self.stats = SpecDecodingStats(num_spec_tokens=config.num_speculative_tokens)

    @classmethod
    def create(
        cls,
        config: EngineConfig,
        rejection_sampler: RejectionSampler,
        proposer: Proposer | None = None,
    ) -> SpecDecoding | None:
        if config.speculative_config is None:
            return None
        spec = SpeculativeConfig.from_dict(config.speculative_config)
        logger.info(
            "speculative decoding: %s, %d tokens per step", spec.method, spec.num_speculative_tokens
        )
        return cls(spec, rejection_sampler, proposer)

    def after_step(self, scheduler: Scheduler) -> None:
        """Propose the running requests' drafts for the next step."""
        drafts = self.decoder.propose(scheduler.running, len(scheduler.running))
        if drafts:
            scheduler.update_draft_token_ids(drafts)

    def verify(self, out: ModelRunnerOutput, bonus: list[int]) -> dict[str, list[int]]:
        """The tokens of the requests that verified drafts (accepted drafts + one)."""
        spec = out.spec
        assert spec is not None
        n = len(out.req_ids)
        results = self.rejection_sampler(
            out.logits[n:], spec.metadata, spec.draft_token_ids, [bonus[i] for i in spec.indices]
        )
        stats = self.stats
        tokens: dict[str, list[int]] = {}
        for i, drafts, result in zip(spec.indices, spec.draft_token_ids, results):
            stats.observe(len(drafts), len(result) - 1)
            tokens[out.req_ids[i]] = result
        return tokens
