"""Turns a `SchedulerOutput` into one forward pass over the flattened batch.

Every scheduled token of every request is laid end to end (no padding): prefill chunks and
single decode tokens mix freely. What a step needs beyond the token ids is built once, here,
and read by everything downstream: the per-token positions and KV slots, the attention plan
(shared by all layers) and the sampling metadata (shared with the sampler). Per-request
state persists across steps in the `InputBatch`, so a step only writes what changed.

With KV cache groups (`kv_cache_groups`: a model mixing full-attention and windowed layers)
every group has its own block tables, so the slots and the attention plan are built per
group and each layer reads its group's (`AttentionMetadata.groups`).
"""

from __future__ import annotations

import atexit
import copy
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagemill.blockpool import KVCacheGroupSpec
from pagemill.blockpool.kv_cache_groups import layer_group
from pagemill.kernels import AttentionPlan, cpu_native, plan_attention
from pagemill.kernels.attention_cpu import TorchPlan
from pagemill.runtime.distributed.parallel_state import TensorParallelGroup
from pagemill.runtime.model_config import ModelConfig
from pagemill.runtime.model_executor.layers import Linear, packed_row_limits
from pagemill.runtime.model_executor.layers.prepacked import prepack_dense_weights
from pagemill.runtime.model_executor.models.llama import ForwardOutput, LlamaForCausalLM
from pagemill.runtime.sample.sampling_metadata import SamplingMetadata
from pagemill.runtime.sampling_params import SamplingParams
from pagemill.runtime.switches import env_switch
from pagemill.runtime.worker.attention_metadata import AttentionMetadata
from pagemill.runtime.worker.compilation import (
    CompileCache,
    compile_cache_enabled,
    compile_cache_key,
    compile_forward,
    model_trace_config,
)
from pagemill.runtime.worker.cuda_graphs import DecodeGraphs, cache_shape, measure_graph_memory
from pagemill.runtime.worker.decode_padding import graph_buckets, verify_buckets
from pagemill.runtime.worker.input_batch import CachedRequestState, InputBatch
from pagemill.runtime.worker.kv_cache import KVCache, shared_window
from pagemill.runtime.worker.pooler import PromptOutputs, PromptWork, wants_prompt_outputs
from pagemill.scheduler import Request, ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:
    from pagemill.runtime.engine.protocol import PromptLogprobsRows
    from pagemill.runtime.lora.manager import LoRAManager

logger = logging.getLogger(__name__)

# Set to 1 to run torch's check that no custom op's output aliases its inputs on the first
# call of every compiled graph (the warm-up step), as torch does by default; the test suites
# set it, and under CI=1 torch makes a violation an error. Off by default: the check runs
# every op of the graph once through a Python dispatch mode, a second or more on a small
# machine, for a check of pagemill's own ops that their tests make.
OP_ALIASING_CHECK_ENV = "PAGEMILL_CHECK_OP_ALIASING"


def op_aliasing_check_enabled() -> bool:
    """`PAGEMILL_CHECK_OP_ALIASING` (0 or 1; unset: off); any other value is refused."""
    return env_switch(OP_ALIASING_CHECK_ENV, default=False)


def apply_first_call_checks() -> None:
    """torch's first-call aliasing check of custom ops, on or off as
    `PAGEMILL_CHECK_OP_ALIASING` says, for the whole process (torch's own setting).

    Process-wide, not around the warm-up alone: torch counts a graph's first call as done
    only once it has run the check, so a check skipped in the warm-up ran in the first
    request's step instead."""
    import torch._functorch.config as functorch_config

    functorch_config.check_custom_op_aliasing = op_aliasing_check_enabled()


@dataclass(slots=True)
class ModelRunnerOutput:
    """Logits of the rows that sample this step, in the order of `req_ids`, and their metadata;
    the outputs at prompt positions of requests whose prompt completed this step."""

    req_ids: list[str]
    logits: torch.Tensor  # [len(req_ids), vocab], model dtype
    sampling_metadata: SamplingMetadata | None
    # Pooling requests (which do not sample): their finished vectors.
    pooled: dict[str, list[float]] | None = None
    prompt_logprobs: dict[str, PromptLogprobsRows] | None = None
    # Requests verifying drafts this step: their draft rows follow the rows of `req_ids`.
    spec: SpecStep | None = None


@dataclass(slots=True)
class SpecStep:
    """The step's draft verification: for each request with drafts (its index in
    `req_ids`), its drafts; their logit rows come after one row per `req_ids` entry,
    request after request, and `metadata` has one row per draft row."""

    indices: list[int]
    draft_token_ids: list[Sequence[int]]
    metadata: SamplingMetadata


@dataclass(slots=True)
class StepBatch:
    """A step's token layout on the host: all a rank needs to run the forward.

    Under tensor parallelism rank 0 broadcasts this (and only this: no request records, no
    sampling state) to the other ranks each step.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [n + 1] int32
    seq_lens: np.ndarray  # [n] int64
    block_tables: np.ndarray  # [n, width] int32
    query_lens: np.ndarray  # [n] int64
    # Hidden rows that produce logits (prompt-logprob rows first, then the sampled ones);
    # None when every token of the step samples (decode).
    sample_indices: torch.Tensor | None
    num_samples: int  # logit rows
    # KV cache groups 1.. (group 0's are `slots` and `block_tables`); None: one group.
    group_slots: list[np.ndarray] | None = None
    group_block_tables: list[np.ndarray] | None = None


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    # Hidden rows that produce logits; None when every token of the step samples (decode).
    sample_indices: torch.Tensor | None
    sample_req_ids: list[str]
    sampling_metadata: SamplingMetadata | None
    batch: StepBatch | None = None


@dataclass(slots=True, eq=False, weakref_slot=True)  # held weakly by `_RUNNING_COMPILES`
class BackgroundCompile:
    """A compile of the forward on a thread of its own while the engine serves eagerly
    (`ModelRunner.start_background_compile`); the serving thread reads it between steps."""

    total: int  # graphs to build
    done: int = 0
    # Set by the compiling thread once every graph is ready; adopted by the next step.
    forward: Callable[..., ForwardOutput] | None = None
    failed: bool = False
    thread: threading.Thread | None = None
    # Set by `cancel`: the compiling thread stops before its next graph.
    cancelled: bool = False

    @property
    def pending(self) -> int:
        """Graphs not yet ready (0 once finished, or failed: then nothing more comes)."""
        return 0 if self.failed or self.forward is not None else self.total - self.done

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end; whether it did (and the compile did not fail)."""
        if self.thread is not None:
            self.thread.join(timeout)
            if self.thread.is_alive():
                return False
        return not self.failed

    def cancel(self) -> None:
        """Stop compiling and wait for the thread to end (it finishes the graph it is on).

        Called at shutdown and at interpreter exit: a daemon thread still inside torch's C++
        when Python finalizes is ended by `pthread_exit`, whose unwinding through C++ code
        aborts the whole process ("terminate called without an active exception", exit
        status 134) after the user's program has finished."""
        self.cancelled = True
        thread = self.thread
        if thread is None or not thread.is_alive() or thread is threading.current_thread():
            return
        logger.info("compile: stopping the background compile (after its current graph)")
        thread.join()


