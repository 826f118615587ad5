"""The roofline step-cost model shared by the planner and the simulator.

One forward step streams every weight from HBM once whatever the batch, reads the KV cache of
each scheduled request's context, and does 2 FLOPs per parameter per scheduled token plus the
attention FLOPs. The step takes as long as the slower of the memory traffic and the arithmetic
(they overlap on a GPU), plus a fixed per-step overhead (launch, scheduling, sampling). That
single formula is why decode is memory bound at small batch and why batching is nearly free
until the crossover batch, the number the whole design of a serving engine revolves around.

Tensor parallelism over N GPUs (``tensor_parallel_size``) divides each GPU's weight bytes,
FLOPs and KV heads by N (KV heads are replicated when there are fewer than N) and adds
what the engine does between them: an all-reduce of the step's activations after each
layer's attention and MLP (plus one for the vocab-parallel embedding), and a gather of the
sampled rows' logits. A ring all-reduce of S bytes takes 2(N-1) steps of S/N bytes each,
every step paying the link's latency; the engine does not overlap it with compute, so it
adds to the step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

from pagemill.blockpool import kv_bytes_per_token
from pagemill.server.sim.specs import GPUSpec, ModelSpec, weight_dtype_bytes


def check_tensor_parallel(model: ModelSpec, tp: int) -> None:
    """The engine's rule (`pagemill.runtime.distributed.sharding`), without torch."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
    if tp == 1:
        return
    if model.num_heads % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide {model.name}'s "
            f"{model.num_heads} attention heads"
        )
    if model.num_kv_heads % tp and tp % model.num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp} neither divides nor is a multiple of "
            f"{model.name}'s {model.num_kv_heads} KV heads"
        )
    if model.intermediate_size % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide {model.name}'s "
            f"intermediate_size {model.intermediate_size}"
        )


@dataclass(frozen=True)
class StepCost:
    """Where the time of one step goes; ``bound`` names the side of the roofline that won."""

    weight_bytes: float
    kv_bytes: float
    flops: float
    memory_time_s: float
    compute_time_s: float
    time_s: float
    # Tensor parallelism: the step's all-reduces and logits gather (0 on one GPU).
    comm_time_s: float = 0.0

    @property
    def bound(self) -> str:
        return "compute" if self.compute_time_s > self.memory_time_s else "memory"


