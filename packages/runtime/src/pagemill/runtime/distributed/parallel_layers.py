"""The layers whose forward talks to the other ranks: row-parallel linear, vocab-parallel
embedding. (Column-parallel linears need no layer of their own: a rank's fused q|k|v and
gate|up are plain `Linear`s over its slice of the output rows, see `sharding`.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagemill.runtime.distributed.parallel_state import TensorParallelGroup
from pagemill.runtime.model_executor.layers import Linear


class RowParallelLinear(Linear):
    """A `Linear` over this rank's slice of the input columns; the partial products are
    summed over the ranks (one all-reduce), so every rank ends with the full output.

    The bias (when any) is rank 0's alone — the others load zeros — so it is added once.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        tp: TensorParallelGroup,
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", tp={self.tp.rank}/{self.tp.world_size}"


def row_parallel_linear(
    in_features: int,
    out_features: int,
    bias: bool,
    dtype: torch.dtype,
    tp: TensorParallelGroup | None,
) -> Linear:
    """`in_features` is this rank's share; a plain `Linear` without a group."""
    if tp is None:
        return Linear(in_features, out_features, bias, dtype)
    return RowParallelLinear(in_features, out_features, bias, dtype, tp)


def vocab_parallel_embedding(
    input_ids: torch.Tensor, weight: torch.Tensor, vocab_start: int, tp: TensorParallelGroup
) -> torch.Tensor:
    """Look up ids in this rank's rows [vocab_start, vocab_start + len(weight)); ids that
    live on another rank give zeros here, and the all-reduce fills them in from there."""
    local = input_ids - vocab_start
    outside = (local < 0) | (local >= weight.shape[0])
    x = F.embedding(local.masked_fill(outside, 0), weight)
    x.masked_fill_(outside.unsqueeze(-1), 0.0)
    return tp.all_reduce(x)
