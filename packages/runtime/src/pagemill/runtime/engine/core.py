"""The loop inside the engine: schedule, execute, sample, update — token ids in, token ids out.

The core knows nothing of text or callers: it owns the device side (model, KV pool, model
runner, sampler), the scheduler, the grammar matchers and fault isolation. Requests come in
as `EngineCoreRequest`s and each step hands back an `EngineCoreOutputs` (protocol.py). It
runs wherever an `EngineCoreClient` puts it: in the caller's thread, on a thread of its
own, or in its own process; everything caller-facing is the front end's job.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pagemill.blockpool import HybridKVCacheManager, KVCacheManager
from pagemill.runtime.config import EngineConfig, resolve_dtype, torch_dtype
from pagemill.runtime.distributed.parallel_state import TensorParallelGroup
from pagemill.runtime.distributed.sharding import ShardLayout, check_tensor_parallel
from pagemill.runtime.engine.fault_isolation import FaultIsolator
from pagemill.runtime.engine.kv_events import KVEventsHook
from pagemill.runtime.engine.protocol import (
    FINISH_REASONS,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    FinishReason,
    PromptLogprobsRows,
    SchedulerStats,
)
from pagemill.runtime.lora.manager import LoRAManager
from pagemill.runtime.model_config import ModelConfig
from pagemill.runtime.model_executor.kv_scales import (
    apply_checkpoint_kv_scales,
    configure_kv_scale_granularity,
)
from pagemill.runtime.model_executor.layers import Linear
from pagemill.runtime.model_executor.loader import load_model
from pagemill.runtime.sample.rejection_sampler import RejectionSampler, with_draft_history
from pagemill.runtime.sample.sampler import Sampler
from pagemill.runtime.sample.structured_output import grammar_failure_message
from pagemill.runtime.spec_decode.engine import SpecDecoding, draft_pool_sizes, prepare_target
from pagemill.runtime.worker.compilation import (
    ENFORCE_EAGER_ENV,
    CompileCache,
    compile_cache_enabled,
    compile_cached,
    compile_unavailable_reason,
)
from pagemill.runtime.worker.kv_cache import kv_cache_groups, kv_sliding_window, size_kv_pool
from pagemill.runtime.worker.model_runner import (
    ModelRunner,
    ModelRunnerOutput,
    apply_first_call_checks,
    compile_cache_has_entry,
)
from pagemill.scheduler import Request, RequestStatus, RequestUpdate, Scheduler, SchedulerConfig

if TYPE_CHECKING:
    from pagemill.runtime.distributed.launcher import TensorParallelWorkers
    from pagemill.runtime.sample.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)

# Set to 0 to compile before ready even on a cold start (`EngineConfig.compile_in_background`).
COMPILE_BACKGROUND_ENV = "PAGEMILL_COMPILE_BACKGROUND"

# Per sampled request: ([sampled id, top-1 id, ...], [their logprobs]).
LogprobsRow = tuple[list[int], list[float]]


def _logprob_rows(
    logprobs: dict[str, list[LogprobsRow]], update: RequestUpdate
) -> list[LogprobsRow] | None:
    """The rows of the tokens the update emits (a stop inside a verified step's tokens
    drops the rest, and their rows with them)."""
    rows = logprobs.get(update.request_id)
    return None if rows is None else rows[: len(update.new_token_ids)]


def _skips_prefix_cache(request: EngineCoreRequest) -> bool:
    """Whether the request needs an output at prompt positions a prefix-cache hit would
    skip: prompt logprobs, or a pooling type other than LAST. Like vLLM, such a request
    computes its whole prompt (and still leaves its blocks in the cache for others)."""
    if request.sampling_params.prompt_logprobs is not None:
        return True
    params = request.pooling_params
    return params is not None and params.skip_reading_prefix_cache


def resolve_max_model_len(model_config: ModelConfig, wanted: int | None) -> int:
    """The model's own limit unless a smaller one is asked for.

    A sliding-window model (Mistral, Gemma, Phi-3) is not capped at its window: attention
    masks each windowed layer to its window, so contexts past it are computed as the
    model defines them.
    """
    limit = model_config.max_model_len_limit  # beyond max_position_embeddings with yarn
    if wanted is None:
        return limit
    if wanted > limit:
        own = model_config.max_position_embeddings
        by = f"{own}, extended by its RoPE scaling to {limit}" if limit > own else str(limit)
        raise ValueError(f"max_model_len={wanted} exceeds the model's max_position_embeddings={by}")
    return wanted


class EngineCore:
    """Continuous batching over one model on one device — or, with tensor_parallel_size
    N > 1, over N ranks of which this process is rank 0 (see `distributed`): the scheduler,
    the block pool and the sampler stay here; the model runner broadcasts each step."""

    def __init__(
        self,
        config: EngineConfig,
        model_path: Path,
        model_config: ModelConfig,
        structured_output: StructuredOutputManager | None = None,
    ) -> None:
        self.config = config
        # Grammars of structured-output requests; None when the model has no tokenizer.
        self.structured_output = structured_output
        # Requests whose grammar still compiles, in arrival order: they reach the
        # scheduler once it is ready, so nobody else waits for a compile.
        self._waiting_for_grammar: dict[str, Request] = {}
        self._grammar_failures: list[RequestUpdate] = []
        self.model_config = model_config
        self.device = torch.device(config.resolve_device())
        self.dtype = torch_dtype(
            resolve_dtype(config.dtype, model_config.config_dtype, self.device.type)
        )
        self.max_model_len = resolve_max_model_len(model_config, config.max_model_len)
        # Built before anything heavy so that a bad scheduling flag fails at once.
        scheduler_config = replace(config.scheduler, max_model_len=self.max_model_len)
        cache = config.cache
        self.tp: TensorParallelGroup | None = None
        self._workers: TensorParallelWorkers | None = None
        # A cold start's compile, started once the core is built (see `_maybe_compile`).
        self._background_compile: CompileCache | None = None
        if config.tensor_parallel_size > 1:
            # Refused before any process starts: a split the heads do not allow.
            check_tensor_parallel(model_config, config.tensor_parallel_size)
            self._start_workers(config, model_path, model_config, scheduler_config)
        try:
            self._build_model(config, model_path, model_config, scheduler_config)
        except BaseException:
            self.shutdown()
            raise
        groups = self.model_runner.kv_cache_groups
        self.kv_cache_manager: KVCacheManager | HybridKVCacheManager
        if groups is not None:
            self.kv_cache_manager = HybridKVCacheManager(
                self.num_blocks,
                cache.block_size,
                groups,
                enable_caching=cache.enable_prefix_caching,
                hash_algo=cache.prefix_caching_hash_algo,
            )
        else:
            self.kv_cache_manager = KVCacheManager(
                self.num_blocks,
                cache.block_size,
                enable_caching=cache.enable_prefix_caching,
                hash_algo=cache.prefix_caching_hash_algo,
                sliding_window=kv_sliding_window(model_config, cache, self.num_blocks),
            )
        self.scheduler = Scheduler(scheduler_config, self.kv_cache_manager)
        self._kv_events = KVEventsHook.create(config, self.kv_cache_manager)
        self.sampler = Sampler(seed=config.seed)
        runner = self.model_runner
        if self.device.type == "cpu" and self._sampler_native():
            pass  # nothing to trace; built (or loaded) now, so the first step does not wait
        elif self.device.type == "cpu" and (
            runner.compiled or self._background_compile is not None
        ):
            # As the model: not when eager. Before a background compile starts: only one
            # thread compiles at a time.
            # For fp32 logits only (one graph per kernel): rows with penalties, bans or a
            # grammar are converted to fp32 anyway, and converting the rest costs less
            # than compiling a second set of graphs at every start.
            from pagemill.runtime.sample import row_kernels

            apply_first_call_checks()
            seconds, loaded = compile_cached(
                "sampler row kernels",
                {"vocab": runner.vocab_size, "dtypes": (torch.float32,)},
                [Path(row_kernels.__file__)],
                lambda: self.sampler.compile(runner.vocab_size, self.device, (torch.float32,)),
            )
            how = "loaded from the compile cache" if loaded else "compiled"
            logger.info("%s the sampler's row kernels in %.1f s", how, seconds)
        self.isolator = FaultIsolator(self.scheduler)
        # Speculative decoding (None when off): drafts after each step, verified in the next.
        self.spec = SpecDecoding.create(
            config, RejectionSampler(self.sampler, config.seed), self, model_path
        )
        if self._background_compile is not None:  # last: nothing else compiles from here
            runner.start_background_compile(self._background_compile, self.num_blocks)
        # Set while no request is in the engine: the KV pools' pages are mapped in the
        # background only then (`KVStorage.prefault`).
        self.idle = threading.Event()
        self.idle.set()
        if runner.kv_cache is not None:
            runner.kv_cache.start_prefault(self.idle)
        if self.spec is not None:
            self.spec.start_prefault(self.idle)
        if self.tp is not None:  # the workers' pools too (the watcher may be running)
            from pagemill.runtime.distributed.worker import PREFAULT

            tp = self.tp
            with tp.exclusive():
                self._collective(lambda: tp.broadcast_object(PREFAULT))

    def _sampler_native(self) -> bool:
        """Whether the sampler's native CPU passes serve here (then no graph is traced for
        it, eager or compiled)."""
        from pagemill.kernels import sampler_cpu

        if sampler_cpu.load() is None:  # switched off, or no compiler (logged)
            return False
        seconds = self.sampler.compile(self.model_runner.vocab_size, self.device, (torch.float32,))
        logger.info("sampler: native CPU passes ready in %.1f s", seconds)
        return True

    def _start_workers(
        self,
        config: EngineConfig,
        model_path: Path,
        model_config: ModelConfig,
        scheduler_config: SchedulerConfig,
    ) -> None:
        from pagemill.runtime.distributed.launcher import TensorParallelWorkers
        from pagemill.runtime.distributed.worker import WorkerSpec

        workers = TensorParallelWorkers.start(config.tensor_parallel_size, self.device)
        self._workers = workers
        self.tp = workers.tp
        self.device = workers.tp.device
        # Stopped with the engine, or when it is collected, or at exit.
        self._finalizer = weakref.finalize(self, workers.shutdown)
        spec = WorkerSpec(
            str(model_path),
            model_config,
            self.dtype,
            self.max_model_len,
            config.load_format,
            config.seed,
            config.cache.block_size,
            scheduler_config.max_num_seqs,
            scheduler_config.max_num_batched_tokens,
            config.runner == "pooling",
        )
        try:
            self._collective(lambda: workers.tp.broadcast_object(spec))
        except BaseException:
            self.shutdown()
            raise

    def _collective(self, fn: Callable[[], object]) -> object:
        """Run a start-up collective; a failure names the worker that caused it."""
        assert self.tp is not None
        try:
            return fn()
        except Exception as exc:
            raise self.tp.failure(exc) from exc

    def _build_model(
        self,
        config: EngineConfig,
        model_path: Path,
        model_config: ModelConfig,
        scheduler_config: SchedulerConfig,
    ) -> None:
        """Load the model (this rank's shard under TP), size and bind the KV pool, compile."""
        from pagemill.runtime.distributed.worker import PROFILE, InitKVCache

        cache = config.cache
        if self.device.type == "cpu":
            from pagemill.kernels.prebuild import prebuild

            prebuild()  # the CPU kernels' libraries build side by side while the model loads
        torch.manual_seed(config.seed)
        model = load_model(
            model_path,
            model_config,
            self.dtype,
            self.device,
            self.max_model_len,
            config.load_format,
            config.seed,
            quantization=config.quantization,
            tp=self.tp,
            pooling_only=config.runner == "pooling",
            cpu_dense_weights=config.cpu_dense_weights,
            # fp32 because the CPU has no bf16 arithmetic, not because it was asked for: a
            # GGUF's rows stay packed for the few-row steps (their kernels take fp32), the
            # exact dense fp32 weights serve large batches. An explicit float32 is exact.
            gguf_packed_fp32=config.dtype == "auto" and self.dtype == torch.float32,
        )
        # Under TP the runner (and the pool's bytes per token) see this rank's heads.
        local_config = model_config
        if self.tp is not None:
            layout = ShardLayout.create(model_config, self.tp.world_size, self.tp.rank)
            local_config = layout.local_config(model_config)
        self.model_runner = ModelRunner(
            model,
            local_config,
            self.device,
            self.dtype,
            cache.block_size,
            scheduler_config.max_num_seqs,
            scheduler_config.max_num_batched_tokens,
            self.max_model_len,
            tp=self.tp,
            vocab_size=model_config.vocab_size,
        )
        if config.enable_lora:  # before the pool is sized: the slots take device memory
            self.model_runner.lora = LoRAManager(
                model,
                config.max_loras,
                config.max_lora_rank,
                config.max_cpu_loras or config.max_loras,
                scheduler_config.max_num_batched_tokens,
                self.dtype,
                self.device,
            )
        # Per-group block tables for models mixing full and windowed layers; single-rank
        # and eager for now (the decode graphs and TP workers know one table).
        groups = kv_cache_groups(local_config, cache)
        if groups is not None and (self.tp is not None or self._cuda_graphs_wanted()):
            logger.info("KV cache groups are single-rank and eager for now: one table kept")
            groups = None
        self.model_runner.kv_cache_groups = groups
        self.model_runner.use_cuda_graphs = self._cuda_graphs_wanted()
        if cache.kv_cache_dtype != "auto" and self.tp is not None:
            raise ValueError(
                f"kv_cache_dtype={cache.kv_cache_dtype!r} is single-device for now; "
                "use kv_cache_dtype='auto' with tensor_parallel_size > 1"
            )
        self.model_runner.kv_cache_dtype = cache.kv_cache_dtype
        tp = self.tp
        if tp is not None and self.device.type == "cuda" and cache.kv_cache_memory_bytes is None:
            self._collective(lambda: tp.broadcast_object(PROFILE))  # they profile with us
        # Per rank: every rank holds the same blocks, each with its own KV heads. A draft
        # model's or EAGLE head's pool (as many blocks) shares the budget.
        draft_per_token, draft_weights = draft_pool_sizes(config, self.dtype, model_config)
        prepare_target(config, self.model_runner, model_config)  # before compile and capture
        self.num_blocks = size_kv_pool(
            self.model_runner,
            local_config,
            self.dtype,
            cache,
            scheduler_config.max_num_seqs,
            self.max_model_len,
            groups,
            draft_per_token,
            draft_weights,
        )
        if tp is not None:
            num_blocks = self.num_blocks
            self._collective(lambda: tp.broadcast_object(InitKVCache(num_blocks)))
        # The pool's pages are mapped once the engine is ready (end of __init__).
        self.model_runner.init_kv_cache(self.num_blocks, prefault=False)
        configure_kv_scale_granularity(  # per-layer or per-head scales: before compiling
            self.model_runner.kv_cache,
            model_path if config.load_format != "dummy" else None,
            cache,
            model_config.num_key_value_heads,
        )
        self._maybe_compile()
        if self.model_runner.use_cuda_graphs:
            seconds = self.model_runner.capture_cuda_graphs()
            graphs = self.model_runner.graphs
            assert graphs is not None
            logger.info(
                "captured CUDA graphs for decode batches of %s in %.2f s "
                "(--enforce-eager skips this)",
                graphs.buckets,
                seconds,
            )
        kv_cache = self.model_runner.kv_cache
        if config.load_format != "dummy":  # fp8 checkpoints' k_scale / v_scale
            apply_checkpoint_kv_scales(
                kv_cache,
                model_path,
                cache,
                model_config.num_hidden_layers,
                model_config.num_key_value_heads,
            )
        if cache.calculate_kv_scales and kv_cache is not None:
            # After warm-up and capture, so the scales come from the first real prefill.
            kv_cache.calculate_scales_on_next_forward()
        if self._workers is not None:
            self._workers.start_watching()

    def on_worker_failure(self, handler: Callable[[Exception], None]) -> None:
        """Call `handler` (from another thread) if a tensor-parallel worker dies between
        steps; without one, the next step raises `TensorParallelError`."""
        if self._workers is not None:
            self._workers.on_failure = handler

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (if any); idempotent. A single-device engine
        holds nothing that needs stopping; a background compile still running is stopped
        (after the graph it is on)."""
        job = getattr(getattr(self, "model_runner", None), "background", None)
        if job is not None:
            job.cancel()
        if self._workers is not None:
            self._finalizer()
        hook = getattr(self, "_kv_events", None)
        if hook is not None:
            hook.shutdown()

    def _eager_forced(self) -> bool:
        return self.config.enforce_eager or os.environ.get(ENFORCE_EAGER_ENV) == "1"

    def _cuda_graphs_wanted(self) -> bool:
        """Decode steps replay CUDA graphs on a single CUDA device unless eager is forced."""
        if self.device.type != "cuda" or self._eager_forced():
            return False
        if self.tp is not None:
            logger.info("tensor parallel: no CUDA graphs (single-rank for now)")
            return False
        if self.config.enable_lora:
            logger.info("LoRA: no CUDA graphs (the adapter mapping is not captured yet)")
            return False
        return True

    def _maybe_compile(self) -> None:
        if self.tp is not None:
            logger.info(
                "tensor parallel: running the model eagerly (the compiled step is "
                "single-rank for now)"
            )
            return
        if self._eager_forced():
            logger.info("running the model eagerly (enforce_eager)")
            return
        reason = compile_unavailable_reason(self.device)
        if reason is not None:
            if self.device.type == "cpu":
                logger.warning("running the model eagerly: %s", reason)
            return
        runner = self.model_runner
        cache = None
        if self._compile_in_background():
            cache = runner.open_compile_cache()
            if not compile_cache_has_entry(cache):
                # The warm-up's blocks stay out of the pool: they are written while
                # requests hold the others.
                self.num_blocks -= runner.warm_up_blocks()
                self._background_compile = cache
                logger.info(
                    "compile cache: no entry %s (cold start): serving eagerly while the "
                    "forward compiles in the background (--no-compile-in-background or "
                    "%s=0 compiles first)",
                    cache.folder,
                    COMPILE_BACKGROUND_ENV,
                )
                return
        seconds = runner.compile(cache)
        how = (
            "loaded from the compile cache"
            if self.model_runner.compile_cache_loaded
            else "compiled"
        )
        logger.info("%s the model forward in %.1f s (--enforce-eager skips this)", how, seconds)

    def _compile_in_background(self) -> bool:
        """Whether a cold start may compile beside the serving steps: on, with the compile
        cache (what the thread fills for the next start), and none of what the background
        warm-up does not keep apart from live requests (LoRA's step mapping, speculative
        decoding's hooks, KV scales taken from the first prefill, per-group tables), and
        a pool that still holds a full-length request without the warm-up's blocks.

        While dynamo compiles, `torch.compiler.is_compiling()` is True process-wide, so the
        serving thread's eager forward takes the layers' compiled-graph branches: the same
        kernels through their custom ops, except `torch.cond` (the "cond" packed/dense
        branch), which would compile on the serving thread; it compiles first instead."""
        config = self.config
        if not config.compile_in_background or os.environ.get(COMPILE_BACKGROUND_ENV) == "0":
            return False
        if not compile_cache_enabled():
            return False
        runner = self.model_runner
        full = -(-self.max_model_len // config.cache.block_size)
        return not (
            config.enable_lora
            or config.speculative_config is not None
            or config.cache.calculate_kv_scales
            or runner.kv_cache_groups is not None
            or Linear.compiled_branch == "cond"
            or self.num_blocks - runner.warm_up_blocks() < full
        )

    def wait_for_compile(self, timeout: float | None = None) -> bool:
        """Wait until a background compile has ended; whether the compiled forward is (or
        will be, from the next step) the one in use. True at once when nothing compiles
        in the background (then `model_runner.compiled` says whether it is compiled)."""
        job = self.model_runner.background
        return True if job is None else job.wait(timeout)

    @classmethod
    def from_config(cls, config: EngineConfig) -> EngineCore:
        """Build a core from its config alone (what a core process receives): the model
        folder and its config. The tokenizer serves grammars only, so it loads (with
        xgrammar and the grammar workers) in the background while the model loads
        (`prestart`); a core process waits for that before it reports ready
        (`wait_prestarted`), so nothing of its start is left to slow the first steps."""
        from pagemill.runtime.engine.model_assets import ModelAssets

        assets = ModelAssets.load(config, tokenizer=False)
        grammars = assets.structured_output_manager(config, deferred=True)
        if grammars is not None:
            grammars.prestart()
        return cls(config, assets.path, assets.model_config, grammars)

    def ready_message(self) -> EngineCoreReady:
        """What the front end learns once the core is built."""
        return EngineCoreReady(
            self.max_model_len,
            self.num_blocks,
            self.config.cache.block_size,
            str(self.dtype),
            str(self.device),
            os.getpid(),
        )

    # ---- requests ------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue one completion. The front end validated it: a problem found here is a bug
        on that side, and the request fails alone (finish_reason "error")."""
        lora = request.lora_request
        lora_runner = self.model_runner.lora
        if lora is not None:
            if lora_runner is None:
                raise ValueError("this engine serves no LoRA adapters (enable_lora=False)")
            lora_runner.add_adapter(lora)  # reads and checks it the first time
        record = Request(
            request.request_id,
            request.prompt_token_ids,
            max_tokens=request.max_tokens,
            min_tokens=request.sampling_params.min_tokens,
            eos_token_id=request.eos_token_id,
            stop_token_ids=request.stop_token_ids,
            ignore_eos=request.sampling_params.ignore_eos,
            priority=request.priority,
            arrival_time=request.arrival_time,
            cache_salt=request.cache_salt,
            sampling_params=request.sampling_params,
            pooling_params=request.pooling_params,
            skip_reading_prefix_cache=_skips_prefix_cache(request),
            lora_int_id=0 if lora is None else lora.lora_int_id,
        )
        constraint = request.sampling_params.structured_outputs
        if constraint is not None:
            if self.structured_output is None:
                raise ValueError("structured output needs a tokenizer, and this model has none")
            self.structured_output.add_request(record.request_id, constraint)
            self._waiting_for_grammar[record.request_id] = record
            return
        self.scheduler.add_request(record)

    def abort_requests(
        self, request_ids: Iterable[str], reason: FinishReason = FinishReason.ABORT
    ) -> None:
        """End requests now and free their blocks: the caller left (ABORT), or the front end
        found a stop string (STOP). Unknown or finished ids are ignored."""
        ids = list(request_ids)
        self._drop_grammar_state(ids)
        status = (
            RequestStatus.FINISHED_STOPPED
            if reason == FinishReason.STOP
            else RequestStatus.FINISHED_ABORTED
        )
        self.scheduler.finish_requests(ids, status)

    def _drop_grammar_state(self, request_ids: list[str]) -> None:
        if self.structured_output is not None:
            for rid in request_ids:
                self._waiting_for_grammar.pop(rid, None)
            self.structured_output.remove_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or bool(self._waiting_for_grammar)
            or bool(self._grammar_failures)
        )

    @property
    def num_waiting_for_grammar(self) -> int:
        return len(self._waiting_for_grammar)

    def get_stats(self) -> SchedulerStats:
        s = self.scheduler.get_stats()
        spec = None if self.spec is None else self.spec.stats
        return SchedulerStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting + len(self._waiting_for_grammar),
            kv_cache_usage=s.kv_cache_usage,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            num_blocks=self.num_blocks,
            block_size=self.config.cache.block_size,
            grammar_cache_bytes=(
                0 if self.structured_output is None else self.structured_output.cache_bytes
            ),
            spec_num_drafts=0 if spec is None else spec.num_drafts,
            spec_num_draft_tokens=0 if spec is None else spec.num_draft_tokens,
            spec_num_accepted_tokens=0 if spec is None else spec.num_accepted_tokens,
            spec_accepted_per_pos=[] if spec is None else list(spec.accepted_per_pos),
            compile_graphs_pending=(
                0 if self.model_runner.background is None else self.model_runner.background.pending
            ),
        )

    # ---- the step ------------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        self.idle.clear()
        out = self._step()
        if self._kv_events is not None:
            self._kv_events.after_step(out)
        if not self.scheduler.has_unfinished_requests():
            self.idle.set()
        return out

    def _step(self) -> EngineCoreOutputs:
        """One iteration: schedule -> execute -> sample -> update.

        A forward or sampling error is contained (see `fault_isolation`): the step is
        undone, the request that causes it is found and finished with finish_reason
        "error", the others carry on. A device error (or one every request hits) is not
        containable and propagates: the caller must stop serving.
        """
        if self._waiting_for_grammar:
            self._admit_compiled()
        scheduler_output = self.scheduler.schedule()
        try:
            model_output = self.model_runner.execute_model(scheduler_output)
            token_ids, logprobs = self._sample(model_output)
        except Exception as exc:
            # Undone and isolated; re-raised there when not containable (device errors).
            failed = self.isolator.on_step_failed(scheduler_output, exc)
            if self.structured_output is not None and failed:
                self.structured_output.remove_requests([u.request_id for u in failed])
            return EngineCoreOutputs(self._outputs(failed, None, {}))
        sampled = token_ids
        if model_output.pooled:
            # A pooled request ends with its prompt: a placeholder token meets its
            # max_tokens of 1 (it never reaches the caller, see `_outputs`).
            sampled = {**token_ids, **dict.fromkeys(model_output.pooled, 0)}
        updates = self.scheduler.update_from_output(scheduler_output, sampled)
        self.isolator.on_step_done()
        if self.structured_output is not None and self.structured_output.num_requests:
            updates = self._advance_grammars(token_ids, updates)
        if self.spec is not None:  # after the grammars moved: drafts are cut by them
            self.spec.after_step(self.scheduler, self.structured_output)
        if self._grammar_failures:
            updates = self._grammar_failures + updates
            self._grammar_failures = []
        records = {s.request_id: s.request for s in scheduler_output.scheduled}
        return EngineCoreOutputs(
            self._outputs(
                updates, logprobs, records, model_output.pooled, model_output.prompt_logprobs
            ),
            num_scheduled_tokens=scheduler_output.total_num_scheduled_tokens,
        )

    @staticmethod
    def _outputs(
        updates: list[RequestUpdate],
        logprobs: dict[str, list[LogprobsRow]] | None,
        records: dict[str, Request],
        pooled: dict[str, list[float]] | None = None,
        prompt_logprobs: dict[str, PromptLogprobsRows] | None = None,
    ) -> list[EngineCoreOutput]:
        """The scheduler's updates in the protocol's shape; a request's first tokens carry
        its first-scheduled time and prefix hit for the front end's metrics."""
        outputs = []
        for u in updates:
            reason = None
            if u.finished:
                assert u.finish_reason is not None  # a finished update names its reason
                reason = FINISH_REASONS[u.finish_reason]
            out = EngineCoreOutput(
                u.request_id,
                u.new_token_ids,
                reason,
                u.stop_reason,
                None if logprobs is None else _logprob_rows(logprobs, u),
            )
            if pooled is not None and u.request_id in pooled:
                # The vector replaces the placeholder token; it ends the request normally.
                out.pooled = pooled[u.request_id]
                out.new_token_ids = []
                out.finish_reason = FinishReason.STOP
                out.stop_reason = None
            if prompt_logprobs is not None:
                out.prompt_logprobs = prompt_logprobs.get(u.request_id)
            record = records.get(u.request_id)
            if record is not None and (
                out.pooled is not None
                or (u.new_token_ids and record.num_output_tokens == len(u.new_token_ids))
            ):
                out.first_scheduled_time = record.first_scheduled_time
                out.num_cached_tokens = record.num_cached_tokens
            outputs.append(out)
        return outputs

    def _admit_compiled(self) -> None:
        """Hand the scheduler the requests whose grammar is ready, in arrival order.

        When nothing else could run this step, wait briefly for a compile instead of
        spinning through empty steps.
        """
        manager = self.structured_output
        assert manager is not None
        waiting = self._waiting_for_grammar
        if not self.scheduler.has_unfinished_requests():
            manager.wait_any(waiting, timeout=0.01)
        for rid in [r for r in waiting if manager.is_ready(r)]:
            request = waiting.pop(rid)
            error = manager.error(rid)
            if error is not None:
                manager.remove_requests([rid])
                logger.error("request %s: grammar compilation failed: %s", rid, error)
                # "error", never a cut-off: the client must not read an empty 200 as output.
                self._grammar_failures.append(
                    RequestUpdate(rid, [], True, "error", grammar_failure_message(error))
                )
                continue
            manager.start(rid)
            self.scheduler.add_request(request)

    def _advance_grammars(
        self, token_ids: dict[str, int | list[int]], updates: list[RequestUpdate]
    ) -> list[RequestUpdate]:
        """Move each matcher past its tokens; a finished grammar ends its request (stop),
        and a verified step's tokens after the one that finished it are not output."""
        manager = self.structured_output
        assert manager is not None
        done = manager.accept_tokens(token_ids)
        ended: list[str] = []
        for i, u in enumerate(updates):
            if u.finished:
                ended.append(u.request_id)
            elif u.request_id in done:
                ended.append(u.request_id)
                kept = u.new_token_ids[: done[u.request_id]]
                updates[i] = RequestUpdate(u.request_id, kept, True, "stop", None)
                self.scheduler.finish_requests([u.request_id], RequestStatus.FINISHED_STOPPED)
        manager.remove_requests(ended)
        return updates

    def _sample(
        self, out: ModelRunnerOutput
    ) -> tuple[dict[str, int | list[int]], dict[str, list[LogprobsRow]] | None]:
        """One token per request; a request that verified drafts maps to its accepted
        drafts and one more token instead (a list, see `Scheduler.update_from_output`).
        The logprobs (when a row asked for them) are one row per emitted token."""
        if not out.req_ids:
            return {}, None
        assert out.sampling_metadata is not None
        metadata = out.sampling_metadata
        if out.spec is not None:  # each verified position sees the drafts before it
            metadata, out.spec.metadata = with_draft_history(
                metadata, out.spec.metadata, out.spec.indices, out.spec.draft_token_ids
            )
        if self.structured_output is not None and self.structured_output.num_requests:
            spec = out.spec
            indices, drafts = ((), ()) if spec is None else (spec.indices, spec.draft_token_ids)
            bitmask, draft_mask = self.structured_output.grammar_bitmasks(
                out.req_ids, indices, drafts
            )
            if bitmask is not None:
                metadata = replace(metadata, token_bitmask=bitmask)
            if spec is not None and draft_mask is not None:
                spec.metadata = replace(spec.metadata, token_bitmask=draft_mask)
        logits = out.logits if out.spec is None else out.logits[: len(out.req_ids)]
        sampled = self.sampler(logits, metadata)
        token_ids: dict[str, int | list[int]] = dict(zip(out.req_ids, sampled.sampled_token_ids))
        verified: dict[str, list[int]] = {}
        if out.spec is not None:
            assert self.spec is not None
            verified = self.spec.verify(out, sampled.sampled_token_ids)
            token_ids.update(verified)
        if sampled.logprobs is None or sampled.logprob_token_ids is None:
            return token_ids, None
        rows = [[row] for row in zip(sampled.logprob_token_ids, sampled.logprobs)]
        step = out.spec
        if step is not None and step.metadata.max_num_logprobs is not None:
            assert self.spec is not None
            # A verified request's rows: its drafts' rows, then the bonus row if it got
            # that far (a rejected draft's correction came from the draft rows).
            results = [verified[out.req_ids[i]] for i in step.indices]
            draft_rows = self.spec.rejection_sampler.logprobs(
                out.logits[len(out.req_ids) :], step.metadata, step.draft_token_ids, results
            )
            for i, result, head in zip(step.indices, results, draft_rows):
                rows[i] = head + rows[i] if len(result) > len(head) else head
        return token_ids, dict(zip(out.req_ids, rows))
