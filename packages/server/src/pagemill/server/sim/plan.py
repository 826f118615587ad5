"""`pagemill plan`: how many requests fit on a card and how fast a decode step can be.

Pure arithmetic on a :class:`ModelSpec` and a :class:`GPUSpec`, with the pool sized by the same
``pagemill.blockpool`` functions the runtime uses, so the plan and a real engine agree on the
block count for the same budget. With tensor parallelism every number is per GPU (its
share of the weights, its KV heads), and the step times include the all-reduces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagemill.blockpool import num_blocks_for_budget
from pagemill.blockpool.config import CacheConfig
from pagemill.server.sim.cost_model import RooflineCostModel, StepCost
from pagemill.server.sim.specs import GPUSpec, ModelSpec

GIB = 1024**3
DEFAULT_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def estimate_activation_bytes(
    model: ModelSpec, max_num_batched_tokens: int, max_num_seqs: int, act_bytes: int = 2
) -> int:
    """Peak transient memory of one forward pass over a full token budget.

    The widest live tensors of a Llama-style layer sit in the MLP (gate and up projections, their
    activated product) next to the residual stream and the QKV projection; the logits of the
    sampled rows are kept in fp32 and copied once by the sampler. This is the amount a profiling
    run would find, give or take the allocator's slack that ``gpu_memory_utilization`` absorbs.
    """
    if max_num_batched_tokens <= 0 or max_num_seqs <= 0:
        raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
    m = model
    qkv = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
    per_token = (3 * m.intermediate_size + 3 * m.hidden_size + qkv) * act_bytes
    logits = 2 * min(max_num_seqs, max_num_batched_tokens) * m.vocab_size * 4
    return max_num_batched_tokens * per_token + logits


@dataclass(frozen=True)
class RooflinePoint:
    """A decode step of ``batch_size`` sequences at the plan's context length (``cost``), and
    at a one-token context (``weights_only``), where only weight streaming and the
    arithmetic compete: the textbook roofline with its crossover."""

    batch_size: int
    cost: StepCost
    weights_only: StepCost

    @property
    def tokens_per_s(self) -> float:
        return self.batch_size / self.cost.time_s

    @property
    def weights_only_tokens_per_s(self) -> float:
        return self.batch_size / self.weights_only.time_s


@dataclass(frozen=True)
class CapacityPlan:
    model: ModelSpec
    gpu: GPUSpec
    weight_dtype: str
    kv_dtype: str
    block_size: int
    gpu_memory_utilization: float
    context_len: int
    num_params: int
    weight_bytes: int
    kv_bytes_per_token: int
    usable_bytes: int
    activation_reserve_bytes: int
    kv_budget_bytes: int
    num_blocks: int
    weight_stream_time_s: float
    crossover_batch: float | None
    crossover_batch_at_context: float | None
    roofline: list[RooflinePoint] = field(default_factory=list)
    tensor_parallel_size: int = 1
    rank_weight_bytes: int | None = None  # one GPU's share (= weight_bytes on one GPU)
    # One all-reduce of a decode step's activations (per roofline batch size), seconds.
    all_reduce_s: dict[int, float] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        """Weights and the activation reserve fit, with room for at least one block."""
        return self.num_blocks > 0

    @property
    def kv_token_capacity(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_context_tokens(self) -> int:
        """Longest single sequence: the pool or the model's position limit, whichever is less."""
        return min(self.kv_token_capacity, self.model.max_position_embeddings)

    @property
    def blocks_per_sequence(self) -> int:
        return math.ceil(self.context_len / self.block_size)

    @property
    def max_concurrent_seqs(self) -> int:
        """Sequences that can all reach ``context_len`` at once (paged: whole blocks each)."""
        return self.num_blocks // self.blocks_per_sequence

    def as_dict(self) -> dict[str, object]:
        return {
            "model": self.model.name,
            "gpu": self.gpu.name,
            "weight_dtype": self.weight_dtype,
            "kv_dtype": self.kv_dtype,
            "block_size": self.block_size,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "context_len": self.context_len,
            "num_params": self.num_params,
            "active_params": self.model.active_params,
            "weight_bytes": self.weight_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "gpu_memory_bytes": self.gpu.memory_bytes,
            "usable_bytes": self.usable_bytes,
            "activation_reserve_bytes": self.activation_reserve_bytes,
            "kv_budget_bytes": self.kv_budget_bytes,
            "num_blocks": self.num_blocks,
            "kv_token_capacity": self.kv_token_capacity,
            "max_context_tokens": self.max_context_tokens,
            "max_concurrent_seqs": self.max_concurrent_seqs,
            "fits": self.fits,
            "weight_stream_time_s": self.weight_stream_time_s,
            "crossover_batch": self.crossover_batch,
            "crossover_batch_at_context": self.crossover_batch_at_context,
            "tensor_parallel_size": self.tensor_parallel_size,
            "rank_weight_bytes": self.rank_weight_bytes,
            "roofline": [
                {
                    "batch_size": p.batch_size,
                    "step_time_s": p.cost.time_s,
                    "tokens_per_s": p.tokens_per_s,
                    "bound": p.cost.bound,
                    "weights_only_step_time_s": p.weights_only.time_s,
                    "weights_only_bound": p.weights_only.bound,
                    "comm_time_s": p.cost.comm_time_s,
                    "all_reduce_s": self.all_reduce_s.get(p.batch_size, 0.0),
                }
                for p in self.roofline
            ],
        }


