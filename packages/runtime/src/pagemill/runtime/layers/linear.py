"""A linear layer whose weight format is the layer's own business.

The model calls `proj(x)` and loads checkpoint rows into `proj.weight` (fused projections
take several checkpoint tensors at row offsets); once every tensor is in, `finalize()` lets
the layer turn the loaded weight into the format it computes with. Dense layers compute
with the weight as loaded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """y = x Wᵀ (+ b), W [out_features, in_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None

    def finalize(self) -> None:
        """Called once all weights are loaded; a dense layer keeps them as they are."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
