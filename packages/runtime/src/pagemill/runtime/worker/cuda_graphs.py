"""CUDA graphs for pure-decode steps: one graph per batch-size bucket, replayed per step.

An eager decode step of a small model on a GPU is mostly launch overhead: hundreds of
small kernels, each paying Python, the dispatcher and a launch. A graph records the whole
forward (embedding through LM head) once and replays it with one launch. What it needs:

- **Fixed shapes and buffers.** Each bucket (`decode_padding.graph_buckets`) owns one
  persistent int32 device buffer holding the padded step's ids, positions, slots,
  query_start_loc, seq_lens and block tables (`DecodeLayout`); a step is one host-to-device
  copy into it and a replay. The logits come out of the graph's own static output.
- **A capturable attention plan.** `plan_triton` sizes the launch from shapes alone (token
  and sequence counts, block-table width, cache shape), never from the lengths' values,
  and reads no device memory, so a plan made at capture time for `bucket` rows and the
  full `max_blocks_per_seq` table width stays valid for every step replayed. The cost:
  the flash-decoding split count is chosen for the worst-case context (max_model_len)
  rather than the batch's actual longest one, so short contexts launch split programs
  whose key range is empty (they only store an empty partial state) and pay one merge
  kernel per layer that an eager step with short contexts would skip.
- **One memory pool.** Buckets are captured largest first into one shared graph pool, so
  a smaller bucket's intermediates reuse the largest one's memory (graphs never run
  concurrently). Each graph's static logits stay allocated.
- **No KV writes during capture.** Warm-up and capture run with every row padded (slot
  -1, context 0), so they neither write nor read the KV cache.

Only steps where every request has exactly one query token and the batch fits the largest
bucket use a graph (`DecodeGraphs.serves`); prefill, mixed steps and larger batches run
eagerly. Under speculative decoding with a draft model or an EAGLE head (k drafts per
request) the verify steps, k + 1 tokens for every request, get graphs of their own for the
buckets whose b x (k + 1) tokens fit the step's budget: the same layout with `query_len`
tokens per row (`DecodeLayout`), planned once as a prefill-shaped launch (no context
splits). Each graph keeps the hidden states (and an EAGLE-3 target's auxiliary layer
inputs, a second output of its forward) as static outputs, read by the EAGLE head after the
step (`DecodeGraphs.last_hidden`).

Graphs bake in the KV cache's addresses, so they are captured after the real pool is
allocated; their memory is measured beforehand by a trial capture against a one-block
scratch cache and taken out of the pool's budget (`measure_graph_memory`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagemill.kernels import AttentionPlan, plan_attention
from pagemill.kernels.attention import Backend
from pagemill.runtime.model_executor.models.llama import ForwardOutput
from pagemill.runtime.worker.attention_metadata import AttentionMetadata
from pagemill.runtime.worker.decode_padding import DecodeLayout, bucket_for, pad_decode

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

logger = logging.getLogger(__name__)

# hidden = forward(input_ids, positions, meta); logits = compute_logits(hidden). With
# auxiliary layers (EAGLE-3) the forward returns (hidden, their inputs).
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], ForwardOutput]
Logits = Callable[[torch.Tensor], torch.Tensor]


def cache_shape(k_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """A K cache's shape [blocks, block_size, kv_heads, head_dim], as the planner takes it."""
    blocks, block_size, heads, head_dim = k_cache.shape
    return blocks, block_size, heads, head_dim