def make_plan(
    model: ModelSpec,
    gpu: GPUSpec,
    *,
    weight_dtype: str = "bf16",
    kv_dtype: str = "bf16",
    block_size: int = 16,
    gpu_memory_utilization: float = 0.9,
    context_len: int | None = None,
    activation_reserve_bytes: int | None = None,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 256,
    step_overhead_s: float = 0.0,
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES,
    tensor_parallel_size: int = 1,
) -> CapacityPlan:
    """Size the KV pool the way the engine does: (memory * utilization) - weights - activations
    (per GPU: its share of the weights, its KV heads, under tensor parallelism)."""
    # The engine's own checks of these knobs, with its messages.
    CacheConfig(block_size=block_size, gpu_memory_utilization=gpu_memory_utilization)
    if context_len is None:
        context_len = min(8192, model.max_position_embeddings)
    if context_len <= 0:
        raise ValueError(f"context_len must be positive, got {context_len}")
    if context_len > model.max_position_embeddings:
        raise ValueError(
            f"context_len {context_len} exceeds {model.name}'s "
            f"{model.max_position_embeddings} positions"
        )
    if any(b <= 0 for b in batch_sizes):
        raise ValueError("batch sizes must be positive")
    cost = RooflineCostModel(
        model,
        gpu,
        weight_dtype,
        kv_dtype,
        step_overhead_s=step_overhead_s,
        tensor_parallel_size=tensor_parallel_size,
    )
    if activation_reserve_bytes is None:
        activation_reserve_bytes = estimate_activation_bytes(
            model, max_num_batched_tokens, max_num_seqs
        )
    if activation_reserve_bytes < 0:
        raise ValueError("activation_reserve_bytes must be >= 0")
    usable = int(gpu.memory_bytes * gpu_memory_utilization)
    budget = max(0, usable - cost.rank_weight_bytes - activation_reserve_bytes)
    num_blocks = num_blocks_for_budget(budget, block_size, cost.kv_bytes_per_token)
    roofline = [
        RooflinePoint(b, cost.decode_step(b, context_len), cost.decode_step(b, 1))
        for b in batch_sizes
    ]
    return CapacityPlan(
        model=model,
        gpu=gpu,
        weight_dtype=weight_dtype,
        kv_dtype=kv_dtype,
        block_size=block_size,
        gpu_memory_utilization=gpu_memory_utilization,
        context_len=context_len,
        num_params=model.num_params,
        weight_bytes=cost.weight_bytes,
        kv_bytes_per_token=cost.kv_bytes_per_token,
        usable_bytes=usable,
        activation_reserve_bytes=activation_reserve_bytes,
        kv_budget_bytes=budget,
        num_blocks=num_blocks,
        weight_stream_time_s=cost.weight_stream_time_s(),
        crossover_batch=cost.crossover_batch(),
        crossover_batch_at_context=cost.crossover_batch(context_len),
        roofline=roofline,
        tensor_parallel_size=tensor_parallel_size,
        rank_weight_bytes=cost.rank_weight_bytes,
        all_reduce_s={
            b: cost.all_reduce_time_s(b * model.hidden_size * cost.activation_bytes)
            for b in batch_sizes
        }
        if tensor_parallel_size > 1
        else {},
    )


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB ({n / GIB:,.2f} GiB)"


