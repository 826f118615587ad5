"""The engine loop: schedule, forward, sample, update, detokenize — one step at a time.

`LLMEngine` owns every per-request object (sampling state, detokenizer, metrics) and is
driven from a single thread: the offline `LLM` calls `step()` until done, the server calls
`add_request` / `abort_request` / `step` from its engine thread only.

A request with `n > 1` is run as `n` child requests over the same prompt: the prefix cache
shares the prompt's full blocks between them, so the copies cost little more than their
own generated tokens; their outputs are gathered back into one `RequestOutput`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagemill.blockpool import KVCacheManager
from pagemill.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig

from .config import EngineConfig, ModelConfig, resolve_dtype
from .detokenizer import IncrementalDetokenizer
from .kv_cache import bytes_per_token, cpu_num_blocks, cuda_num_blocks
from .loader import check_model_folder, load_model, resolve_model_path
from .model_runner import ModelRunner
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampler import Sampler, make_generator
from .sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


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


@dataclass
class _Sequence:
    """One completion (child request): what the sampler and the detokenizer need of it."""

    seq_id: str
    index: int
    parent: _Parent
    params: SamplingParams
    prompt_token_ids: list[int]
    generator: torch.Generator | None
    eos_token_id: list[int]
    detokenizer: IncrementalDetokenizer | None
    output_token_ids: list[int] = field(default_factory=list)
    # Text released so far: never includes a tail that a stop string may still cut, so a
    # streaming caller can diff successive outputs and never has to take text back.
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    children: list[_Sequence] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[c.completion() for c in self.children],
            finished=self.finished,
            metrics=self.metrics,
        )


class LLMEngine:
    """Continuous-batching engine over one model on one device."""

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        if config is None:
            config = EngineConfig(**kwargs)
        elif kwargs:
            raise TypeError("pass either an EngineConfig or keyword arguments, not both")
        self.config = config
        self.device = config.resolve_device()
        path = resolve_model_path(config.model)
        check_model_folder(path, config.load_format)
        self.model_path = path
        self.model_config = ModelConfig.from_pretrained(path)
        self.dtype = resolve_dtype(config.dtype, self.model_config.config_dtype, self.device)
        self.max_model_len = self._resolve_max_model_len()
        # Built before anything heavy so that a bad scheduling flag fails at once.
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            enable_chunked_prefill=config.enable_chunked_prefill,
            enable_prefix_caching=config.enable_prefix_caching,
            policy=config.scheduling_policy,
        )
        self.tokenizer = self._load_tokenizer(config.tokenizer or str(path))
        torch.manual_seed(config.seed)

        model = load_model(
            path, self.model_config, self.dtype, self.device, self.max_model_len, config.load_format, config.seed
        )
        self.runner = ModelRunner(
            model,
            self.model_config,
            self.device,
            self.dtype,
            config.block_size,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
        )
        self.num_blocks = self._size_kv_pool()
        self.runner.init_kv_cache(self.num_blocks)
        self.kv_cache_manager = KVCacheManager(
            self.num_blocks, config.block_size, enable_caching=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(scheduler_config, self.kv_cache_manager)
        self.sampler = Sampler(seed=config.seed)
        self._parents: dict[str, _Parent] = {}
        self._seqs: dict[str, _Sequence] = {}
        self._pending_outputs: list[RequestOutput] = []
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._num_finished = 0

    @classmethod
    def from_config(cls, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig(**kwargs))

    # ---- start-up ------------------------------------------------------------------------

    def _resolve_max_model_len(self) -> int:
        """The model's own limit unless a smaller one is asked for.

        Attention here is always over the whole context, so a sliding-window model (Mistral)
        is exact only up to its window: the context is capped there rather than silently
        computing something the model was not trained for.
        """
        limit = self.model_config.max_position_embeddings
        source = "max_position_embeddings"
        window = self.model_config.sliding_window
        if window is not None and window < limit:
            limit, source = window, "sliding_window (sliding-window attention is not implemented)"
        wanted = self.config.max_model_len
        if wanted is None:
            if source.startswith("sliding"):
                logger.warning("max_model_len capped to the model's sliding window, %d", limit)
            return limit
        if wanted > limit:
            raise ValueError(f"max_model_len={wanted} exceeds the model's {source}={limit}")
        return wanted

    def _load_tokenizer(self, path: str) -> Any | None:
        """The folder's tokenizer, or None: a model without one can still serve token ids."""
        from transformers import AutoTokenizer

        folder = Path(path)
        if folder.is_dir() and not any((folder / f).is_file() for f in _TOKENIZER_FILES):
            logger.info("%s has no tokenizer; only token-id prompts will work", path)
            return None
        try:
            return AutoTokenizer.from_pretrained(path)
        except Exception as e:  # no tokenizer files, or ones transformers cannot read
            logger.warning("no usable tokenizer in %s (%s); only token-id prompts will work", path, e)
            return None

    def _size_kv_pool(self) -> int:
        cfg = self.config
        per_token = bytes_per_token(self.model_config, self.dtype)
        if self.device.type == "cuda" and cfg.kv_cache_memory_bytes is None:
            peak = self.runner.profile_peak_memory()
            num_blocks = cuda_num_blocks(
                self.model_config, self.dtype, cfg.block_size, self.device, peak, cfg.gpu_memory_utilization
            )
            logger.info("profiled activation peak: %.1f MiB", peak / 2**20)
        else:
            num_blocks = cpu_num_blocks(
                self.model_config, self.dtype, cfg.block_size, cfg.kv_cache_memory_bytes,
                cfg.max_num_seqs, self.max_model_len,
            )
        needed = -(-self.max_model_len // cfg.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks ({num_blocks * cfg.block_size} tokens, "
                f"{per_token} bytes/token) but one max_model_len={self.max_model_len} request needs "
                f"{needed} blocks; raise kv_cache_memory_bytes / gpu_memory_utilization or lower max_model_len"
            )
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %s)",
            num_blocks, cfg.block_size, num_blocks * cfg.block_size,
            num_blocks * cfg.block_size * per_token / 2**20, str(self.dtype).removeprefix("torch."),
        )
        return num_blocks

    # ---- requests ------------------------------------------------------------------------

    def get_tokenizer(self) -> Any | None:
        return self.tokenizer

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer: pass prompts as lists of token ids")
        return list(self.tokenizer.encode(prompt))

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation through the tokenizer's own chat template."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate() with a plain prompt")
        text = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=False
        )
        # The template already writes every special token it wants; don't add a second BOS.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

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
        """Queue a request; every problem with it is a ValueError raised here, not later."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text: str | None = prompt
            if not prompt:
                raise ValueError("the prompt is empty")
            prompt_ids = self.encode(prompt)
        else:
            text = None
            prompt_ids = list(prompt)
            vocab = self.model_config.vocab_size
            bad = [t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids must be ints in [0, {vocab}); got {bad[:5]}")
        if not prompt_ids:
            raise ValueError("the prompt is empty (it encodes to no tokens)")
        n_prompt = len(prompt_ids)
        if n_prompt > self.max_model_len - 1:
            raise ValueError(
                f"the prompt has {n_prompt} tokens; at most max_model_len - 1 = {self.max_model_len - 1} "
                "fit (one position is needed for the first generated token)"
            )
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - n_prompt
        elif n_prompt + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) = {n_prompt + max_tokens} "
                f"exceeds max_model_len={self.max_model_len}; lower max_tokens to at most "
                f"{self.max_model_len - n_prompt}"
            )
        if params.min_tokens > max_tokens:
            raise ValueError(f"min_tokens={params.min_tokens} exceeds the {max_tokens} tokens that fit")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model folder has none")
        seq_ids = [request_id] if params.n == 1 else [f"{request_id}[{i}]" for i in range(params.n)]
        taken = [s for s in seq_ids if s in self._seqs]
        if taken:
            raise ValueError(f"request id {request_id!r} collides with running request(s) {taken}")

        eos_ids = list(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in eos_ids:
            eos_ids.append(self.tokenizer.eos_token_id)
        now = time.monotonic()
        parent = _Parent(
            request_id, text, prompt_ids, params,
            RequestMetrics(arrival_time=now if arrival_time is None else arrival_time),
        )
        requests = []
        for i, seq_id in enumerate(seq_ids):
            child = params if params.n == 1 else params.child_params(i)
            seq = _Sequence(
                seq_id=seq_id,
                index=i,
                parent=parent,
                params=child,
                prompt_token_ids=prompt_ids,
                generator=None if child.seed is None else make_generator(child.seed, self.device),
                eos_token_id=[] if child.ignore_eos else eos_ids,
                detokenizer=None if self.tokenizer is None else IncrementalDetokenizer(self.tokenizer, prompt_ids, child),
                logprobs=None if child.logprobs is None else [],
                cumulative_logprob=None if child.logprobs is None else 0.0,
            )
            parent.children.append(seq)
            # Extra EOS ids (Llama 3 lists several) act as stop tokens, unless EOS is ignored.
            stop_ids = list(child.stop_token_ids)
            if not child.ignore_eos:
                stop_ids += [t for t in eos_ids[1:] if t not in stop_ids]
            requests.append(
                Request(
                    seq_id,
                    prompt_ids,
                    max_tokens=max_tokens,
                    min_tokens=child.min_tokens,
                    eos_token_id=eos_ids[0] if eos_ids else None,
                    stop_token_ids=stop_ids,
                    ignore_eos=child.ignore_eos,
                    priority=priority,
                    cache_salt=cache_salt,
                )
            )
        self._parents[request_id] = parent
        for seq, req in zip(parent.children, requests):
            self._seqs[seq.seq_id] = seq
            self.scheduler.add_request(req)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests now and free their blocks; unknown (e.g. already finished) ids are ignored.

        Each aborted request is reported once more by the next `step()`, finished with
        finish_reason "abort", so a caller waiting on it is released.
        """
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
            live = [c for c in parent.children if c.finish_reason is None]
            self.scheduler.abort_requests([c.seq_id for c in live])
            for c in parent.children:
                self._seqs.pop(c.seq_id, None)
                if c.finish_reason is None:
                    c.finish_reason = "abort"
                    if c.detokenizer is not None:
                        c.text += c.detokenizer.get_delta(finished=True)
            parent.metrics.finished_time = time.monotonic()
            self._num_finished += 1
            self._pending_outputs.append(parent.output())

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents) or bool(self._pending_outputs) or self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ---- the step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduling iteration; returns the requests that changed (cumulative outputs)."""
        outputs = self._pending_outputs
        self._pending_outputs = []
        sched_out = self.scheduler.schedule()
        now = time.monotonic()
        sampled: dict[str, int] = {}
        rows: dict[str, int] = {}
        sample_out = None
        if sched_out.scheduled:
            for s in sched_out.scheduled:
                seq = self._seqs.get(s.request_id)
                if seq is None:
                    continue
                m = seq.parent.metrics
                if m.first_scheduled_time is None:
                    m.first_scheduled_time = now
                    req = self.scheduler.get_request(s.request_id)
                    if req is not None:
                        m.num_cached_tokens = req.num_cached_tokens
            run_out = self.runner.execute_model(sched_out)
            if run_out.req_ids:
                states = [self._seqs[r] for r in run_out.req_ids]
                sample_out = self.sampler(run_out.logits, states)
                sampled = dict(zip(run_out.req_ids, sample_out.token_ids))
                rows = {r: i for i, r in enumerate(run_out.req_ids)}
        updates = self.scheduler.update_from_output(sched_out, sampled)
        now = time.monotonic()
        changed: dict[str, _Parent] = {}
        for upd in updates:
            seq = self._seqs.get(upd.request_id)
            if seq is None:
                continue
            parent = seq.parent
            changed[parent.request_id] = parent
            m = parent.metrics
            if upd.new_token_ids:
                if m.first_token_time is None:
                    m.first_token_time = now
                    self._prompt_tokens_total += len(parent.prompt_token_ids)
                m.last_token_time = now
                self._generation_tokens_total += len(upd.new_token_ids)
                seq.output_token_ids.extend(upd.new_token_ids)
                if seq.logprobs is not None and sample_out is not None and upd.request_id in rows:
                    self._record_logprobs(seq, sample_out, rows[upd.request_id])
            stop_str = seq.detokenizer.update(upd.new_token_ids) if seq.detokenizer is not None else None
            if stop_str is not None:
                seq.finish_reason = "stop"
                seq.stop_reason = stop_str
                if not upd.finished:
                    self.scheduler.finish_requests([seq.seq_id], RequestStatus.FINISHED_STOPPED)
            elif upd.finished:
                seq.finish_reason = "length" if upd.finish_reason == "ignored" else upd.finish_reason
                seq.stop_reason = upd.stop_reason
            if seq.detokenizer is not None:
                seq.text += seq.detokenizer.get_delta(finished=seq.finish_reason is not None)
            if seq.finish_reason is not None:
                del self._seqs[seq.seq_id]
        for rid, parent in changed.items():
            if parent.finished:
                parent.metrics.finished_time = now
                del self._parents[rid]
                self._num_finished += 1
            outputs.append(parent.output())
        return outputs

    def _record_logprobs(self, seq: _Sequence, out: Any, row: int) -> None:
        token = seq.output_token_ids[-1]
        entry: dict[int, float] = {}
        if out.logprobs is not None:
            entry[token] = float(out.logprobs[row])
        top = out.top_logprobs[row] if out.top_logprobs else None
        for t, lp in top or ():
            entry.setdefault(int(t), float(lp))
        assert seq.logprobs is not None
        seq.logprobs.append(entry)
        if seq.cumulative_logprob is not None and token in entry:
            seq.cumulative_logprob += entry[token]

    # ---- introspection ---------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        s = self.scheduler.get_stats()
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_cache_usage=s.kv_cache_usage,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            num_requests_finished=self._num_finished,
            num_blocks=self.num_blocks,
            block_size=self.config.block_size,
        )