@dataclass(slots=True)
class BucketInputs:
    """A bucket's persistent inputs: the device buffer a graph reads, its pinned host twin,
    the views the forward takes, and the attention plan made once for them.

    Device-agnostic (the CPU tests run the bucket's step eagerly through it, with the Triton
    interpreter): only the recording into a CUDA graph needs a GPU.
    """

    layout: DecodeLayout
    host: torch.Tensor  # [layout.numel] int32, written by pad_decode
    device_buffer: torch.Tensor  # [layout.numel] int32, what the step reads
    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    plan: AttentionPlan  # keeps its split workspace alive

    @classmethod
    def create(
        cls,
        bucket: int,
        table_width: int,
        device: torch.device,
        k_cache_shape: tuple[int, int, int, int],
        num_heads: int,
        dtype: torch.dtype,
        backend: Backend | None = None,
        query_len: int = 1,
    ) -> BucketInputs:
        """Buffers with every row padded (no KV read or written) and the bucket's plan."""
        layout = DecodeLayout(bucket, table_width, query_len)
        host = torch.empty(layout.numel, dtype=torch.int32, pin_memory=device.type == "cuda")
        empty = np.empty(0, dtype=np.int64)
        pad_decode(
            empty, empty, empty, empty, np.empty((0, 0), dtype=np.int32), layout, out=host.numpy()
        )
        q = np.full(bucket, query_len, dtype=np.int64)
        buf = host.to(device)
        o = layout.offsets()
        ids, pos, slots, qsl, lens = (buf[o[i] : o[i + 1]] for i in range(5))
        tables = buf[o[5] : o[6]].view(bucket, table_width)
        # Host lengths only satisfy the planner's checks; the Triton plan reads shapes only.
        plan = plan_attention(
            qsl,
            lens,
            tables,
            k_cache_shape=k_cache_shape,
            num_heads=num_heads,
            dtype=dtype,
            query_lens=q,
            context_lens=q,
            backend=backend,
        )
        if plan.backend != "triton":
            raise RuntimeError(
                "decode graphs need the Triton attention backend (its plan depends on shapes only)"
            )
        return cls(layout, host, buf, ids, pos, slots, plan)

    def load(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
    ) -> None:
        """Pad a step of n <= bucket rows into the buffers (one host-to-device copy)."""
        pad_decode(
            input_ids, positions, slots, seq_lens, block_tables, self.layout, out=self.host.numpy()
        )
        # On CUDA the runner synchronises after every step, so the pinned twin is free again.
        self.device_buffer.copy_(self.host, non_blocking=True)

    def step(
        self, forward: Forward, compute_logits: Logits
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The bucket's forward over the buffers, what a graph records: per token the
        logits [tokens, vocab], the hidden states [tokens, hidden] and the auxiliary layers'
        inputs (None without them); the latter two are what an EAGLE head reads."""
        meta = AttentionMetadata(slot_mapping=self.slots.to(torch.int64), plan=self.plan)
        out = forward(self.input_ids.to(torch.int64), self.positions.to(torch.int64), meta)
        hidden, aux = out if isinstance(out, tuple) else (out, None)
        return compute_logits(hidden), hidden, aux


@dataclass(slots=True)
class _BucketGraph:
    inputs: BucketInputs
    graph: torch.cuda.CUDAGraph
    # The graph's static outputs, rewritten by every replay.
    logits: torch.Tensor  # [tokens, vocab]
    hidden: torch.Tensor  # [tokens, hidden]
    aux: torch.Tensor | None  # [tokens, n x hidden] with auxiliary layers


class DecodeGraphs:
    """The captured decode graphs of one model and one KV cache."""

    def __init__(
        self,
        buckets: list[int],
        table_width: int,
        device: torch.device,
        verify_query_len: int = 0,
        verify_buckets: list[int] | None = None,
    ) -> None:
        """Decode graphs for `buckets`; with `verify_query_len` (k + 1 under speculative
        decoding) also graphs of verify steps, every request `verify_query_len` tokens, for
        `verify_buckets`."""
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.buckets = sorted(buckets)
        self.table_width = table_width
        self.device = device
        self.verify_query_len = verify_query_len if verify_buckets else 0
        self.verify_buckets = sorted(verify_buckets or []) if self.verify_query_len > 1 else []
        # By (bucket, tokens per request).
        self.graphs: dict[tuple[int, int], _BucketGraph] = {}
        self.replays = 0  # steps served by a graph (read by benchmarks)
        self.verify_replays = 0  # of which verify steps
        # The last replay's hidden states and auxiliary layers' inputs, its n rows: views
        # of the bucket's static outputs, valid until that bucket replays again.
        self.last_hidden: torch.Tensor | None = None
        self.last_aux: torch.Tensor | None = None

    @property
    def max_bucket(self) -> int:
        return self.buckets[-1]

    @torch.inference_mode()
    def capture(
        self,
        forward: Forward,
        compute_logits: Logits,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        num_heads: int,
        dtype: torch.dtype,
    ) -> float:
        """Capture every bucket, largest first, into one shared pool; returns seconds."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        k_shape = cache_shape(kv_caches[0][0])
        shapes = [(b, 1) for b in self.buckets]
        shapes += [(b, self.verify_query_len) for b in self.verify_buckets]
        # Most tokens first: every smaller graph's intermediates fit the largest one's pool.
        for bucket, q in sorted(shapes, key=lambda s: (s[0] * s[1], s[1]), reverse=True):
            inputs = BucketInputs.create(
                bucket, self.table_width, self.device, k_shape, num_heads, dtype, query_len=q
            )
            self.graphs[bucket, q] = self._record(inputs, forward, compute_logits, pool)
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def _record(
        self, inputs: BucketInputs, forward: Forward, compute_logits: Logits, pool: _POOL_HANDLE
    ) -> _BucketGraph:
        # Warm up on a side stream (Triton compiles and loads its kernels outside capture).
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            inputs.step(forward, compute_logits)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits, hidden, aux = inputs.step(forward, compute_logits)
        return _BucketGraph(inputs, graph, logits, hidden, aux)

    def serves(
        self,
        num_tokens: int,
        num_seqs: int,
        table_width: int,
        query_lens: np.ndarray | None = None,
    ) -> bool:
        """A pure-decode step (one token per request) that fits the largest bucket, or a
        verify step whose every request (`query_lens`) has `verify_query_len` tokens and
        that fits the largest verify bucket."""
        if num_seqs <= 0 or table_width > self.table_width:
            return False
        if num_tokens == num_seqs:
            return num_seqs <= self.max_bucket
        q = self.verify_query_len
        return (
            q > 1
            and query_lens is not None
            and num_tokens == num_seqs * q
            and bool(self.verify_buckets)
            and num_seqs <= self.verify_buckets[-1]
            and bool((query_lens == q).all())
        )

    def replay(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
    ) -> torch.Tensor:
        """Logits [tokens, vocab] of a step `serves` accepts (n rows of one token, or of
        `verify_query_len`): a view of the bucket's static output, valid until the next
        replay of that bucket."""
        n, t = int(seq_lens.shape[0]), int(input_ids.shape[0])
        q = 1 if t == n else self.verify_query_len
        bucket = bucket_for(n, self.buckets if q == 1 else self.verify_buckets)
        if bucket is None or t != n * q:
            raise ValueError(f"no graph holds {n} rows of {t // max(n, 1)} token(s)")
        g = self.graphs[bucket, q]
        g.inputs.load(input_ids, positions, slots, seq_lens, block_tables)
        g.graph.replay()
        self.replays += 1
        self.verify_replays += q > 1
        self.last_hidden = g.hidden[:t]
        self.last_aux = None if g.aux is None else g.aux[:t]
        return g.logits[:t]


def measure_graph_memory(capture: Callable[[], DecodeGraphs], device: torch.device) -> int:
    """Device bytes the graphs hold once captured: a trial capture, measured and released.

    `capture` builds graphs against a throwaway cache (graphs bake in the cache's addresses,
    so the real ones can only be captured once the pool exists). The driver's free-memory
    reading is used rather than torch's counters so the graph pool, the per-bucket buffers
    and plans, and the driver's own graph objects all count.
    """
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info(device)[0]
    graphs = capture()
    torch.cuda.synchronize(device)
    free_after = torch.cuda.mem_get_info(device)[0]
    del graphs
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return max(0, free_before - free_after)
