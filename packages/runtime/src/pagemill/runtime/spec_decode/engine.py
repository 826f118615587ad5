"""The engine core's side of speculative decoding: drafts after each step, their
verification in the next, and the acceptance counters."""

from __future__ import annotations

import json
import logging
import threading
from typing import TYPE_CHECKING

import torch

from pagemill.runtime.model_config import ModelConfig
from pagemill.runtime.spec_decode.config import SpeculativeConfig
from pagemill.runtime.spec_decode.metrics import SpecDecodingStats
from pagemill.runtime.spec_decode.proposer import Proposer, ProposerSetup, SpecDecoder

if TYPE_CHECKING:
    from pathlib import Path

    from pagemill.runtime.config import EngineConfig
    from pagemill.runtime.engine.core import EngineCore
    from pagemill.runtime.sample.rejection_sampler import RejectionSampler
    from pagemill.runtime.sample.structured_output.manager import StructuredOutputManager
    from pagemill.runtime.worker.model_runner import ModelRunner, ModelRunnerOutput
    from pagemill.scheduler import Scheduler

logger = logging.getLogger(__name__)


def draft_pool_sizes(
    config: EngineConfig, dtype: torch.dtype, target: ModelConfig
) -> tuple[int, int]:
    """(KV bytes per token, weight bytes) of the draft model or EAGLE head, for sizing the
    target's pool so that both pools (and the draft's weights) fit the budget; (0, 0)
    without one. Read from its config.json and file sizes, before anything loads; an EAGLE
    head that cannot serve this target is refused here, before the pool is built."""
    if config.speculative_config is None:
        return 0, 0
    spec = SpeculativeConfig.from_dict(config.speculative_config)
    if spec.model is None:
        return 0, 0
    from pagemill.runtime.model_executor.loader import resolve_model_path
    from pagemill.runtime.model_executor.weights import safetensors_files

    folder = resolve_model_path(spec.model, None)
    eagle = spec.method in ("eagle", "eagle3")
    if eagle:
        from pagemill.runtime.spec_decode import eagle_checkpoint as ckpt
        from pagemill.runtime.spec_decode.eagle import check_head

        draft = ckpt.head_config(folder)
        names = ckpt.head_tensor_names(folder)
        check_head(spec.method, ckpt.read_head_config(folder), draft, target, names)
        fixed = ckpt.head_weight_bytes(folder)
    else:
        raw = json.loads((folder / "config.json").read_text())
        draft = ModelConfig.from_dict(raw, require_supported=False)
        fixed = sum(f.stat().st_size for f in safetensors_files(folder))
    size = torch.empty((), dtype=dtype).element_size()
    per_token = 2 * draft.num_hidden_layers * draft.num_key_value_heads * draft.head_dim * size
    if eagle:  # the head's scratch blocks (`EagleProposer`)
        from pagemill.runtime.spec_decode.eagle import scratch_blocks_per_request

        block = config.cache.block_size
        per_seq = scratch_blocks_per_request(spec.num_speculative_tokens, block)
        fixed += config.scheduler.max_num_seqs * per_seq * block * per_token
    return per_token, fixed


def prepare_target(config: EngineConfig, runner: ModelRunner, target: ModelConfig) -> None:
    """Before the target is compiled or its CUDA graphs captured: verify steps of k + 1
    tokens per request get graphs of their own (with a draft model or an EAGLE head), and an
    EAGLE-3 head's target layers become outputs of the target's forward, so compiled and
    replayed steps hand them over too. (A target EAGLE cannot serve is left alone: loading
    the head refuses it.)"""
    if config.speculative_config is None or runner.tp is not None:
        return
    spec = SpeculativeConfig.from_dict(config.speculative_config)
    if spec.model is not None:  # a model's drafts are k long (n-gram's vary): graph them
        runner.verify_query_len = spec.num_speculative_tokens + 1
    if spec.method != "eagle3" or spec.model is None:
        return
    from pagemill.runtime.model_executor.loader import resolve_model_path
    from pagemill.runtime.model_executor.models.llama import LlamaForCausalLM
    from pagemill.runtime.spec_decode.eagle import aux_layer_ids
    from pagemill.runtime.spec_decode.eagle_checkpoint import read_head_config

    if type(runner.model) is LlamaForCausalLM:
        raw = read_head_config(resolve_model_path(spec.model, None))
        runner.model.set_aux_hidden_state_layers(aux_layer_ids(raw, target.num_hidden_layers))


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
        # A draft model's or head's own runner (its KV pool's pages are mapped once the
        # engine is ready, as the target's: `start_prefault`).
        self.draft_runner: ModelRunner | None = getattr(proposer, "runner", None)

    def start_prefault(self, gate: threading.Event | None = None) -> None:
        """Map the draft pool's pages in the background (the engine calls this once it is
        ready, after its own pool's, with its idle flag as `gate`; a no-op without a draft
        pool or where it is done)."""
        runner = self.draft_runner
        if runner is not None and runner.kv_cache is not None:
            runner.kv_cache.start_prefault(gate)

    @classmethod
    def create(
        cls,
        config: EngineConfig,
        rejection_sampler: RejectionSampler,
        core: EngineCore | None = None,
        model_path: Path | None = None,
    ) -> SpecDecoding | None:
        """None when speculation is off; a draft model is loaded here (next to the
        target `core`, whose folder is `model_path`)."""
        if config.speculative_config is None:
            return None
        spec = SpeculativeConfig.from_dict(config.speculative_config)
        proposer: Proposer | None = None
        if spec.model is not None:
            assert core is not None and model_path is not None
            if core.tp is not None:
                raise ValueError(
                    f"speculative_config.method={spec.method!r} is single-device for now; "
                    "use tensor_parallel_size=1 or method 'ngram'"
                )
            sched = core.scheduler.config
            setup = ProposerSetup(
                spec.model,
                spec.num_speculative_tokens,
                core.model_config,
                core.device,
                core.dtype,
                config.cache.block_size,
                core.num_blocks,
                sched.max_num_seqs,
                sched.max_num_batched_tokens,
                core.max_model_len,
            )
            if spec.method == "draft_model":
                from pagemill.runtime.spec_decode.draft_model import DraftModelProposer

                proposer = DraftModelProposer.load(
                    setup, target_path=model_path, load_format=config.load_format, seed=config.seed
                )
            else:
                from pagemill.runtime.spec_decode.eagle import EagleProposer

                proposer = EagleProposer.load(
                    spec.method,
                    setup,
                    target_runner=core.model_runner,
                    target_kv=core.kv_cache_manager,
                )
        logger.info(
            "speculative decoding: %s, %d tokens per step", spec.method, spec.num_speculative_tokens
        )
        return cls(spec, rejection_sampler, proposer)

    def after_step(
        self, scheduler: Scheduler, grammars: StructuredOutputManager | None = None
    ) -> None:
        """Propose the running requests' drafts for the next step; a constrained request's
        are cut where its grammar (already past this step's tokens) would reject them."""
        running = scheduler.running
        drafts = self.decoder.propose(running, len(running), {r.request_id for r in running})
        if drafts and grammars is not None and grammars.num_requests:
            drafts = grammars.validate_drafts(drafts)
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
