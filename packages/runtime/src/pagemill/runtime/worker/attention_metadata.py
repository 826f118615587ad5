"""What every attention layer needs to know about one step's flattened batch.

Built once per step by the model runner and shared by all layers, so per-layer work is
only the kernels themselves: the KV write through `slot_mapping` and attention through
the plan (`pagemill.kernels.plan_attention`), which already holds the decode/prefill split,
the gather indices (CPU) or the launch parameters (Triton).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagemill.kernels import AttentionPlan


@dataclass(slots=True)
class AttentionMetadata:
    """`slot_mapping` [T] int64: the KV-cache slot of each token of the step (-1 = skip)."""

    slot_mapping: torch.Tensor
    plan: AttentionPlan
