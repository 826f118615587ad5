"""The sparse MLP of mixture-of-experts models: router, routed experts, optional shared expert.

Expert weights are stacked per layer — ``w13_weight`` [E, 2I, H] (each expert's gate rows,
then its up rows, as the dense MLP's fused gate|up) and ``w2_weight`` [E, H, I] — and loaded
from the checkpoint's per-expert tensors at their row offsets. The computation is
`pagemill.kernels.fused_moe`: tokens sorted by expert, one GEMM pair per expert with tokens
(CPU) or one grouped-GEMM launch over all of them (Triton). In a compiled graph it is the
opaque op ``pagemill::fused_moe``, so the per-expert loop never breaks or re-specialises the
graph.

A GGUF model served on CPU with its quantized rows packed (the "native" weight scheme) keeps
its experts packed too (`pack`): each expert's gate|up and down rows as the file holds them
— int4 groups (Q4_0/Q4_1/Q4_K), int8 blocks as two int4 planes (Q8_0, Q5_x, Q3_K, IQ4,
requantized Q6_K/Q2_K) — in PyTorch's int4 CPU kernel format, exactly as a packed `Linear`
holds its rows (`quantization.formats`), and runs them through
`pagemill.kernels.fused_moe_int4_cpu` (opaque op ``pagemill::fused_moe_int4``). Rows no
packed format holds (F16/BF16/F32, IQ2, ...) and layers whose rows cannot be packed alike
are dequantized to the dense stacks, as before.

Tensor parallelism shards every expert (and the shared expert) by its intermediate size:
a rank holds rows [r*I/tp, (r+1)*I/tp) of each gate/up and those columns of each down, so
its output is a partial sum; the router is replicated, so every rank routes identically,
and the block's one all-reduce sums the routed and shared partials together.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pagemill.kernels import (
    fused_moe,
    fused_moe_int4_cpu,
    silu_and_mul,
    topk_softmax,
    topk_then_softmax,
)
from pagemill.runtime.distributed.parallel_state import TensorParallelGroup
from pagemill.runtime.model_executor.layers.linear import Linear
from pagemill.runtime.model_executor.quantization.formats import (
    INT4_GROUP_SIZES,
    INT4_N_MULTIPLE,
    Int4Groups,
    Int8Blocks,
    QuantizedRows,
    int4_planes,
    pack_int4,
)
from pagemill.runtime.model_executor.quantization.scheme import KERNEL_DTYPE
from pagemill.runtime.moe_config import MoeSpec

logger = logging.getLogger(__name__)


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class FusedMoE(nn.Module):
    """The routed experts of one layer: ``(x, router_logits) -> this rank's partial sum``.

    gpt-oss's experts add ``bias`` (``w13_bias`` [E, 2I], ``w2_bias`` [E, H]; under tensor
    parallelism rank 0 holds the down bias, the others zeros), use the clamped SwiGLU
    (``activation="swigluoai"`` with its ``swiglu_alpha`` / ``swiglu_limit``) and route by
    a softmax over the top-k logits (``topk_first``).
    """

    # Whether a "native" weight scheme (a GGUF file served in bf16 on CPU) keeps quantized
    # expert rows packed; off, they are dequantized to the dense stacks (for comparisons).
    pack_gguf_experts = True

    # Buffers of packed experts (None while dense).
    w13_qweight: torch.Tensor | None
    w13_scales_zeros: torch.Tensor | None
    w2_qweight: torch.Tensor | None
    w2_scales_zeros: torch.Tensor | None

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
        self.hidden_size = hidden_size
        self.dtype = dtype
        # Set by the model before loading (`plan_packing`); see the module doc.
        self.pack = False
        self.kernel_dtype = KERNEL_DTYPE
        self.group_sizes: list[int] = []
        self.planes: list[int] = []
        self.source = "dense"
        for name in ("w13_qweight", "w13_scales_zeros", "w2_qweight", "w2_scales_zeros"):
            self.register_buffer(name, None)
        # (expert, 13 | 2) -> {row offset: rows}, until the layer's last rows arrive.
        self._pieces: dict[tuple[int, int], dict[int, QuantizedRows]] = {}
        self._rows_loaded = 0

    # ---- loading ---------------------------------------------------------------------------

    def plan_packing(self, method: str, kernel_dtype: torch.dtype | None) -> None:
        """Keep quantized expert rows packed when the model's scheme is "native"."""
        self.pack = method == "native" and type(self).pack_gguf_experts
        self.kernel_dtype = kernel_dtype or KERNEL_DTYPE

    @property
    def packed(self) -> bool:
        return self.w13_qweight is not None

    @torch.no_grad()
    def load_expert_rows(
        self, expert: int, which: int, offset: int, value: torch.Tensor | QuantizedRows
    ) -> None:
        """Rows [offset, offset + len) of expert `expert`'s w13 (`which` 13) or w2 (2)."""
        dest = (self.w13_weight if which == 13 else self.w2_weight)[expert]
        rows = value.shape[0]
        if isinstance(value, torch.Tensor):
            dest.narrow(0, offset, rows).copy_(value)
        elif self.pack:
            self._pieces.setdefault((expert, which), {})[offset] = value
        else:
            # Exact values (fp32), rounded once to the dtype: not recomputed with the
            # scales in that dtype, as a packed kernel would compute.
            dest.narrow(0, offset, rows).copy_(value.dequantize(torch.float32))
        self._rows_loaded += rows
        e, n2, h = self.num_experts, 2 * self.intermediate_size, self.hidden_size
        if self._rows_loaded == e * (n2 + h):
            self._finalize()

    def _finalize(self) -> None:
        """Pack the layer's quantized rows, or dequantize them all when they cannot be."""
        pieces, self._pieces = self._pieces, {}
        if not pieces:
            return
        why = self._why_not_packable(pieces)
        if why is None:
            packed13 = [int4_planes(self._ordered(pieces, j, 13)) for j in range(self.num_experts)]
            packed2 = [int4_planes(self._ordered(pieces, j, 2)) for j in range(self.num_experts)]
            shapes = {(p[3], p[4]) for p in packed13}, {(p[3], p[4]) for p in packed2}
            if len(shapes[0]) == 1 and len(shapes[1]) == 1:
                self._set_packed(packed13, packed2)
                self.source = "+".join(
                    sorted({p.source for rows in pieces.values() for p in rows.values()})
                )
                return
            why = "experts' rows differ in format"
        logger.info("expert rows [%d experts] stay dense: %s", self.num_experts, why)
        for (j, which), rows in pieces.items():
            dest = (self.w13_weight if which == 13 else self.w2_weight)[j]
            for off, p in rows.items():
                dest.narrow(0, off, p.shape[0]).copy_(p.dequantize(torch.float32))

    def _ordered(self, pieces: dict, expert: int, which: int) -> list[QuantizedRows]:
        return [p for _, p in sorted(pieces[(expert, which)].items())]

    def _why_not_packable(
        self, pieces: dict[tuple[int, int], dict[int, QuantizedRows]]
    ) -> str | None:
        if len(pieces) != 2 * self.num_experts:
            return "some expert rows are dense in the file"
        for (_, which), rows in pieces.items():
            need = 2 * self.intermediate_size if which == 13 else self.hidden_size
            if sum(p.shape[0] for p in rows.values()) != need:
                return "some expert rows are dense in the file"
            if not all(isinstance(p, (Int4Groups, Int8Blocks)) for p in rows.values()):
                return "unknown row format"
            sizes = {
                p.group_size if isinstance(p, Int4Groups) else p.block_size for p in rows.values()
            }
            if len(sizes) != 1 or next(iter(sizes)) not in INT4_GROUP_SIZES:
                return (
                    f"group sizes {sorted(sizes)}, the int4 kernel takes one of {INT4_GROUP_SIZES}"
                )
            if need % INT4_N_MULTIPLE:
                return f"{need} rows are not a multiple of {INT4_N_MULTIPLE}"
        return None

    def _set_packed(self, packed13: list, packed2: list) -> None:
        kdt = self.kernel_dtype
        for name, packed in (("w13", packed13), ("w2", packed2)):
            qs, szs = [], []
            for q, s, z, _, _ in packed:
                qweight, sz = pack_int4(q, s, z, kdt)
                qs.append(qweight)
                szs.append(sz)
            setattr(self, f"{name}_qweight", torch.stack(qs))
            setattr(self, f"{name}_scales_zeros", torch.stack(szs))
        self.group_sizes = [packed13[0][3], packed2[0][3]]
        self.planes = [packed13[0][4], packed2[0][4]]
        # The dense stacks were never written: drop them before they are ever touched.
        self.w13_weight = None  # type: ignore[assignment]
        self.w2_weight = None  # type: ignore[assignment]

    def packed_nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (
                self.w13_qweight,
                self.w13_scales_zeros,
                self.w2_qweight,
                self.w2_scales_zeros,
            )
            if t is not None
        )

    # ---- compute ---------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if self.topk_first:
            weights, ids = topk_then_softmax(router_logits, self.top_k)
        else:
            weights, ids = topk_softmax(router_logits, self.top_k, self.renormalize)
        if self.w13_qweight is not None:
            return self._forward_packed(x, weights, ids)
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

    def _forward_packed(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        args = (
            x,
            self.w13_qweight,
            self.w13_scales_zeros,
            self.w2_qweight,
            self.w2_scales_zeros,
            weights,
            ids,
            self.group_sizes,
            self.planes,
            self.w13_bias,
            self.w2_bias,
            self.activation,
            self.swiglu_alpha,
            self.swiglu_limit,
        )
        if torch.compiler.is_compiling():
            out: torch.Tensor = torch.ops.pagemill.fused_moe_int4(*args)
            return out
        return fused_moe_int4_cpu(*args)  # type: ignore[arg-type]

    def extra_repr(self) -> str:
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        s = f"experts={e}, top_k={self.top_k}, hidden={h}, intermediate={i}"
        if self.packed:
            fmt = "int4x2" if self.planes != [1, 1] else "int4"
            s += f", packed {self.source} as {fmt} (planes {self.planes})"
        return s


class ExpertRows(Linear):
    """A load target for one expert's w13 (gate then up rows) or w2 rows: the model's
    `load_weights` hands `Linear`s dense or quantized rows as they come, and the experts
    decide what to keep (`FusedMoE.load_expert_rows`). Holds no weight of its own."""

    def __init__(self, experts: FusedMoE, expert: int, which: int) -> None:
        nn.Module.__init__(self)
        self.in_features = experts.hidden_size if which == 13 else experts.intermediate_size
        self.out_features = 2 * experts.intermediate_size if which == 13 else experts.hidden_size
        # Not a submodule: the experts stay the only owner of the rows.
        object.__setattr__(self, "_experts", experts)
        self._where = (expert, which)

    def load_rows(self, offset: int, value: torch.Tensor | QuantizedRows) -> None:
        experts: FusedMoE = object.__getattribute__(self, "_experts")
        experts.load_expert_rows(self._where[0], self._where[1], offset, value)


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
        inter, hidden = e.intermediate_size, e.hidden_size
        gate, up, down = names
        t: dict[str, list[tuple[torch.Tensor | Linear, int, int]]] = {
            prefix + "gate.weight": [(self.gate, 0, e.num_experts)]
        }
        for j in range(e.num_experts):
            p = f"{prefix}experts.{j}."
            w13, w2 = ExpertRows(e, j, 13), ExpertRows(e, j, 2)
            t[p + f"{gate}.weight"] = [(w13, 0, inter)]
            t[p + f"{up}.weight"] = [(w13, inter, inter)]
            t[p + f"{down}.weight"] = [(w2, 0, hidden)]
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            s = self.shared_expert
            si = s.down_proj.in_features
            p = prefix + "shared_expert."
            t[p + "gate_proj.weight"] = [(s.gate_up_proj, 0, si)]
            t[p + "up_proj.weight"] = [(s.gate_up_proj, si, si)]
            t[p + "down_proj.weight"] = [(s.down_proj, 0, hidden)]
            t[prefix + "shared_expert_gate.weight"] = [(self.shared_expert_gate, 0, 1)]
        return t
