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
eagerly. Graphs bake in the KV cache's addresses, so they are captured after the real pool
is allocated; their memory is measured beforehand by a trial capture against a one-block
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
from pagemill.runtime.worker.attention_metadata import AttentionMetadata
from pagemill.runtime.worker.decode_padding import DecodeLayout, bucket_for, pad_decode

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

logger = logging.getLogger(__name__)

# hidden = forward(input_ids, positions, meta); logits = compute_logits(hidden)
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
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
    ) -> BucketInputs:
        """Buffers with every row padded (no KV read or written) and the bucket's plan."""
        layout = DecodeLayout(bucket, table_width)
        host = torch.empty(layout.numel, dtype=torch.int32, pin_memory=device.type == "cuda")
        empty = np.empty(0, dtype=np.int64)
        pad_decode(
            empty, empty, empty, empty, np.empty((0, 0), dtype=np.int32), layout, out=host.numpy()
        )
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
            query_lens=np.ones(bucket, dtype=np.int64),
            context_lens=np.ones(bucket, dtype=np.int64),
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
        """Pad a decode step of n <= bucket rows into the buffers (one host-to-device copy)."""
        pad_decode(
            input_ids, positions, slots, seq_lens, block_tables, self.layout, out=self.host.numpy()
        )
        # On CUDA the runner synchronises after every step, so the pinned twin is free again.
        self.device_buffer.copy_(self.host, non_blocking=True)

    def step(self, forward: Forward, compute_logits: Logits) -> torch.Tensor:
        """The bucket's forward over the buffers: what a graph records, logits [bucket, vocab]."""
        meta = AttentionMetadata(slot_mapping=self.slots.to(torch.int64), plan=self.plan)
        return compute_logits(
            forward(self.input_ids.to(torch.int64), self.positions.to(torch.int64), meta)
        )


@dataclass(slots=True)
class _BucketGraph:
    inputs: BucketInputs
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [bucket, vocab], the graph's static output


class DecodeGraphs:
    """The captured decode graphs of one model and one KV cache."""

    def __init__(self, buckets: list[int], table_width: int, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.buckets = sorted(buckets)
        self.table_width = table_width
        self.device = device
        self.graphs: dict[int, _BucketGraph] = {}
        self.replays = 0  # steps served by a graph (read by benchmarks)

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
        for bucket in sorted(self.buckets, reverse=True):
            inputs = BucketInputs.create(
                bucket, self.table_width, self.device, k_shape, num_heads, dtype
            )
            self.graphs[bucket] = self._record(inputs, forward, compute_logits, pool)
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
            logits = inputs.step(forward, compute_logits)
        return _BucketGraph(inputs, graph, logits)

    def serves(self, num_tokens: int, num_seqs: int, table_width: int) -> bool:
        """A pure-decode step (one token per request) that fits the largest bucket."""
        return (
            num_tokens == num_seqs
            and 0 < num_seqs <= self.max_bucket
            and table_width <= self.table_width
        )

    def replay(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
    ) -> torch.Tensor:
        """Logits [n, vocab] of a decode step of n rows: a view of the bucket's static
        output, valid until the next replay of that bucket."""
        n = int(input_ids.shape[0])
        bucket = bucket_for(n, self.buckets)
        if bucket is None:
            raise ValueError(f"no graph holds {n} rows (largest bucket {self.max_bucket})")
        g = self.graphs[bucket]
        g.inputs.load(input_ids, positions, slots, seq_lens, block_tables)
        g.graph.replay()
        self.replays += 1
        return g.logits[:n]


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