class _CompileCancelled(Exception):
    """Raised on the compiling thread between graphs once its job is cancelled."""


# Background compiles still running: `_cancel_background_compiles` stops them at exit.
_RUNNING_COMPILES: weakref.WeakSet[BackgroundCompile] = weakref.WeakSet()


@atexit.register
def _cancel_background_compiles() -> None:
    for job in list(_RUNNING_COMPILES):
        job.cancel()


def compile_cache_has_entry(cache: CompileCache) -> bool:
    """Whether `cache` holds an entry to load (a warm start) rather than nothing yet."""
    return (cache.folder / "dynamo").is_dir()


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        model_config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        tp: TensorParallelGroup | None = None,
        vocab_size: int | None = None,
    ) -> None:
        """Under tensor parallelism (`tp`) `model_config` is this rank's share of the model
        (its heads size the KV cache and the attention plan) and `vocab_size` the full
        vocabulary, whose logits are gathered on rank 0."""
        self.model = model
        self.tp = tp
        self.vocab_size = model_config.vocab_size if vocab_size is None else vocab_size
        self.model_config = model_config
        # Every layer's one sliding window (0: none or mixed): see `drop_blocks_before`.
        self._shared_window = shared_window(model_config)
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = math.ceil(max_model_len / block_size)
        self.kv_cache: KVCache | None = None
        # CacheConfig.kv_cache_dtype, set by the engine before the pool is sized.
        self.kv_cache_dtype = "auto"
        self.input_batch = InputBatch(max_num_seqs, self.max_blocks_per_seq, device)
        # Set by the engine before the pool is sized (None: one table for every layer).
        self.kv_cache_groups: list[KVCacheGroupSpec] | None = None
        # Live requests (running or preempted) until they finish; rows come and go.
        self.requests: dict[str, CachedRequestState] = {}
        self._arange = np.arange(max(max_num_seqs, max_num_batched_tokens), dtype=np.int64)
        # A decode-only step's query start locations and lengths (`_decode_layout`): the
        # same for every such step, so sliced from these instead of rebuilt (nothing writes
        # into a StepBatch's arrays; torch.from_numpy would warn about read-only ones).
        self._decode_qsl = np.arange(max_num_seqs + 1, dtype=np.int32)
        self._decode_q_lens = np.ones(max_num_seqs, dtype=np.int64)
        self._pin = device.type == "cuda"
        # On CPU the tensors are used where they are built; tests may force packing on.
        self.pack_inputs = device.type != "cpu"
        self._staging: torch.Tensor | None = None
        self._copy_done: torch.cuda.Event | None = None
        # Seconds spent in the model's forward (and LM head) by the last step; the rest of a
        # step is host overhead (scheduling, planning, sampling, detokenizing).
        self.last_forward_s = 0.0
        self._forward: Callable[..., ForwardOutput] = model.forward
        self.compiled = False
        # The compile cache of the last `compile()` (None when off) and whether it loaded.
        self.compile_cache: CompileCache | None = None
        self.compile_cache_loaded = False
        # A compile running beside the serving steps (None: none was started).
        self.background: BackgroundCompile | None = None
        # CUDA graphs of pure-decode steps (see `cuda_graphs`); None runs every step eagerly.
        self.graphs: DecodeGraphs | None = None
        # Set by the engine before the pool is sized: capture graphs once the pool exists.
        self.use_cuda_graphs = False
        # Set by speculative decoding before then: k + 1, whose verify steps get graphs too.
        self.verify_query_len = 0
        # Pooling and prompt logprobs across chunks; the current step's share of them.
        self.prompt_outputs = PromptOutputs()
        self._prompt_work: PromptWork | None = None
        # Set by the engine when it serves LoRA adapters: slots and each step's mapping.
        self.lora: LoRAManager | None = None
        self._spec_step: SpecStep | None = None
        # Set by an EAGLE proposer: sees each eager/compiled single-device step's batch and
        # final hidden states (the proposer turns CUDA graphs off).
        self.hidden_states_hook: Callable[[SchedulerOutput, torch.Tensor], None] | None = None
        # Before the pool is sized (the twins take memory) and before any graph is keyed.
        if device.type == "cpu":
            prepack_dense_weights(model)
        # The last step's inputs of the model's `aux_hidden_state_layers` (EAGLE-3), if any.
        self.aux_hidden_states: torch.Tensor | None = None
        # The attention layers' decode buffers (`_bind_decode_buffers`): block tables per KV
        # cache group and the context lengths; None without the C++ decode operator.
        self._decode_tables: list[torch.Tensor] | None = None
        self._decode_lens: torch.Tensor | None = None
        # Whether every attention layer runs a compiled decode-only step on the C++ decode
        # operator (`_bind_decode_buffers`): such steps then skip the attention plan, and
        # write group 0's table and the lengths through these numpy views of the buffers.
        self._plan_free_decode = False
        self._decode_views: tuple[np.ndarray, np.ndarray] | None = None

    # Decode-only steps take the lean host path (`_decode_layout`, `_plan_free_inputs`):
    # a batch-1 step's host work runs after ~100 MB of weights went through the caches, so
    # every distinct numpy and torch call on it costs a cache refill. Off (on an instance)
    # only to measure it (`benchmarks/step_ab.py --variant host-layout-before`).
    decode_fast_path = True

    def compile(self, cache: CompileCache | None = None) -> float:
        """Compile the forward (see `compilation`) and build its graphs now; returns seconds.

        Every graph (one token; any other count; each side of a packed layer's dense
        switch, see `packed_row_limits`) is compiled on a throwaway single-request step, so
        no request ever waits for a compilation. With the compile cache on, a start whose
        key was compiled before loads the graphs instead (`compile_cache_loaded`); an entry
        that breaks is logged, removed and compiled again. `cache`: this runner's, when
        the caller opened it already (`open_compile_cache`).
        """
        start = time.perf_counter()
        self.compile_cache = None
        self.compile_cache_loaded = False
        self._warm_up_on_small_pages(0)
        if not compile_cache_enabled():
            self._forward = compile_forward(self.model)
            with model_trace_config():
                self._warm_up_graphs()
            return time.perf_counter() - start
        cache = self.compile_cache = cache if cache is not None else self.open_compile_cache()
        existed = compile_cache_has_entry(cache)
        logger.info(
            "compile cache: %s entry %s (%s)",
            "loading" if existed else "no",
            cache.folder,
            "warm start" if existed else "cold start: tracing and compiling",
        )
        try:
            with cache.session():
                self._forward = compile_forward(self.model, freezing=False)
                with model_trace_config():
                    self._warm_up_graphs()
                if not cache.fully_loaded():
                    cache.save()
        except Exception:
            if not existed:
                raise
            logger.warning(
                "compile cache: the entry in %s broke the compilation; removing it "
                "and compiling again",
                cache.folder,
                exc_info=True,
            )
            cache.discard()
            with cache.session():
                self._forward = compile_forward(self.model, freezing=False)
                with model_trace_config():
                    self._warm_up_graphs()
                cache.save()
        self.compile_cache_loaded = cache.loaded
        return time.perf_counter() - start

    def open_compile_cache(self) -> CompileCache:
        """The compile cache's folder for this runner's graph (its key set from the model and
        `compile_settings`); the packed layers are switched to their opaque ops first (see
        `Linear.opaque_packed`), as the graph is traced with them."""
        for module in self.model.modules():
            if isinstance(module, Linear):
                module.opaque_packed = True
        key, parts = compile_cache_key(self.model, self.compile_settings())
        return CompileCache(CompileCache.root(), key, parts)

    def _warm_up_on_small_pages(self, first_block: int) -> None:
        """The warm-up's blocks on 4 KB pages (`KVStorage.keep_small_pages`): the warm-up runs
        before the pool's prefault, and where a huge page's first touch is slow (in a VM) its
        writes, a block in each layer's K and V, would pay one such touch per array."""
        storage = None if self.kv_cache is None else self.kv_cache.storage
        if storage is not None and first_block < storage.num_blocks:
            storage.keep_small_pages(first_block, self.warm_up_blocks())

    def warm_up_blocks(self) -> int:
        """KV blocks the warm-up steps write: the longest one-request step's, or a block per
        request of the widest decode-only step, whichever is more."""
        prefill = math.ceil(max(self.graph_token_counts()) / self.block_size)
        return max([prefill, *self.decode_graph_token_counts()])

    def start_background_compile(self, cache: CompileCache, first_block: int) -> BackgroundCompile:
        """Compile the forward, and fill `cache`, on a thread of its own; the serving steps
        run eagerly meanwhile and the first step after every graph is ready switches to it
        (`execute_model`), between steps, on the serving thread.

        Only the compiling thread compiles. Its warm-up steps run on a shallow copy of this
        runner with a persistent batch, request states and prompt outputs of its own (the
        serving thread never sees them), and write their KV into blocks `first_block` and
        up, which the engine keeps out of its pool: never a live block. Everything else
        they share is read-only (weights, the pool's tensors). A compile that fails is
        logged once and leaves the engine eager for good.
        """
        self._warm_up_on_small_pages(first_block)
        job = self.background = BackgroundCompile(total=len(self._warm_up_steps()))
        self.compile_cache = cache
        self.compile_cache_loaded = False
        shadow = copy.copy(self)
        shadow.input_batch = self._new_input_batch()
        shadow.requests = {}
        shadow.prompt_outputs = PromptOutputs()
        shadow.hidden_states_hook = None
        shadow.background = None

        def run() -> None:
            start = time.perf_counter()
            try:
                with cache.session():
                    shadow._forward = compile_forward(self.model, freezing=False)
                    with model_trace_config():
                        shadow._warm_up_graphs(first_block, job)
                    if not cache.fully_loaded():
                        cache.save()
            except _CompileCancelled:
                logger.info("compile: background compile stopped before it finished")
                return
            except Exception:
                job.failed = True
                logger.warning(
                    "compile: the background compile failed; the model keeps running "
                    "eagerly (restart to try again)",
                    exc_info=True,
                )
                return
            job.forward = shadow._forward
            logger.info(
                "compiled the model forward in the background in %.1f s; the next step "
                "runs it (--enforce-eager skips this)",
                time.perf_counter() - start,
            )

        job.thread = threading.Thread(target=run, name="pagemill-compile", daemon=True)
        _RUNNING_COMPILES.add(job)
        job.thread.start()
        return job

    def _adopt_compiled(self) -> None:
        """Between steps: switch to the background compile's forward once it is ready."""
        job = self.background
        if job is not None and job.forward is not None and not self.compiled:
            self._forward = job.forward
            self.compiled = True
            logger.info("compile: the compiled forward serves from this step on")

    def compile_settings(self) -> dict[str, object]:
        """The runner's settings that enter the compiled graph (for the compile cache's key)."""
        return {
            "model_config": self.model_config,
            "dtype": self.dtype,
            "device": self.device.type,
            "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            "vocab_size": self.vocab_size,
            "num_blocks": None if self.kv_cache is None else self.kv_cache.num_blocks,
            "kv_cache_groups": self.kv_cache_groups,
            "kv_cache_dtype": self.kv_cache_dtype,
            "packed_row_limits": packed_row_limits(self.model),
            "tensor_parallel_size": 1 if self.tp is None else self.tp.world_size,
            "graph_token_counts": self.graph_token_counts(),
            "decode_graph_token_counts": self.decode_graph_token_counts(),
            # A graph traced with the C++ attention operators calls them by name.
            "native_attention_ops": cpu_native.attention_ops_loaded(),
        }

    def graph_token_counts(self) -> list[int]:
        """The step sizes compiled at start-up: one per graph (see `compile`)."""
        counts = {1, 2} | {limit + 1 for limit in packed_row_limits(self.model)}
        longest = min(self.max_num_batched_tokens, self.max_model_len)
        return sorted(n for n in counts if n <= longest)

    def decode_graph_token_counts(self) -> list[int]:
        """The decode-only step sizes compiled at start-up besides `graph_token_counts`: with
        the C++ decode operator a decode-only step of several requests runs a graph of its
        own (`AttentionMetadata.native_decode`; one token is always decode-only)."""
        if self.device.type != "cpu" or not cpu_native.attention_ops_loaded():
            return []
        return [n for n in self.graph_token_counts() if 2 <= n <= self.max_num_seqs]

    def _warm_up_steps(self) -> list[tuple[int, int]]:
        """(tokens, requests) of each graph's throwaway step: one request per prefill-like
        step, one token per request in a decode-only one."""
        steps = [(n, 1) for n in self.graph_token_counts()]
        return steps + [(n, n) for n in self.decode_graph_token_counts()]

    def _warm_up_graphs(self, first_block: int = 0, job: BackgroundCompile | None = None) -> None:
        """Run each graph's throwaway step (its KV written from block `first_block` on);
        `job` counts the graphs ready."""
        self.compiled = True
        apply_first_call_checks()  # each graph's first call is in this warm-up
        todo = self._warm_up_steps()
        start = time.perf_counter()
        logger.info(
            "compile: %d graphs, for steps of %s tokens (the first traces the model)",
            len(todo),
            ", ".join(f"{n}" if r == 1 else f"{n} (decode)" for n, r in todo),
        )
        for i, (num_tokens, num_reqs) in enumerate(todo):
            if job is not None and job.cancelled:
                raise _CompileCancelled
            t0 = time.perf_counter()
            batch, _ = self.dummy_batch(
                num_tokens=num_tokens, max_seqs=num_reqs, first_block=first_block
            )
            saved = self.input_batch, self.requests
            self.input_batch = self._new_input_batch()
            self.requests = {}
            try:
                self.execute_model(batch)
            finally:
                self.input_batch, self.requests = saved
            if job is not None:
                job.done = i + 1
            logger.info(
                "compile: graph %d/%d (a %d-token step) ready in %.1f s (%.1f s so far)%s",
                i + 1,
                len(todo),
                num_tokens,
                time.perf_counter() - t0,
                time.perf_counter() - start,
                "" if job is None else "; serving eagerly meanwhile",
            )

    # ---- KV cache ------------------------------------------------------------------------

    def init_kv_cache(self, num_blocks: int, prefault: bool = True) -> KVCache:
        """`prefault` False leaves a CPU pool's prefault to `kv_cache.start_prefault()`."""
        if self.device.type == "cpu":
            # The KV write and decode attention as C++ operators are built (once per
            # machine) now, before ready, not inside the first request's step.
            cpu_native.load_attention_ops()
        self.kv_cache = self._new_kv_cache(num_blocks, prefault)
        self.input_batch = self._new_input_batch()
        self._bind(self.kv_cache)
        return self.kv_cache

    def _new_kv_cache(self, num_blocks: int, prefault: bool = True) -> KVCache:
        return KVCache(
            self.model_config,
            num_blocks,
            self.block_size,
            self.dtype,
            self.device,
            self.kv_cache_dtype,
            self.kv_cache_groups,
            prefault=prefault,
        )

    def _new_input_batch(self) -> InputBatch:
        groups = self.kv_cache_groups
        return InputBatch(
            self.max_num_seqs,
            self.max_blocks_per_seq,
            self.device,
            1 if groups is None else len(groups),
        )

    def _bind(self, cache: KVCache) -> None:
        groups = self.kv_cache_groups
        self.model.bind_kv_caches(
            cache.caches,
            cache.scales,
            None if groups is None else layer_group(groups, self.model_config.num_hidden_layers),
            kv_pool=cache.pool,
        )
        self._bind_decode_buffers()

    def _bind_decode_buffers(self) -> None:
        """Give the attention layers (those with `decode_tables`) the buffers that a compiled
        graph's decode-only steps read their block tables and context lengths from (see
        `AttentionMetadata.native_decode`): on CPU, when the C++ decode operator is loaded.
        One table per KV cache group, shared by the group's layers."""
        self._decode_tables = self._decode_lens = self._decode_views = None
        self._plan_free_decode = False
        if self.device.type != "cpu" or not cpu_native.attention_ops_loaded():
            return
        num_groups = 1 if self.kv_cache_groups is None else len(self.kv_cache_groups)
        shape = (self.max_num_seqs, self.max_blocks_per_seq)
        tables = [torch.zeros(shape, dtype=torch.int32) for _ in range(num_groups)]
        lens = torch.zeros(self.max_num_seqs, dtype=torch.int32)
        layers = []
        for module in self.model.modules():
            group = getattr(module, "kv_group", None)
            if hasattr(module, "decode_tables") and isinstance(group, int):
                module.decode_tables = tables[group]
                module.decode_lens = lens
                layers.append(module)
        self._decode_tables, self._decode_lens = tables, lens
        self._decode_views = (tables[0].numpy(), lens.numpy())
        serves = [getattr(m, "serves_native_decode", None) for m in layers]
        self._plan_free_decode = bool(layers) and all(callable(f) and f(self.dtype) for f in serves)

    # ---- CUDA graphs ---------------------------------------------------------------------

    def _build_graphs(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> DecodeGraphs:
        q = self.verify_query_len
        graphs = DecodeGraphs(
            graph_buckets(self.max_num_seqs),
            self.max_blocks_per_seq,
            self.device,
            q,
            verify_buckets(self.max_num_seqs, q, self.max_num_batched_tokens) if q > 1 else None,
        )
        graphs.capture(
            self._forward,
            self.model.compute_logits,
            kv_caches,
            self.model_config.num_attention_heads,
            self.dtype,
        )
        return graphs

    def measure_cuda_graph_memory(self) -> int:
        """Device bytes the decode graphs will hold, for the KV pool's budget (CUDA only).

        A trial capture against a one-block scratch cache (capture only records kernels;
        every row is padded, so nothing reads or writes the cache), measured and released.
        """
        scratch = self._new_kv_cache(1)
        caches = scratch.caches
        self._bind(scratch)
        try:
            return measure_graph_memory(lambda: self._build_graphs(caches), self.device)
        finally:
            self.model.unbind_kv_caches()

    def capture_cuda_graphs(self) -> float:
        """Capture the decode graphs over the bound KV cache; returns seconds."""
        assert self.kv_cache is not None, "init_kv_cache first"
        if self.tp is not None:
            raise ValueError("CUDA graphs are single-rank for now")
        start = time.perf_counter()
        self.graphs = self._build_graphs(self.kv_cache.caches)
        return time.perf_counter() - start

    def dummy_batch(
        self, num_tokens: int | None = None, max_seqs: int | None = None, first_block: int = 0
    ) -> tuple[SchedulerOutput, int]:
        """The heaviest step the limits allow (or `num_tokens` over at most `max_seqs`
        sequences), and the KV blocks it needs (it writes blocks `first_block` and up).

        By default `max_num_batched_tokens` tokens spread over as many sequences as may share
        a step (so the logits rows peak too), none longer than max_model_len.
        """
        # A step can never hold more than max_num_seqs full-length sequences.
        tokens = min(self.max_num_batched_tokens, self.max_num_seqs * self.max_model_len)
        if num_tokens is not None:
            tokens = min(tokens, num_tokens)
        most = self.max_num_seqs if max_seqs is None else max_seqs
        num_seqs = max(math.ceil(tokens / self.max_model_len), min(most, tokens))
        per_seq = [
            tokens // num_seqs + (1 if i < tokens % num_seqs else 0) for i in range(num_seqs)
        ]
        sched, next_block = [], first_block
        greedy = SamplingParams(temperature=0.0)
        for i, n in enumerate(per_seq):
            nb = math.ceil(n / self.block_size)
            blocks = list(range(next_block, next_block + nb))
            record = Request(f"profile-{i}", [0] * n, sampling_params=greedy)
            sched.append(
                ScheduledRequest(record.request_id, [0] * n, 0, n, blocks, True, True, record)
            )
            next_block += nb
        return (
            SchedulerOutput(scheduled=sched, total_num_scheduled_tokens=tokens),
            next_block - first_block,
        )

    @torch.inference_mode()
    def profile_peak_memory(self) -> int:
        """Extra device memory (bytes) that the heaviest possible step needs (CUDA only).

        Runs `dummy_batch()` against a throwaway KV cache just large enough for it (and a
        throwaway persistent batch) and reads the allocator's peak above what was
        allocated before (the weights).
        """
        batch, blocks_needed = self.dummy_batch()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        scratch = self._new_kv_cache(blocks_needed)
        # Only a torch-allocated scratch cache shows up in torch's counters.
        scratch_bytes = scratch.nbytes if scratch.storage is None else 0
        saved = self.kv_cache, self.input_batch, self.requests
        self.kv_cache = scratch
        self.input_batch = self._new_input_batch()
        self.requests = {}
        self._bind(scratch)
        try:
            self.execute_model(batch)
            torch.cuda.synchronize(self.device)
        finally:
            self.kv_cache, self.input_batch, self.requests = saved
            self.model.unbind_kv_caches()
        peak = torch.cuda.max_memory_allocated(self.device) - base - scratch_bytes
        del scratch
        torch.cuda.empty_cache()
        return max(0, peak)

    # ---- the step's inputs -----------------------------------------------------------------

    def _update_states(self, out: SchedulerOutput) -> None:
        batch = self.input_batch
        bs = self.block_size
        groups = self.kv_cache_groups
        for rid in out.finished_req_ids:
            self.requests.pop(rid, None)
            self.prompt_outputs.forget(rid)
            batch.remove(rid)
        for rid in out.preempted_req_ids:
            batch.remove(rid)  # its cached state stays: it comes back with its generator
        for s in out.scheduled:
            rid = s.request_id
            if s.is_new:
                state = self.requests.get(rid)
                if state is None or state.request is not s.request:
                    state = self.requests[rid] = CachedRequestState.create(s.request, self.device)
                batch.remove(rid)
                batch.add(state, s.new_block_ids, s.group_block_ids)
            elif s.new_block_ids or s.num_kept_blocks is not None:
                try:
                    row = batch.row_of[rid]
                except KeyError:
                    raise ValueError(
                        f"request {rid!r} is scheduled as running but was never scheduled as new"
                    ) from None
                if s.num_kept_blocks is not None:  # rejected drafts' blocks were given back
                    batch.truncate_blocks(row, s.num_kept_blocks)
                batch.append_blocks(row, s.new_block_ids, s.group_block_ids)
            if self._shared_window:
                row = batch.row_of[rid]
                batch.drop_blocks_before(row, s.start_pos - self._shared_window + 1, bs)
            elif groups is not None:
                row = batch.row_of[rid]
                for g, spec in enumerate(groups):
                    w = spec.sliding_window
                    if w is not None:
                        batch.drop_blocks_before(row, s.start_pos - w + 1, bs, g)

    def prepare(self, out: SchedulerOutput) -> StepInputs | None:
        prepared = self._prepare_batch(out)
        if prepared is None:
            return None
        return self._step_inputs(*prepared)

    def _prepare_batch(
        self, out: SchedulerOutput
    ) -> tuple[StepBatch, list[str], SamplingMetadata | None] | None:
        """The step's host-side layout, the requests that sample and their metadata."""
        self._update_states(out)
        scheduled = out.scheduled
        n = len(scheduled)
        if n == 0:
            return None
        if n > self.max_num_seqs:
            raise ValueError(f"{n} scheduled requests exceed max_num_seqs={self.max_num_seqs}")
        if self.decode_fast_path:
            lean = self._decode_layout(scheduled)
            if lean is not None:
                return lean
        return self._layout(scheduled)

    def _decode_layout(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[StepBatch, list[str], SamplingMetadata] | None:
        """`_layout` of the commonest step, with a fraction of its numpy calls: every
        request of the persistent batch decodes one token, in its row's order, with no
        drafts, prompt outputs, LoRA or second KV cache group; None for any other step
        (`_layout` then lays it out, and raises what it finds wrong)."""
        batch = self.input_batch
        n = len(scheduled)
        if self.lora is not None or len(batch.group_tables) > 1 or n != batch.num_reqs:
            return None
        row_of = batch.row_of
        table, num_blocks, bs = batch.block_table, batch.num_blocks, self.block_size
        # Per request: position, context length, slot, token id; laid out by one numpy
        # call (each distinct numpy call costs far more here than the arithmetic).
        cols: list[list[int]] = [[], [], [], []]
        positions, seq_lens, slots, ids = cols
        width = 0
        for i, s in enumerate(scheduled):
            if (
                s.num_tokens != 1
                or len(s.token_ids) != 1
                or not s.sample
                or s.spec_token_ids
                or s.start_pos < s.request.num_prompt_tokens
                or row_of.get(s.request_id) != i
            ):
                return None
            pos = s.start_pos
            blocks = num_blocks.item(i)
            if pos >= blocks * bs:
                return None  # beyond its table: `_layout` says so
            width = max(width, blocks)
            positions.append(pos)
            seq_lens.append(pos + 1)
            slots.append(table.item(i, pos // bs) * bs + pos % bs)
            ids.append(s.token_ids[0])
        laid = np.array(cols, dtype=np.int64)
        self._prompt_work = None
        self._spec_step = None
        step = StepBatch(
            torch.from_numpy(laid[3]),
            laid[0],
            laid[2],
            self._decode_qsl[: n + 1],
            laid[1],
            np.ascontiguousarray(table[:n, :width]),
            self._decode_q_lens[:n],
            None,
            n,
        )
        return step, [s.request_id for s in scheduled], batch.sampling_metadata()

    def _layout(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[StepBatch, list[str], SamplingMetadata | None]:
        """The step's layout in general: any mix of prompt chunks, decodes and drafts."""
        n = len(scheduled)
        batch = self.input_batch
        row_of = batch.row_of
        rows = np.empty(n, dtype=np.int64)
        q_lens = np.empty(n, dtype=np.int64)
        starts = np.empty(n, dtype=np.int64)
        ids: list[int] = []
        sample_pos: list[int] = []
        spec_pos: list[int] = []  # requests verifying drafts: logits at each of them
        prompt_pos: list[int] = []  # requests with outputs at prompt positions
        for i, s in enumerate(scheduled):
            try:
                rows[i] = row_of[s.request_id]
            except KeyError:
                raise ValueError(
                    f"request {s.request_id!r} is scheduled as running but was "
                    "never scheduled as new"
                ) from None
            q_lens[i] = s.num_tokens
            starts[i] = s.start_pos
            ids += s.token_ids
            if s.start_pos < s.request.num_prompt_tokens and wants_prompt_outputs(s):
                prompt_pos.append(i)
                if s.request.pooling_params is not None:
                    continue  # pools instead of sampling
            if s.sample:
                if s.spec_token_ids:
                    spec_pos.append(len(sample_pos))
                sample_pos.append(i)
        total = len(ids)
        if total != int(q_lens.sum()):
            raise ValueError("ScheduledRequest.token_ids lengths disagree with num_tokens")
        bs = self.block_size
        seq_lens = starts + q_lens
        # Each request's own table must reach its last token (not just the widest table).
        short = np.flatnonzero(seq_lens > batch.num_blocks[rows].astype(np.int64) * bs)
        if short.size:
            s = scheduled[int(short[0])]
            raise ValueError(
                f"request {s.request_id!r}: tokens up to position {s.start_pos + s.num_tokens} "
                f"lie beyond its block table of {int(batch.num_blocks[rows[short[0]]])} blocks"
            )
        in_order = bool(np.array_equal(rows, self._arange[:n]))
        if total == n:  # decode only: one token per request at its own position
            positions, token_rows = starts, rows
        else:
            first = np.cumsum(q_lens) - q_lens
            positions = self._arange[:total] + np.repeat(starts - first, q_lens)
            token_rows = np.repeat(rows, q_lens)
        table = batch.block_table
        slots = table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        width = int(batch.num_blocks[rows].max())
        block_tables = np.ascontiguousarray(table[:n, :width] if in_order else table[rows, :width])
        group_slots: list[np.ndarray] | None = None
        group_block_tables: list[np.ndarray] | None = None
        if len(batch.group_tables) > 1:
            group_slots, group_block_tables = [], []
            for t in batch.group_tables[1:]:
                group_slots.append(
                    t[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
                )
                group_block_tables.append(
                    np.ascontiguousarray(t[:n, :width] if in_order else t[rows, :width])
                )
        qsl = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(q_lens, out=qsl[1:])

        work = self._prompt_work = (
            self.prompt_outputs.plan(scheduled, prompt_pos, qsl) if prompt_pos else None
        )
        last_rows = qsl[1:][sample_pos].astype(np.int64) - 1
        self._spec_step = None
        if spec_pos:
            last_rows = self._plan_drafts(scheduled, sample_pos, spec_pos, last_rows, rows)
        num_logit_rows = len(last_rows)
        # Under tensor parallelism the prompt-logprob rows join the gathered logit rows; on
        # one device `_output` computes their logits a slice at a time (a long chunk's
        # rows x vocabulary would otherwise be one large tensor).
        if work is not None and work.logit_rows and self.tp is not None:
            num_logit_rows += len(work.logit_rows)
            sample_indices = torch.from_numpy(
                np.concatenate(
                    [
                        np.asarray(work.logit_rows, dtype=np.int64),
                        last_rows,
                    ]
                )
            )
        elif len(sample_pos) == total and not spec_pos:  # every token samples, in order
            sample_indices = None
        else:
            sample_indices = torch.from_numpy(last_rows)
        if sample_pos and in_order and len(sample_pos) == n == batch.num_reqs:
            metadata = batch.sampling_metadata()
        elif sample_pos:
            metadata = batch.sampling_metadata(rows[sample_pos])
        else:
            metadata = None

        if self.lora is not None:
            self.lora.prepare_step([s.request.lora_int_id for s in scheduled], q_lens)
        step = StepBatch(
            torch.tensor(ids, dtype=torch.int64),
            positions,
            slots,
            qsl,
            seq_lens,
            block_tables,
            q_lens,
            sample_indices,
            num_logit_rows,
            group_slots,
            group_block_tables,
        )
        req_ids = [scheduled[i].request_id for i in sample_pos]
        return step, req_ids, metadata

    def _plan_drafts(
        self,
        scheduled: list[ScheduledRequest],
        sample_pos: list[int],
        spec_pos: list[int],
        last_rows: np.ndarray,
        rows: np.ndarray,
    ) -> np.ndarray:
        """The logit rows with the draft rows appended: a request with k drafts also needs
        the outputs at the k positions before its last (the token before each draft)."""
        drafts = [scheduled[sample_pos[j]].spec_token_ids for j in spec_pos]
        counts = np.array([len(d) for d in drafts], dtype=np.int64)
        ends = last_rows[spec_pos]  # the bonus rows; the drafts' rows end just before
        draft_rows = np.repeat(ends - counts, counts) + (
            self._arange[: int(counts.sum())] - np.repeat(np.cumsum(counts) - counts, counts)
        )
        batch_rows = rows[np.asarray(sample_pos, dtype=np.int64)[spec_pos]]
        self._spec_step = SpecStep(
            list(spec_pos),
            list(drafts),
            self.input_batch.sampling_metadata(np.repeat(batch_rows, counts)),
        )
        return np.concatenate([last_rows, draft_rows])

    def _step_inputs(
        self, batch: StepBatch, req_ids: list[str], metadata: SamplingMetadata | None
    ) -> StepInputs:
        """The batch's tensors on the device and the step's attention plan."""
        if (
            self.decode_fast_path
            and self.compiled
            and self._plan_free_decode
            and batch.group_slots is None
            and batch.input_ids.numel() == len(batch.seq_lens)
        ):
            return self._plan_free_inputs(batch, req_ids, metadata)
        tensors = [
            batch.input_ids,
            torch.from_numpy(batch.positions),
            torch.from_numpy(batch.slots),
            torch.from_numpy(batch.query_start_loc),
            torch.from_numpy(batch.seq_lens.astype(np.int32)),
            torch.from_numpy(batch.block_tables),
        ]
        sample_indices = batch.sample_indices
        if sample_indices is not None:
            tensors.append(sample_indices)
        moved = self._to_device(tensors)
        input_ids, positions_t, slots_t, qsl_t, seq_lens_t, tables_t = moved[:6]
        if sample_indices is not None:
            sample_indices = moved[6]
        assert self.kv_cache is not None, "init_kv_cache first"
        k_shape = cache_shape(self.kv_cache.caches[0][0])

        def metadata_of(
            slots: torch.Tensor, tables: torch.Tensor, group: int = 0
        ) -> AttentionMetadata:
            plan = plan_attention(
                qsl_t.to(torch.int32),
                seq_lens_t.to(torch.int32),
                tables.to(torch.int32),
                k_cache_shape=k_shape,
                num_heads=self.model_config.num_attention_heads,
                dtype=self.dtype,
                query_lens=batch.query_lens,
                context_lens=batch.seq_lens,
            )
            meta = AttentionMetadata(slot_mapping=slots.to(torch.int64), plan=plan)
            meta.native_decode = self._fill_decode_buffers(plan, group)
            return meta

        attn = metadata_of(slots_t, tables_t)
        if batch.group_slots is not None and batch.group_block_tables is not None:
            more = [torch.from_numpy(a) for a in batch.group_slots + batch.group_block_tables]
            moved_groups = self._to_device(more)
            k = len(batch.group_slots)
            attn.groups = [attn] + [
                metadata_of(moved_groups[i], moved_groups[k + i], i + 1) for i in range(k)
            ]
        return StepInputs(
            input_ids.to(torch.int64),
            positions_t.to(torch.int64),
            attn,
            sample_indices,
            req_ids,
            metadata,
            batch,
        )

    def _plan_free_inputs(
        self, batch: StepBatch, req_ids: list[str], metadata: SamplingMetadata | None
    ) -> StepInputs:
        """A compiled decode-only step where every layer takes the C++ decode operator:
        the tables and lengths go straight into the layers' decode buffers (numpy views, no
        torch calls), and the plan, which only an eager run of the step would read, is left
        to `AttentionMetadata.attention_plan`. CPU tensors: nothing moves."""
        assert self._decode_views is not None
        tables, lens = self._decode_views
        n, width = batch.block_tables.shape
        tables[:n, :width] = batch.block_tables
        lens[:n] = batch.seq_lens
        attn = AttentionMetadata(
            slot_mapping=torch.from_numpy(batch.slots),
            plan=None,
            native_decode=True,
            plan_source=lambda: self._plan_of(batch),
        )
        return StepInputs(
            batch.input_ids,
            torch.from_numpy(batch.positions),
            attn,
            batch.sample_indices,
            req_ids,
            metadata,
            batch,
        )

    def _plan_of(self, batch: StepBatch) -> AttentionPlan:
        """The attention plan of a step laid out on the host (KV cache group 0), as
        `_step_inputs` plans it."""
        assert self.kv_cache is not None, "init_kv_cache first"
        return plan_attention(
            torch.from_numpy(batch.query_start_loc),
            torch.from_numpy(batch.seq_lens.astype(np.int32)),
            torch.from_numpy(batch.block_tables),
            k_cache_shape=cache_shape(self.kv_cache.caches[0][0]),
            num_heads=self.model_config.num_attention_heads,
            dtype=self.dtype,
            query_lens=batch.query_lens,
            context_lens=batch.seq_lens,
        )

    def _fill_decode_buffers(self, plan: AttentionPlan, group: int) -> bool:
        """For a compiled step whose plan runs every row on the native decode kernel (a
        decode-only step, row = request): write its tables and lengths into the layers'
        decode buffers (group `group`'s table) and say so (`AttentionMetadata.native_decode`),
        so the graph calls the same kernel as a C++ operator. Only a compiled runner writes
        them: the buffers are shared with a background compile's warm-up steps."""
        impl = plan.impl
        if (
            not self.compiled
            or self._decode_tables is None
            or self._decode_lens is None
            or not isinstance(impl, TorchPlan)
            or impl.native is None
            or impl.native.rows is not None
            or impl.decode
            or impl.prefill
        ):
            return False
        tables, lens = impl.native.tables, impl.native.lens
        n, width = tables.shape
        self._decode_tables[group][:n, :width].copy_(tables)
        self._decode_lens[:n].copy_(lens)  # every group's: the same context lengths
        return True

    def _to_device(self, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        """Move the step's index tensors to the device in one copy.

        Many tiny host-to-device copies cost more than the data: everything is packed into
        one reused pinned int32 buffer (every index here fits in int32), copied once, and
        split back into views on the device. On CPU the tensors are used where they are.
        """
        if not self.pack_inputs:
            return pieces
        sizes = [p.numel() for p in pieces]
        n = sum(sizes)
        if self._copy_done is not None:
            self._copy_done.synchronize()  # the previous step's copy may still read the buffer
        if self._staging is None or self._staging.numel() < n:
            grown = 2 * (self._staging.numel() if self._staging is not None else 0)
            self._staging = torch.empty(max(n, grown), dtype=torch.int32, pin_memory=self._pin)
        buf = self._staging[:n]
        torch.cat([p.reshape(-1).to(torch.int32) for p in pieces], out=buf)
        moved = buf.to(self.device, non_blocking=True)
        if self._pin:
            self._copy_done = torch.cuda.Event()
            self._copy_done.record()
        return [t.view(p.shape) for t, p in zip(moved.split(sizes), pieces)]

    # ---- the forward -----------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Forward the step's tokens; logits only at the last token of each sampling request."""
        if self.background is not None:
            self._adopt_compiled()
        prepared = self._prepare_batch(out)
        vocab = self.vocab_size
        if prepared is None:
            self.last_forward_s = 0.0
            return ModelRunnerOutput(
                [], torch.empty(0, vocab, dtype=self.dtype, device=self.device), None
            )
        graphs = self.graphs
        if graphs is not None and self._prompt_work is None:
            batch = prepared[0]
            if graphs.serves(
                batch.input_ids.numel(),
                len(batch.seq_lens),
                batch.block_tables.shape[1],
                batch.query_lens,
            ):
                result = self._replay(graphs, *prepared)
                if self.hidden_states_hook is not None and graphs.last_hidden is not None:
                    self.aux_hidden_states = graphs.last_aux
                    self.hidden_states_hook(out, graphs.last_hidden)
                return result
        step = self._step_inputs(*prepared)
        if self.tp is not None:
            return self._execute_parallel(step)
        start = time.perf_counter()
        hidden, logits = self._local_logits(step)
        if self.hidden_states_hook is not None:
            self.hidden_states_hook(out, hidden)
        if logits is None:
            logits = hidden.new_empty(0, vocab)
        result = self._output(step, hidden, logits)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_forward_s = time.perf_counter() - start
        return result

    def _output(
        self, step: StepInputs, hidden: torch.Tensor, logits: torch.Tensor
    ) -> ModelRunnerOutput:
        """The step's output, with the outputs at prompt positions (under tensor
        parallelism the prompt-logprob rows lead the gathered logits and are split off)."""
        work = self._prompt_work
        if work is None:
            return ModelRunnerOutput(
                step.sample_req_ids, logits, step.sampling_metadata, spec=self._spec_step
            )
        done = self.prompt_outputs
        k = len(work.logit_rows) if self.tp is not None else 0
        prompt_logits = logits[:k]
        rows = torch.tensor(work.logit_rows, dtype=torch.int64, device=hidden.device)

        def logits_of(lo: int, hi: int) -> torch.Tensor:
            if k:
                return prompt_logits[lo:hi]
            return self.model.compute_logits(hidden.index_select(0, rows[lo:hi]))

        return ModelRunnerOutput(
            step.sample_req_ids,
            logits[k:],
            step.sampling_metadata,
            pooled=done.pool(hidden, work) if work.pool else None,
            prompt_logprobs=done.prompt_logprobs(logits_of, work) if work.logprobs else None,
            spec=self._spec_step,
        )

    def _replay(
        self,
        graphs: DecodeGraphs,
        batch: StepBatch,
        req_ids: list[str],
        metadata: SamplingMetadata | None,
    ) -> ModelRunnerOutput:
        """A decode or verify step through its bucket's CUDA graph (the eager step's logits)."""
        start = time.perf_counter()
        logits = graphs.replay(
            batch.input_ids.numpy(),
            batch.positions,
            batch.slots,
            batch.seq_lens,
            batch.block_tables,
        )
        if batch.sample_indices is not None:  # chunks that do not sample; verified drafts
            logits = logits.index_select(0, batch.sample_indices.to(self.device))
        torch.cuda.synchronize(self.device)
        self.last_forward_s = time.perf_counter() - start
        return ModelRunnerOutput(req_ids, logits, metadata, spec=self._spec_step)

    # ---- tensor parallelism ------------------------------------------------------------------

    def _local_logits(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's forward (the final-norm hidden states, whole on every rank) and its
        vocabulary columns of the logit rows (None when the step has none)."""
        forward = self._forward
        if self.kv_cache is not None and self.kv_cache.scales_pending:
            forward = self.model.forward  # --calculate-kv-scales: this step runs eagerly
        hidden = forward(step.input_ids, step.positions, step.attn)
        if isinstance(hidden, tuple):
            hidden, self.aux_hidden_states = hidden
        assert step.batch is not None
        if not step.batch.num_samples:
            return hidden, None
        rows = (
            hidden if step.sample_indices is None else hidden.index_select(0, step.sample_indices)
        )
        return hidden, self.model.compute_logits(rows)

    def _execute_parallel(self, step: StepInputs) -> ModelRunnerOutput:
        """Rank 0: send the batch, run our shard with the others, gather the logits.

        Anything that fails from the broadcast on is fatal (`TensorParallelError`): the
        other ranks are mid-step, so the step cannot be retried or isolated.
        """
        tp = self.tp
        assert tp is not None
        start = time.perf_counter()
        with tp.exclusive():
            try:
                if tp.failed:
                    raise RuntimeError("the group failed earlier")
                tp.broadcast_object(step.batch)
                hidden, local = self._local_logits(step)
                logits = None if local is None else tp.gather_to_driver(local)
            except Exception as exc:
                raise tp.failure(exc) from exc
        if logits is None:
            logits = torch.empty(0, self.vocab_size, dtype=self.dtype, device=self.device)
        elif logits.shape[-1] != self.vocab_size:
            logits = logits[:, : self.vocab_size].contiguous()  # the last rank's padding
        result = self._output(step, hidden, logits)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_forward_s = time.perf_counter() - start
        return result

    @torch.inference_mode()
    def execute_batch(self, batch: StepBatch) -> None:
        """A worker rank's step: the forward over rank 0's batch, logits sent to rank 0."""
        assert self.tp is not None
        _, local = self._local_logits(self._step_inputs(batch, [], None))
        if local is not None:
            self.tp.gather_to_driver(local)
