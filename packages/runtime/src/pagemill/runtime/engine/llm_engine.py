"""The engine as callers drive it: requests in, outputs out, one `step()` at a time.

`LLMEngine` is the front end over one engine core: the `InputProcessor` (tokenize,
validate, fan out `n`) on the way in, the `OutputProcessor` (text, stop strings, `n > 1`,
logprobs, metrics) on the way out, and between them an `EngineCoreClient` (the core in
this thread by default; see core_client.py). It is driven from a single thread: the
offline `LLM` calls `step()` until done. The server's `AsyncEngine` is the asynchronous
front end over the same pieces.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pagemill.runtime.config import EngineConfig
from pagemill.runtime.engine.core import EngineCore
from pagemill.runtime.engine.core_client import EngineCoreClient, InprocClient
from pagemill.runtime.engine.front_end import ModelFacts
from pagemill.runtime.engine.input_processor import InputProcessor
from pagemill.runtime.engine.model_assets import ModelAssets
from pagemill.runtime.engine.output_processor import IterationStats, OutputProcessor
from pagemill.runtime.engine.protocol import EngineCoreReady, FinishReason, SchedulerStats
from pagemill.runtime.lora.request import LoRARequest
from pagemill.runtime.outputs import EmbeddingRequestOutput, RequestOutput
from pagemill.runtime.pooling_params import PoolingDefaults, PoolingParams
from pagemill.runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics: gauges now, counters since start (tokens, not requests)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_requests_finished: int
    num_blocks: int
    block_size: int
    grammar_cache_bytes: int = 0  # compiled grammars held (structured output)
    # Speculative decoding totals (spec_decode/metrics.py); 0 when off.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    compile_graphs_pending: int = 0  # compiling in the background; steps eager until 0

    @classmethod
    def combine(cls, core: SchedulerStats, out: OutputProcessor) -> EngineStats:
        """The core's gauges with the front end's token counters."""
        return cls(
            core.num_running,
            core.num_waiting,
            core.kv_cache_usage,
            core.prefix_cache_queries,
            core.prefix_cache_hits,
            core.num_preemptions,
            out.prompt_tokens_total,
            out.generation_tokens_total,
            out.num_requests_finished,
            core.num_blocks,
            core.block_size,
            core.grammar_cache_bytes,
            core.spec_num_drafts,
            core.spec_num_draft_tokens,
            core.spec_num_accepted_tokens,
            tuple(core.spec_accepted_per_pos),
            core.compile_graphs_pending,
        )


def make_processors(
    assets: ModelAssets, info: EngineCoreReady, config: EngineConfig | None = None
) -> tuple[InputProcessor, OutputProcessor]:
    """The front end's two halves, for a core that reported `info` (`config`: the engine's
    runner and pooling defaults; without it both generation and embeddings are served)."""
    pooling = PoolingDefaults.load(
        assets.path,
        None if config is None else config.pooler_config,
        getattr(assets.model_config, "hidden_size", None),  # doubles may not know it
    )
    inputs = InputProcessor(
        assets.tokenizer,
        assets.model_config.vocab_size,
        info.max_model_len,
        assets.model_config.eos_token_ids,
        default_max_tokens=assets.generation_defaults.get("max_tokens"),
        max_logprobs=None if config is None else config.max_logprobs,
        runner="auto" if config is None else config.runner,
        pooling_defaults=pooling,
    )
    return inputs, OutputProcessor(assets.tokenizer)


class LLMEngine(ModelFacts):
    """Continuous-batching engine over one model on one device (or a tensor-parallel group)."""

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        if config is None:
            config = EngineConfig.from_kwargs(**kwargs)
        elif kwargs:
            raise TypeError("pass either an EngineConfig or keyword arguments, not both")
        if config.data_parallel_size > 1:
            raise ValueError(
                f"data_parallel_size={config.data_parallel_size} needs engine-core processes: "
                "use `pagemill serve` (with the engine process) or AsyncEngine.launch"
            )
        self.config = config
        self.assets = ModelAssets.load(config)
        core = EngineCore(
            config,
            self.assets.path,
            self.assets.model_config,
            self.assets.structured_output_manager(config),
        )
        self.engine_core_client: EngineCoreClient = InprocClient(core)
        self.input_processor, self.output_processor = make_processors(
            self.assets, self.engine_core_client.info, config
        )
        # The last step's increments (tokens, latencies, finished requests), for metrics.
        self.iteration_stats = IterationStats()

    @classmethod
    def from_config(cls, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(**kwargs))

    @property
    def core_info(self) -> EngineCoreReady:
        return self.engine_core_client.info

    @property
    def engine_core(self) -> EngineCore:
        """The core itself (this engine runs it in its own thread)."""
        client = self.engine_core_client
        assert isinstance(client, InprocClient)
        return client.engine_core

    @property
    def scheduler(self) -> Any:
        return self.engine_core.scheduler

    @property
    def device(self) -> Any:
        return self.engine_core.device

    @property
    def dtype(self) -> Any:
        return self.engine_core.dtype

    # ---- requests ------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | PoolingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request; every problem with it is a ValueError raised here, not later.

        With `PoolingParams` it is an embedding request: its output is an
        `EmbeddingRequestOutput`. `arrival_time` is a `time.monotonic()` reading (the
        server passes the moment the HTTP request arrived); it orders nothing but feeds
        the latency metrics.
        """
        params = SamplingParams() if params is None else params
        if lora_request is not None and not self.config.enable_lora:
            raise ValueError(
                f"lora_request {lora_request.lora_name!r}: this engine serves no LoRA "
                "adapters (start it with enable_lora=True)"
            )
        if isinstance(request_id, str) and self.output_processor.is_known(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = time.monotonic() if arrival_time is None else float(arrival_time)
        processed = self.input_processor.process(
            request_id,
            prompt,
            params,
            priority=priority,
            cache_salt=cache_salt,
            arrival_time=arrival,
            lora_request=lora_request,
        )
        taken = [
            r.request_id
            for r in processed.completions
            if self.output_processor.is_known(r.request_id)
        ]
        if taken:
            raise ValueError(f"request id {request_id!r} collides with running request(s) {taken}")
        self.output_processor.add_request(
            request_id,
            processed.prompt,
            processed.prompt_token_ids,
            params.output_kind,
            arrival,
            processed.completions,
        )
        for request in processed.completions:
            self.engine_core_client.add_request(request)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests now and free their blocks; unknown (e.g. already finished) ids are ignored.

        Each aborted request is reported once more by the next `step()`, finished with
        finish_reason "abort", so a caller waiting on it is released.
        """
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        ids = self.output_processor.abort_requests(request_ids)
        if ids:
            self.engine_core_client.abort_requests(ids)

    def has_unfinished_requests(self) -> bool:
        return (
            self.output_processor.has_unfinished_requests()
            or self.engine_core.has_unfinished_requests()
        )

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    # ---- the step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        """One engine iteration; returns the requests that changed (shaped by output_kind)."""
        core = self.engine_core_client.get_output()
        assert core is not None
        processed = self.output_processor.process_outputs(core.outputs)
        if processed.reqs_to_finish:  # stop strings: the core frees their blocks
            self.engine_core_client.abort_requests(processed.reqs_to_finish, FinishReason.STOP)
        self.iteration_stats = processed.stats
        return processed.request_outputs

    def shutdown(self) -> None:
        """Release what outlives a step: the tensor-parallel workers, when there are any
        (they also stop when the engine is collected or the process exits); idempotent."""
        self.engine_core_client.shutdown()

    # ---- introspection ---------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        return EngineStats.combine(self.engine_core.get_stats(), self.output_processor)
