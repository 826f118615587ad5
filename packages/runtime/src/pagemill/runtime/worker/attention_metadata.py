"""What every attention layer needs to know about one step's flattened batch.

Built once per step by the model runner and shared by all layers, so per-layer work is
only the kernels themselves: the KV write through `slot_mapping` and attention through
the plan (`pagemill.kernels.plan_attention`), which already holds the decode/prefill split,
the gather indices (CPU) or the launch parameters (Triton).

With KV cache groups (full-attention and windowed layers with their own block tables) the
slots and the plan differ per group: `groups` holds one metadata per group and each
attention layer takes its group's (`groups[kv_group]`); the top-level fields are group 0's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagemill.kernels import AttentionPlan


@dataclass(slots=True)
class AttentionMetadata:
    """`slot_mapping` [T] int64: the KV-cache slot of each token of the step (-1 = skip).

    `native_decode`: a decode-only step whose block tables and context lengths the runner
    has written into the layers' decode buffers (`LlamaAttention.decode_tables`), so a
    compiled graph calls the C++ decode operator with them instead of the attention custom
    op with the plan; a graph of its own (dynamo guards on the flag).

    `plan` may be None on such a step: the graph does not read it, and planning is host
    work on the batch-1 step's critical path, so it is built from `plan_source` only when
    something runs attention eagerly (`attention_plan()`)."""

    slot_mapping: torch.Tensor
    plan: AttentionPlan | None
    groups: list[AttentionMetadata] | None = None
    native_decode: bool = False
    plan_source: Callable[[], AttentionPlan] | None = None

    def attention_plan(self) -> AttentionPlan:
        """The step's plan, built on first use when the runner deferred it."""
        if self.plan is None:
            if self.plan_source is None:
                raise RuntimeError("attention metadata without a plan or a way to build one")
            self.plan = self.plan_source()
        return self.plan

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata of KV cache group `group` (itself when there is one group)."""
        return self if self.groups is None else self.groups[group]