@dataclass(frozen=True)
class RooflineCostModel:
    """Step time of one model on one GPU (or on each of ``tensor_parallel_size`` GPUs).

    ``chunks`` handed to :meth:`step_cost` are ``(num_new_tokens, context_len)`` pairs, one per
    scheduled request, ``context_len`` counting the new tokens. Attention reads a request's KV
    context once per step (a FlashAttention-style kernel keeps the query tile on chip), not once
    per query token, which would make prefill absurdly memory bound.
    """

    model: ModelSpec
    gpu: GPUSpec
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    step_overhead_s: float = 0.0
    bandwidth_efficiency: float = 1.0
    flops_efficiency: float = 1.0
    tensor_parallel_size: int = 1
    # Bytes of one activation element exchanged between GPUs (bf16).
    activation_bytes: int = 2

    def __post_init__(self) -> None:
        weight_dtype_bytes(self.weight_dtype)  # validate early, with the clear message
        check_tensor_parallel(self.model, self.tensor_parallel_size)
        if self.tensor_parallel_size > 1 and (
            self.gpu.link_bandwidth_bytes_per_s is None or self.gpu.link_latency_s is None
        ):
            raise ValueError(
                f"GPU {self.gpu.name!r} has no link_bandwidth_bytes_per_s / "
                "link_latency_s: needed to cost tensor parallelism"
            )
        if self.step_overhead_s < 0:
            raise ValueError(f"step_overhead_s must be >= 0, got {self.step_overhead_s}")
        for name in ("bandwidth_efficiency", "flops_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value}")

    @cached_property
    def weight_bytes(self) -> int:
        """The whole model's."""
        return round(self.model.num_params * weight_dtype_bytes(self.weight_dtype))

    @cached_property
    def rank_weight_bytes(self) -> int:
        """One GPU's share (every matrix is split; norms are small enough to ignore)."""
        return -(-self.weight_bytes // self.tensor_parallel_size)

    @cached_property
    def kv_bytes_per_token(self) -> int:
        """On one GPU: its KV heads (all of them without tensor parallelism)."""
        m = self.model
        kv_heads = max(1, m.num_kv_heads // self.tensor_parallel_size)
        return kv_bytes_per_token(m.num_layers, kv_heads, m.head_dim, self.kv_dtype)

    @cached_property
    def bandwidth(self) -> float:
        return self.gpu.bandwidth_bytes_per_s * self.bandwidth_efficiency

    @cached_property
    def peak_flops(self) -> float:
        return self.gpu.bf16_flops * self.flops_efficiency

    @cached_property
    def flops_per_token(self) -> float:
        """Matmul FLOPs per token outside attention on one GPU: 2 per parameter (multiply +
        add) of its share — of the parameters a token reads (a MoE model's active ones)."""
        return 2.0 * self.model.active_params / self.tensor_parallel_size

    def streamed_weight_bytes(self, num_tokens: int) -> int:
        """One GPU's weight reads in a step of `num_tokens` tokens: all it holds for a dense
        model; a MoE model reads only the experts some token picked (`streamed_params`), so
        small batches stream a fraction of what is held."""
        if not self.model.num_experts:
            return self.rank_weight_bytes
        total = self.model.streamed_params(num_tokens) * weight_dtype_bytes(self.weight_dtype)
        return -(-round(total) // self.tensor_parallel_size)

    def all_reduce_time_s(self, num_bytes: float) -> float:
        """A ring all-reduce of `num_bytes` over the GPUs (0 on one GPU)."""
        n = self.tensor_parallel_size
        if n == 1 or num_bytes <= 0:
            return 0.0
        assert (
            self.gpu.link_bandwidth_bytes_per_s is not None and self.gpu.link_latency_s is not None
        )
        return (
            2
            * (n - 1)
            * (self.gpu.link_latency_s + num_bytes / n / self.gpu.link_bandwidth_bytes_per_s)
        )

    def comm_time_s(self, num_tokens: int, num_sampled: int) -> float:
        """A step's exchanges: two all-reduces per layer and the embedding's (each of
        ``num_tokens x hidden`` activations), then the logits of the sampled rows gathered
        on rank 0 (N-1 messages of its vocabulary slice, fp32)."""
        n = self.tensor_parallel_size
        if n == 1 or num_tokens == 0:
            return 0.0
        m = self.model
        per_layer = self.all_reduce_time_s(num_tokens * m.hidden_size * self.activation_bytes)
        gpu = self.gpu
        assert gpu.link_bandwidth_bytes_per_s is not None and gpu.link_latency_s is not None
        gather = (n - 1) * (
            gpu.link_latency_s + num_sampled * m.vocab_size / n * 4 / gpu.link_bandwidth_bytes_per_s
        )
        return (2 * m.num_layers + 1) * per_layer + gather

    def step_cost(self, chunks: Iterable[tuple[int, int]]) -> StepCost:
        num_tokens = 0
        num_seqs = 0
        kv_tokens = 0
        attn_flops = 0.0
        model = self.model
        for q, c in chunks:
            if q <= 0 or c < q:
                raise ValueError(f"bad chunk (num_new_tokens={q}, context_len={c})")
            num_tokens += q
            num_seqs += 1
            kv_tokens += c  # context read once + new tokens written: c - q + q
            attn_flops += model.attention_flops(q, c)
        if num_tokens == 0:
            return StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        # Per GPU: its share of the weights, of its KV heads' reads and of the FLOPs.
        weight_bytes = float(self.streamed_weight_bytes(num_tokens))
        kv_bytes = float(kv_tokens * self.kv_bytes_per_token)
        flops = num_tokens * self.flops_per_token + attn_flops / self.tensor_parallel_size
        memory_time = (weight_bytes + kv_bytes) / self.bandwidth
        compute_time = flops / self.peak_flops
        comm = self.comm_time_s(num_tokens, num_seqs)
        time = max(memory_time, compute_time) + comm + self.step_overhead_s
        return StepCost(weight_bytes, kv_bytes, flops, memory_time, compute_time, time, comm)

    def step_time(self, chunks: Iterable[tuple[int, int]]) -> float:
        return self.step_cost(chunks).time_s

    def decode_step(self, batch_size: int, context_len: int) -> StepCost:
        """A pure decode step: ``batch_size`` sequences each adding one token at ``context_len``."""
        if batch_size <= 0 or context_len <= 0:
            raise ValueError("batch_size and context_len must be positive")
        return self.step_cost([(1, context_len)] * batch_size)

    def weight_stream_time_s(self) -> float:
        """One GPU streaming all its weights once (a MoE model's large batches read every
        expert; one token reads less: `streamed_weight_bytes`)."""
        return self.rank_weight_bytes / self.bandwidth

    def crossover_batch(self, context_len: int = 0) -> float | None:
        """Decode batch size at which arithmetic time overtakes memory time.

        With ``context_len == 0`` only weight streaming counts: B* = peak * W / (bw * 2P), i.e.
        peak / (2 * bw) per weight byte of a parameter — about 206 for BF16 on an H200. With a
        context, each sequence also reads its KV, which grows the memory side with the batch too;
        if that per-sequence read outweighs the per-sequence arithmetic there is no crossover
        (None): long-context decode stays memory bound at every batch size.
        """
        if context_len < 0:
            raise ValueError("context_len must be >= 0")
        per_seq_compute = self.flops_per_token / self.peak_flops
        per_seq_memory = 0.0
        if context_len:
            per_seq_compute += (
                self.model.attention_flops(1, context_len)
                / self.tensor_parallel_size
                / self.peak_flops
            )
            per_seq_memory = context_len * self.kv_bytes_per_token / self.bandwidth
        slope = per_seq_compute - per_seq_memory
        if slope <= 0:
            return None
        return self.weight_stream_time_s() / slope
