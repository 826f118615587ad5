"""The simulated deployment: one model on one GPU (or split over ``tensor_parallel_size``
GPUs), its KV pool and its step-cost model.

Both systems under comparison (paged continuous batching and the static baseline) are built
from the same :class:`Deployment`, so they get exactly the same memory for KV and the same
cost per step; only the way they use them differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from pagemill.blockpool.config import CacheConfig
from pagemill.scheduler.config import SchedulerConfig
from pagemill.server.sim.cost_model import RooflineCostModel
from pagemill.server.sim.plan import CapacityPlan, make_plan
from pagemill.server.sim.specs import GPUSpec, ModelSpec


@dataclass(frozen=True)
class Deployment:
    """``num_blocks`` overrides the pool the planner would size (small pools keep tests fast and
    let a study put memory pressure on purpose).

    The scheduler and cache knobs are checked by the engine's own `SchedulerConfig` and
    `CacheConfig`, so a simulated deployment accepts exactly what a real engine would.
    """

    model: ModelSpec
    gpu: GPUSpec
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    max_model_len: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    step_overhead_s: float = 0.001
    num_blocks: int | None = None
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        _ = self.scheduler_config, self.cache_config  # validate now, not at the first run
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.max_model_len > self.model.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"{self.model.max_position_embeddings} positions"
            )

    @cached_property
    def scheduler_config(self) -> SchedulerConfig:
        """The paged runs' scheduler limits; experiments vary them with `dataclasses.replace`."""
        return SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
        )

    @cached_property
    def cache_config(self) -> CacheConfig:
        return CacheConfig(
            block_size=self.block_size, gpu_memory_utilization=self.gpu_memory_utilization
        )

    @cached_property
    def plan(self) -> CapacityPlan:
        return make_plan(
            self.model,
            self.gpu,
            weight_dtype=self.weight_dtype,
            kv_dtype=self.kv_dtype,
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            context_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            step_overhead_s=self.step_overhead_s,
            tensor_parallel_size=self.tensor_parallel_size,
        )

    @cached_property
    def pool_blocks(self) -> int:
        blocks = self.num_blocks if self.num_blocks is not None else self.plan.num_blocks
        if blocks <= 0:
            raise ValueError(
                f"{self.model.name} in {self.weight_dtype} leaves no memory for the KV cache on "
                f"{self.gpu.name}"
            )
        return blocks

    @property
    def kv_token_capacity(self) -> int:
        return self.pool_blocks * self.block_size

    @cached_property
    def cost_model(self) -> RooflineCostModel:
        return RooflineCostModel(
            self.model,
            self.gpu,
            self.weight_dtype,
            self.kv_dtype,
            step_overhead_s=self.step_overhead_s,
            tensor_parallel_size=self.tensor_parallel_size,
        )