def format_plan(plan: CapacityPlan) -> str:
    """The plan as the plain-text report `pagemill plan` prints."""
    m, g = plan.model, plan.gpu
    lines = [
        f"model  {m.name}: {plan.num_params / 1e9:.3f} B params, {m.num_layers} layers, "
        f"{m.num_heads} heads / {m.num_kv_heads} KV heads x {m.head_dim}",
        f"gpu    {g.name}: {g.memory_bytes / GIB:.1f} GiB, "
        f"{g.bandwidth_bytes_per_s / 1e12:.2f} TB/s, {g.bf16_flops / 1e12:.0f} TFLOP/s dense bf16",
        f"dtypes weights {plan.weight_dtype}, KV {plan.kv_dtype}; block size {plan.block_size}",
    ]
    if m.num_experts:
        lines.insert(
            1,
            f"       mixture of experts: {m.num_experts_per_tok} of {m.num_experts} experts in "
            f"{m.num_sparse_layers} layers; {m.active_params / 1e9:.3f} B params active per "
            f"token (held: all {plan.num_params / 1e9:.3f} B; a decode step streams the "
            "experts its tokens picked)",
        )
    tp = plan.tensor_parallel_size
    if tp > 1:
        # make_plan's cost model refuses tensor parallelism on a GPU without link figures
        assert g.link_bandwidth_bytes_per_s is not None and g.link_latency_s is not None
        lines.append(
            f"tensor parallel over {tp} GPUs (link {g.link_bandwidth_bytes_per_s / 1e9:,.0f} GB/s "
            f"each way, {g.link_latency_s * 1e6:.0f} us a ring step): everything below is per "
            f"GPU; each layer all-reduces twice per step"
        )
    lines += [
        "",
        f"weights                  {_gb(plan.weight_bytes)}"
        + (f", {_gb(plan.rank_weight_bytes or 0)} per GPU" if tp > 1 else ""),
        f"KV bytes per token       {plan.kv_bytes_per_token:,}",
        f"{f'usable memory ({plan.gpu_memory_utilization:.0%})':<24} {_gb(plan.usable_bytes)}",
        f"activation reserve       {_gb(plan.activation_reserve_bytes)}",
        f"KV pool budget           {_gb(plan.kv_budget_bytes)}",
        f"KV blocks                {plan.num_blocks:,} ({plan.kv_token_capacity:,} tokens)",
        f"max context (1 seq)      {plan.max_context_tokens:,} tokens "
        f"(model limit {m.max_position_embeddings:,})",
        f"{f'max seqs at {plan.context_len:,} tokens':<24} {plan.max_concurrent_seqs:,}",
    ]
    if not plan.fits:
        lines.append(
            "DOES NOT FIT: weights + activation reserve exceed the usable memory "
            "(try a smaller dtype, a bigger GPU or tensor parallelism)"
        )
    lines += [
        "",
        f"decode step streams the weights in {plan.weight_stream_time_s * 1e3:.2f} ms",
        "crossover batch (weights only)     "
        + (f"{plan.crossover_batch:,.0f}" if plan.crossover_batch else "none"),
        f"crossover batch at {plan.context_len:,} ctx tokens  "
        + (
            f"{plan.crossover_batch_at_context:,.0f}"
            if plan.crossover_batch_at_context
            else "none (KV reads keep decode memory bound at any batch)"
        ),
    ]
    if tp > 1:
        lines.append(
            "all-reduce per layer (x2): "
            + ", ".join(f"batch {b} {t * 1e6:,.0f} us" for b, t in plan.all_reduce_s.items())
        )
    lines += [
        "",
        "decode roofline: step time vs batch, with no context (weights only) and with "
        f"{plan.context_len:,} context tokens per sequence",
        f"{'':>7} {'--- weights only ---':>31}   {f'--- at {plan.context_len:,} ctx ---':>41}",
        f"{'batch':>7} {'step ms':>9} {'tok/s':>11} {'bound':>9}   {'step ms':>9} {'tok/s':>9} "
        f"{'KV GB':>8} {'bound':>8} {'fits':>5}" + (f" {'comm ms':>8}" if tp > 1 else ""),
    ]
    for p in plan.roofline:
        fits = "yes" if p.batch_size <= plan.max_concurrent_seqs else "no"
        w = p.weights_only
        lines.append(
            f"{p.batch_size:>7} {w.time_s * 1e3:>9.2f} {p.weights_only_tokens_per_s:>11,.0f} "
            f"{w.bound:>9}   {p.cost.time_s * 1e3:>9.2f} {p.tokens_per_s:>9,.0f} "
            f"{p.cost.kv_bytes / 1e9:>8.2f} {p.cost.bound:>8} {fits:>5}"
            + (f" {p.cost.comm_time_s * 1e3:>8.3f}" if tp > 1 else "")
        )
    return "\n".join(lines)
