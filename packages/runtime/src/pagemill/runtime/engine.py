"""The engine as callers drive it: requests in, outputs out, one `step()` at a time.

`LLMEngine` joins three parts: the `InputProcessor` (tokenize, validate, fan out `n`), the
`EngineCore` (schedule -> execute -> sample -> update, token ids only) and the
`OutputProcessor` (text, stop strings, `n > 1`, logprobs, metrics). It is driven from a
single thread: the offline `LLM` calls `step()` until done, the server calls
`add_request` / `abort_request` / `step` from its engine thread only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .chat_template import apply_chat_template_override
from .config import EngineConfig
from .engine_core import EngineCore
from .generation_defaults import load_generation_defaults
from .input_processor import InputProcessor
from .loader import check_model_folder, load_tokenizer, resolve_model_path
from .model_config import ModelConfig
from .model_source import resolve_tokenizer
from .output_processor import IterationStats, OutputProcessor
from .outputs import RequestOutput
from .sampling_params import SamplingParams
from .structured_output import StructuredOutputManager

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


class LLMEngine:
    """Continuous-batching engine over one model on one device."""

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        if config is None:
            config = EngineConfig.from_kwargs(**kwargs)
        elif kwargs:
            raise TypeError("pass either an EngineConfig or keyword arguments, not both")
        self.config = config
        path = resolve_model_path(config.model, config.revision)
        check_model_folder(path, config.load_format)
        self.model_path = path
        self.model_config = ModelConfig.from_pretrained(path)
        self.tokenizer = load_tokenizer(resolve_tokenizer(config.tokenizer) if config.tokenizer
                                        else str(path))
        apply_chat_template_override(self.tokenizer, config.chat_template)
        # SamplingParams field -> the model's default, for fields a request leaves unset.
        self.generation_defaults = load_generation_defaults(config.generation_config, path)
        eos_ids = InputProcessor.eos_ids(self.tokenizer, self.model_config.eos_token_ids)
        grammars = None
        if self.tokenizer is not None:
            grammars = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                               eos_ids, config.scheduler.max_num_seqs,
                                               config.structured_outputs)
        self.engine_core = EngineCore(config, path, self.model_config, grammars)
        self.max_model_len = self.engine_core.max_model_len
        self.input_processor = InputProcessor(self.tokenizer, self.model_config.vocab_size,
                                              self.max_model_len, self.model_config.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer)
        # The last step's increments (tokens, latencies, finished requests), for metrics.
        self.iteration_stats = IterationStats()

    @classmethod
    def from_config(cls, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(**kwargs))

    @property
    def scheduler(self) -> Any:
        return self.engine_core.scheduler

    @property
    def num_blocks(self) -> int:
        return self.engine_core.num_blocks

    @property
    def device(self) -> Any:
        return self.engine_core.device

    @property
    def dtype(self) -> Any:
        return self.engine_core.dtype

    # ---- requests ------------------------------------------------------------------------

    def get_tokenizer(self) -> Any | None:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation-config defaults (vLLM's name)."""
        return SamplingParams(**self.generation_defaults)

    def encode(self, prompt: str) -> list[int]:
        return self.input_processor.encode(prompt)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                            add_generation_prompt: bool = True, *,
                            chat_template: str | None = None,
                            tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        return self.input_processor.apply_chat_template(
            messages, add_generation_prompt, chat_template=chat_template, tools=tools)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request; every problem with it is a ValueError raised here, not later.

        `arrival_time` is a `time.monotonic()` reading (the server passes the moment the
        HTTP request arrived); it orders nothing but feeds the latency metrics.
        """
        params = SamplingParams() if params is None else params
        if isinstance(request_id, str) and self.output_processor.is_known(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = time.monotonic() if arrival_time is None else float(arrival_time)
        processed = self.input_processor.process(request_id, prompt, params, priority=priority,
                                                 cache_salt=cache_salt, arrival_time=arrival)
        taken = [r.request_id for r, _ in processed.completions
                 if self.output_processor.is_known(r.request_id)]
        if taken:
            raise ValueError(f"request id {request_id!r} collides with running request(s) {taken}")
        self.output_processor.add_request(request_id, processed.prompt, processed.prompt_token_ids,
                                          params.output_kind, arrival, processed.completions)
        for record, _ in processed.completions:
            self.engine_core.add_request(record)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests now and free their blocks; unknown (e.g. already finished) ids are ignored.

        Each aborted request is reported once more by the next `step()`, finished with
        finish_reason "abort", so a caller waiting on it is released.
        """
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self.engine_core.abort_requests(self.output_processor.abort_requests(request_ids))

    def has_unfinished_requests(self) -> bool:
        return (self.output_processor.has_unfinished_requests()
                or self.engine_core.has_unfinished_requests())

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    # ---- the step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns the requests that changed (shaped by output_kind)."""
        core = self.engine_core.step()
        processed = self.output_processor.process_outputs(core.updates, core.logprobs)
        if processed.reqs_to_finish:
            self.engine_core.finish_requests(processed.reqs_to_finish)
        self.iteration_stats = processed.stats
        return processed.request_outputs

    def shutdown(self) -> None:
        """Release what outlives a step: the tensor-parallel workers, when there are any
        (they also stop when the engine is collected or the process exits); idempotent."""
        self.engine_core.shutdown()

    # ---- introspection ---------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        s = self.engine_core.scheduler.get_stats()
        out = self.output_processor
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_cache_usage=s.kv_cache_usage,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            prompt_tokens_total=out.prompt_tokens_total,
            generation_tokens_total=out.generation_tokens_total,
            num_requests_finished=out.num_requests_finished,
            num_blocks=self.engine_core.num_blocks,
            block_size=self.config.cache.block_size,
            grammar_cache_bytes=(self.engine_core.structured_output.cache_bytes
                                 if self.engine_core.structured_output is not None else 0),
        )
