"""The loop inside the engine: schedule, execute, sample, update — token ids in, token ids out.

The core knows nothing of text, tokenizers or callers: it owns the device side (model,
KV pool, model runner, sampler) and the scheduler, and each step hands back what changed
per request as `RequestUpdate`s. Everything caller-facing is the output processor's job.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pagemill.blockpool import KVCacheManager
from pagemill.scheduler import Request, RequestStatus, RequestUpdate, Scheduler

from .compilation import ENFORCE_EAGER_ENV, compile_unavailable_reason
from .config import EngineConfig, resolve_dtype, torch_dtype
from .fault_isolation import FaultIsolator, is_unrecoverable
from .kv_cache import size_kv_pool
from .loader import load_model
from .model_config import ModelConfig
from .model_runner import ModelRunner, ModelRunnerOutput
from .output_processor import LogprobsRow
from .sampler import Sampler

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineCoreOutputs:
    updates: list[RequestUpdate]
    # Sampled requests that asked for logprobs: (ids, logprobs), the sampled token first.
    logprobs: dict[str, LogprobsRow] | None
    num_scheduled_tokens: int


def resolve_max_model_len(model_config: ModelConfig, wanted: int | None) -> int:
    """The model's own limit unless a smaller one is asked for.

    Attention here is always over the whole context, so a sliding-window model (Mistral)
    is exact only up to its window: the context is capped there rather than silently
    computing something the model was not trained for.
    """
    limit = model_config.max_position_embeddings
    source = "max_position_embeddings"
    window = model_config.sliding_window
    if window is not None and window < limit:
        limit, source = window, "sliding_window (sliding-window attention is not implemented)"
    if wanted is None:
        if source.startswith("sliding"):
            logger.warning("max_model_len capped to the model's sliding window, %d", limit)
        return limit
    if wanted > limit:
        raise ValueError(f"max_model_len={wanted} exceeds the model's {source}={limit}")
    return wanted


class EngineCore:
    """Continuous batching over one model on one device."""

    def __init__(self, config: EngineConfig, model_path: Path, model_config: ModelConfig) -> None:
        self.config = config
        self.model_config = model_config
        self.device = torch.device(config.resolve_device())
        self.dtype = torch_dtype(
            resolve_dtype(config.dtype, model_config.config_dtype, self.device.type)
        )
        self.max_model_len = resolve_max_model_len(model_config, config.max_model_len)
        # Built before anything heavy so that a bad scheduling flag fails at once.
        scheduler_config = replace(config.scheduler, max_model_len=self.max_model_len)
        cache = config.cache
        torch.manual_seed(config.seed)
        model = load_model(model_path, model_config, self.dtype, self.device, self.max_model_len,
                           config.load_format, config.seed, quantization=config.quantization)
        self.model_runner = ModelRunner(
            model, model_config, self.device, self.dtype, cache.block_size,
            scheduler_config.max_num_seqs, scheduler_config.max_num_batched_tokens,
            self.max_model_len,
        )
        self.num_blocks = size_kv_pool(self.model_runner, model_config, self.dtype, cache,
                                       scheduler_config.max_num_seqs, self.max_model_len)
        self.model_runner.init_kv_cache(self.num_blocks)
        self._maybe_compile()
        self.kv_cache_manager = KVCacheManager(
            self.num_blocks, cache.block_size, enable_caching=cache.enable_prefix_caching,
            hash_algo=cache.prefix_caching_hash_algo,
        )
        self.scheduler = Scheduler(scheduler_config, self.kv_cache_manager)
        self.sampler = Sampler(seed=config.seed)
        self.isolator = FaultIsolator(self.scheduler)

    def _maybe_compile(self) -> None:
        if self.config.enforce_eager or os.environ.get(ENFORCE_EAGER_ENV) == "1":
            logger.info("running the model eagerly (enforce_eager)")
            return
        reason = compile_unavailable_reason(self.device)
        if reason is not None:
            if self.device.type == "cpu":
                logger.warning("running the model eagerly: %s", reason)
            return
        seconds = self.model_runner.compile()
        logger.info("compiled the model forward in %.1f s (inductor; cached for later starts)",
                    seconds)

    # ---- requests ------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def finish_requests(self, request_ids: Iterable[str]) -> None:
        """End requests for a reason found outside the core (a stop string): free their blocks."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the step ------------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        """One iteration: schedule -> execute -> sample -> update.

        A forward or sampling error is contained (see `fault_isolation`): the step is
        undone, the request that causes it is found and finished with finish_reason
        "error", the others carry on. A device error (or one every request hits) is not
        containable and propagates: the caller must stop serving.
        """
        scheduler_output = self.scheduler.schedule()
        try:
            model_output = self.model_runner.execute_model(scheduler_output)
            token_ids, logprobs = self._sample(model_output)
        except Exception as exc:
            if is_unrecoverable(exc):
                raise
            failed = self.isolator.on_step_failed(scheduler_output, exc)
            return EngineCoreOutputs(failed, None, 0)
        updates = self.scheduler.update_from_output(scheduler_output, token_ids)
        self.isolator.on_step_done()
        return EngineCoreOutputs(updates, logprobs, scheduler_output.total_num_scheduled_tokens)

    def _sample(self, out: ModelRunnerOutput) -> tuple[dict[str, int], dict[str, LogprobsRow] | None]:
        if not out.req_ids:
            return {}, None
        assert out.sampling_metadata is not None
        sampled = self.sampler(out.logits, out.sampling_metadata)
        token_ids = dict(zip(out.req_ids, sampled.sampled_token_ids))
        if sampled.logprobs is None or sampled.logprob_token_ids is None:
            return token_ids, None
        return token_ids, dict(zip(out.req_ids, zip(sampled.logprob_token_ids, sampled.logprobs)))
