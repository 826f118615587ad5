"""The sparse MLP of mixture-of-experts models: router, routed experts, optional shared expert.

Expert weights are stacked per layer — ``w13_weight`` [E, 2I, H] (each expert's gate rows,
then its up rows, as the dense MLP's fused gate|up) and ``w2_weight`` [E, H, I] — and loaded
from the checkpoint's per-expert tensors at their row offsets. The computation is
`pagemill.kernels.fused_moe`: tokens sorted by expert, one GEMM pair per expert with tokens
(CPU) or one grouped-GEMM launch over all of them (Triton). In a compiled graph it is the
opaque op ``pagemill::fused_moe``, so the per-expert loop never breaks or re-specialises the
graph.

Tensor parallelism shards every expert (and the shared expert) by its intermediate size:
a rank holds rows [r*I/tp, (r+1)*I/tp) of each gate/up and those columns of each down, so
its output is a partial sum; the router is replicated, so every rank routes identically,
and the block's one all-reduce sums the routed and shared partials together.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagemill.kernels import fused_moe, silu_and_mul, topk_softmax, topk_then_softmax
from pagemill.runtime.distributed.parallel_state import TensorParallelGroup
from pagemill.runtime.model_executor.layers.linear import Linear
from pagemill.runtime.moe_config import MoeSpec


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class FusedMoE(nn.Module):
    """The routed experts of one layer: ``(x, router_logits) -> this rank's partial sum``.

    gpt-oss's experts add ``bias`` (``w13_bias`` [E, 2I], ``w2_bias`` [E, H]; under tensor
    parallelism rank 0 holds the down bias, the others zeros), use the clamped SwiGLU
    (``activation="swigluoai"`` with its ``swiglu_alpha`` / ``swiglu_limit``) and route by
    a softmax over the top-k logits (``topk_first``).
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        dtype: torch.dtype,
        *,
        bias: bool = False,
        activation: str = "silu",
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        topk_first: bool = False,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.activation = activation
        self.swiglu_alpha = float(swiglu_alpha)
        self.swiglu_limit = float(swiglu_limit)
        self.topk_first = topk_first
        self.w13_weight = _param(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype)
        self.w2_weight = _param(num_experts, hidden_size, intermediate_size, dtype=dtype)
        self.w13_bias: nn.Parameter | None = None
        self.w2_bias: nn.Parameter | None = None
        if bias:
            self.w13_bias = _param(num_experts, 2 * intermediate_size, dtype=dtype)
            self.w2_bias = _param(num_experts, hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if self.topk_first:
            weights, ids = topk_then_softmax(router_logits, self.top_k)
        else:
            weights, ids = topk_softmax(router_logits, self.top_k, self.renormalize)
        args = (
            x,
            self.w13_weight,
            self.w2_weight,
            weights,
            ids,
            self.w13_bias,
            self.w2_bias,
            self.activation,
            self.swiglu_alpha,
            self.swiglu_limit,
        )
        if torch.compiler.is_compiling():
            out: torch.Tensor = torch.ops.pagemill.fused_moe(*args)
            return out
        return fused_moe(*args)

    def extra_repr(self) -> str:
        e, n2, h = self.w13_weight.shape
        return f"experts={e}, top_k={self.top_k}, hidden={h}, intermediate={n2 // 2}"


class SharedExpert(nn.Module):
    """A dense gated MLP every token runs (Qwen2-MoE), without its own all-reduce."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, False, dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ a sigmoid-gated shared expert), all-reduced once."""

    def __init__(
        self,
        spec: MoeSpec,
        hidden_size: int,
        dtype: torch.dtype,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        n = 1 if tp is None else tp.world_size
        self.tp = tp
        # The router stays a plain dense parameter: a quantized router could flip top-k picks.
        self.gate = _param(spec.num_experts, hidden_size, dtype=dtype)
        self.experts = FusedMoE(
            spec.num_experts,
            spec.top_k,
            hidden_size,
            spec.intermediate_size // n,
            spec.renormalize,
            dtype,
        )
        self.shared_expert: SharedExpert | None = None
        self.shared_expert_gate: nn.Parameter | None = None
        if spec.shared_intermediate_size:
            shared = spec.shared_intermediate_size // n
            self.shared_expert = SharedExpert(hidden_size, shared, dtype)
            self.shared_expert_gate = _param(1, hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, F.linear(x, self.gate))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = torch.sigmoid(F.linear(x, self.shared_expert_gate))
            out = out + gate * self.shared_expert(x)
        return out if self.tp is None else self.tp.all_reduce(out)

    def targets(
        self, prefix: str, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    ) -> dict[str, list[tuple[torch.Tensor | Linear, int, int]]]:
        """Checkpoint name -> (parameter or Linear, row offset, rows), as `_targets` wants.

        ``prefix`` is the block's (``model.layers.{i}.mlp.``); ``names`` the expert
        projections' (Mixtral: w1, w3, w2). Expert rows land in views of the stacked weights.
        """
        e = self.experts
        inter, hidden = e.intermediate_size, e.w2_weight.shape[1]
        gate, up, down = names
        t: dict[str, list[tuple[torch.Tensor | Linear, int, int]]] = {
            prefix + "gate.weight": [(self.gate, 0, e.num_experts)]
        }
        for j in range(e.num_experts):
            p = f"{prefix}experts.{j}."
            t[p + f"{gate}.weight"] = [(e.w13_weight[j], 0, inter)]
            t[p + f"{up}.weight"] = [(e.w13_weight[j], inter, inter)]
            t[p + f"{down}.weight"] = [(e.w2_weight[j], 0, hidden)]
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            s = self.shared_expert
            si = s.down_proj.in_features
            p = prefix + "shared_expert."
            t[p + "gate_proj.weight"] = [(s.gate_up_proj, 0, si)]
            t[p + "up_proj.weight"] = [(s.gate_up_proj, si, si)]
            t[p + "down_proj.weight"] = [(s.down_proj, 0, hidden)]
            t[prefix + "shared_expert_gate.weight"] = [(self.shared_expert_gate, 0, 1)]
        return t
