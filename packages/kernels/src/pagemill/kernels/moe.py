"""Mixture-of-experts: route each token to its top-k experts, run them, combine.

The layer is ``sum_j w_j * down_e(silu(gate_e(x)) * up_e(x))`` over a token's top-k
experts ``e = ids[j]``. Computing it token by token reads every chosen expert's weights
once per token; the fused form (as vLLM's ``fused_moe``) sorts the (token, slot) pairs by
expert so each expert's weights are read once per step and multiply all its tokens in one
GEMM. Weights are stacked per layer: ``w13`` [E, 2I, H] (gate rows, then up rows, as the
dense MLP's fused gate|up) and ``w2`` [E, H, I].

* `topk_softmax`: the router — softmax over all experts in fp32, then top-k (ties as
  `torch.topk` breaks them), optionally renormalised over the k chosen (Mixtral; Qwen
  with ``norm_topk_prob``). `topk_then_softmax` is gpt-oss's order: top-k of the raw
  logits, then a softmax over the k chosen (the same weights up to rounding, and ties
  broken on the logits, as transformers breaks them).
* Experts may carry biases (``w13_bias`` [E, 2I], ``w2_bias`` [E, H]; gpt-oss) and an
  activation other than SiLU-and-mul: ``"swigluoai"`` is gpt-oss's clamped SwiGLU,
  ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``
  (vLLM's name for it).
* `fused_moe_torch`: the CPU path — one argsort by expert, then per expert that has tokens
  one gate|up GEMM, SiLU-and-mul and one down GEMM on its contiguous block of sorted rows,
  and a single weighted ``index_add`` back to the tokens. Experts without tokens cost
  nothing but a skipped loop step (the loop is over experts, never over tokens).
* `fused_moe_int4_cpu`: the same loop with each expert's gate|up and down packed for
  PyTorch's int4 CPU kernel (GGUF experts kept as the file holds them: int4 groups, or
  int8 blocks as two int4 planes); ``torch.ops.pagemill.fused_moe_int4`` is its opaque op.
* `fused_moe_triton`: the GPU path (`pagemill.kernels._triton.moe`) — token blocks padded
  per expert, one grouped-GEMM launch for gate|up and one for down.
* `fused_moe`: dispatch by device; ``torch.ops.pagemill.fused_moe`` is the same as an opaque
  custom op for compiled graphs (the per-expert loop depends on the routing, which a
  graph cannot specialise on).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagemill.kernels._dispatch import (
    cdiv,
    check_triton_device,
    interpreting,
    lazy_kernels,
    use_triton,
)
from pagemill.kernels.activation import silu_and_mul

_kernels = lazy_kernels("moe")


def topk_softmax(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (weights fp32 [T, k], expert ids int64 [T, k])."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def topk_then_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (softmax over the top-k logits, fp32 [T, k]; expert ids int64 [T, k])."""
    values, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(values, dim=-1, dtype=torch.float32), ids


ACTIVATIONS = ("silu", "swigluoai")


def swigluoai_and_mul(x: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU over ``[..., gate | up]`` (gate columns, then up columns)."""
    i = x.shape[-1] // 2
    gate = x[..., :i].clamp(max=limit)
    up = x[..., i:].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _act(x: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    if activation == "silu":
        return silu_and_mul(x)
    return swigluoai_and_mul(x, alpha, limit)


def _check(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> None:
    if w13.dim() != 3 or w2.dim() != 3 or x.dim() != 2:
        raise ValueError("fused_moe takes x [T, H], w13 [E, 2I, H] and w2 [E, H, I]")
    e, n2, h = w13.shape
    if x.shape[1] != h or tuple(w2.shape) != (e, h, n2 // 2) or n2 % 2:
        raise ValueError(
            f"fused_moe shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
            f"w2 {tuple(w2.shape)}"
        )
    if weights.shape != ids.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk weights {tuple(weights.shape)} and ids {tuple(ids.shape)}")


def _check_extras(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    activation: str,
) -> None:
    e, n2, h = w13.shape
    if w13_bias is not None and tuple(w13_bias.shape) != (e, n2):
        raise ValueError(f"w13_bias must be [{e}, {n2}], got {tuple(w13_bias.shape)}")
    if w2_bias is not None and tuple(w2_bias.shape) != (e, h):
        raise ValueError(f"w2_bias must be [{e}, {h}], got {tuple(w2_bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def _sorted_experts(
    x: torch.Tensor,
    num_experts: int,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_mlp,  # (expert, rows [n, H]) -> [n, H]
) -> torch.Tensor:
    """Sort the (token, slot) pairs by expert, run `expert_mlp` once per expert with tokens
    on its contiguous block of rows, and add the weighted rows back to their tokens."""
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    # Stable: a token's slots keep their order within an expert, so the sum is formed in the
    # same order as an expert-by-expert loop (transformers' eager block) forms it.
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tokens = order // k
    xs = x.index_select(0, tokens)
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        ys[start : start + n] = expert_mlp(e, xs[start : start + n])
        start += n
    ys = ys * topk_weights.reshape(-1)[order].to(ys.dtype).unsqueeze(-1)
    out = torch.zeros_like(x)
    out.index_add_(0, tokens, ys)
    return out


def _act_rows(gate_up: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    if activation == "silu":
        i = gate_up.shape[-1] // 2
        return F.silu(gate_up[:, :i]) * gate_up[:, i:]
    return swigluoai_and_mul(gate_up, alpha, limit)


def fused_moe_torch(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> torch.Tensor:
    """x [T, H] -> [T, H] (the experts' weighted sum, in x's dtype)."""
    _check(x, w13, w2, topk_weights, topk_ids)
    _check_extras(w13, w2, w13_bias, w2_bias, activation)

    def expert_mlp(e: int, seg: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(seg, w13[e], None if w13_bias is None else w13_bias[e])
        act = _act_rows(gate_up, activation, swiglu_alpha, swiglu_limit)
        return F.linear(act, w2[e], None if w2_bias is None else w2_bias[e])

    return _sorted_experts(x, w13.shape[0], topk_weights, topk_ids, expert_mlp)


def _int4_mm(
    x: torch.Tensor, qweight: torch.Tensor, sz: torch.Tensor, group_size: int, planes: int
) -> torch.Tensor:
    """One expert's packed GEMM: PyTorch's int4 CPU kernel, the input repeated per plane
    (two planes carry an int8 block format exactly; see the runtime's `formats`)."""
    xk = x if x.dtype == sz.dtype else x.to(sz.dtype)
    if planes > 1:
        xk = torch.cat([xk] * planes, dim=-1)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(xk.contiguous(), qweight, group_size, sz)


def fused_moe_int4_cpu(
    x: torch.Tensor,
    w13_qweight: torch.Tensor,
    w13_scales_zeros: torch.Tensor,
    w2_qweight: torch.Tensor,
    w2_scales_zeros: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    group_sizes: list[int],
    planes: list[int],
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> torch.Tensor:
    """`fused_moe_torch` with each expert's weights packed for PyTorch's int4 CPU kernel
    (``_weight_int4pack_mm_for_cpu``, as a packed `Linear` holds them): ``w13_qweight``
    [E, 2I, ...] / ``w2_qweight`` [E, H, ...] as ``_convert_weight_to_int4pack_for_cpu``
    packs one expert, ``*_scales_zeros`` [E, planes * K / g, N, 2] in the kernel dtype
    (bf16: the kernel is vectorized for it), ``group_sizes`` / ``planes`` (w13's, w2's).
    The kernel computes in the scales' dtype; the result comes back in x's."""
    if x.dim() != 2 or w13_qweight.shape[0] != w2_qweight.shape[0]:
        raise ValueError("fused_moe_int4_cpu takes x [T, H] and per-expert stacks of one size")
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk weights {tuple(topk_weights.shape)} and ids {tuple(topk_ids.shape)}"
        )
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    (g13, g2), (p13, p2) = group_sizes, planes
    h = x.shape[1]
    if w13_scales_zeros.shape[1] * g13 != p13 * h:
        raise ValueError(f"w13 scales {tuple(w13_scales_zeros.shape)} do not fit hidden {h}")

    def expert_mlp(e: int, seg: torch.Tensor) -> torch.Tensor:
        gate_up = _int4_mm(seg, w13_qweight[e], w13_scales_zeros[e], g13, p13).to(x.dtype)
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[e]
        act = _act_rows(gate_up, activation, swiglu_alpha, swiglu_limit)
        down = _int4_mm(act, w2_qweight[e], w2_scales_zeros[e], g2, p2).to(x.dtype)
        return down if w2_bias is None else down + w2_bias[e]

    return _sorted_experts(x, w13_qweight.shape[0], topk_weights, topk_ids, expert_mlp)


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort (token, slot) pairs by expert, each expert's run padded to a multiple of block_m.

    Returns ``sorted_ids`` [P] (a flat pair index ``token * k + slot``; padding holds
    ``T * k``, one past the last pair, which the kernel masks), ``expert_ids`` [P / block_m]
    (the expert of each block) and the padded length P as a 1-element tensor. P is bounded
    by ``T * k + E * (block_m - 1)``; the arrays are allocated at that bound so that the
    launch grid never depends on the routing (no host sync).
    """
    flat = topk_ids.reshape(-1)
    numel = flat.numel()
    # Not bincount: on CUDA it reads the largest id back to the host, which a CUDA graph
    # capture (decode steps) cannot do.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    # Position of each sorted pair inside its expert's run.
    run_starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(numel, device=flat.device) - run_starts[sorted_experts]
    max_len = numel + num_experts * (block_m - 1)
    max_len = cdiv(max_len, block_m) * block_m
    sorted_ids = torch.full((max_len,), numel, dtype=torch.int32, device=flat.device)
    sorted_ids[starts[sorted_experts] + rank] = order.to(torch.int32)
    # Blocks past the last expert's run get expert -1: the kernel writes nothing for them.
    block_starts = torch.arange(0, max_len, block_m, device=flat.device)
    expert_ids = torch.searchsorted(ends, block_starts, right=True).to(torch.int32)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)


def _grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor | None,
    top_k: int,
    a_per_pair: bool,
    block_m: int,
    bias: torch.Tensor | None = None,
) -> None:
    """``c[pair] = (a[row(pair)] @ b[expert]ᵀ + bias[expert])`` (times the pair's weight)
    per sorted block."""
    n, k = b.shape[1], b.shape[2]
    dot_fp32 = interpreting() or a.dtype == torch.float32
    # Tiles: 16-bit operands take tensor-core tiles; fp32 (CUDA-core ieee dots, operands in
    # registers) and the interpreter smaller ones. Checked ahead of time: tests/aot_compile.
    block_n = 32 if dot_fp32 else 64
    block_k = 32 if dot_fp32 else 64
    grid = (expert_ids.shape[0], cdiv(n, block_n))
    _kernels.fused_moe_kernel[grid](
        a,
        b,
        c,
        c if weights is None else weights,
        c if bias is None else bias,
        sorted_ids,
        expert_ids,
        c.shape[0],  # pairs: c has one row per (token, slot)
        n,
        k,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        0 if bias is None else bias.stride(0),
        TOP_K=top_k,
        A_PER_PAIR=a_per_pair,
        MUL_WEIGHT=weights is not None,
        HAS_BIAS=bias is not None,
        DOT_FP32=dot_fp32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    block_m: int | None = None,
) -> torch.Tensor:
    """The grouped-GEMM kernel: gate|up (+ bias) over sorted token blocks, the activation,
    down (+ bias) with the routing weight applied per pair, and the k slots of each token
    summed."""
    _check(x, w13, w2, topk_weights, topk_ids)
    _check_extras(w13, w2, w13_bias, w2_bias, activation)
    check_triton_device(x, w13, w2)
    t, k = topk_ids.shape
    e, n2, _ = w13.shape
    if t == 0:
        return torch.zeros_like(x)
    if block_m is None:
        # Few pairs per expert (decode): small blocks waste less padding.
        block_m = 16 if t * k <= 4 * e else 64
    sorted_ids, expert_ids, _ = moe_align_block_size(topk_ids, block_m, e)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    gate_up = torch.empty((t * k, n2), dtype=x.dtype, device=x.device)
    b13 = None if w13_bias is None else w13_bias.contiguous()
    b2 = None if w2_bias is None else w2_bias.contiguous()
    _grouped_gemm(x, w13, gate_up, sorted_ids, expert_ids, None, k, False, block_m, b13)
    act = _act(gate_up, activation, swiglu_alpha, swiglu_limit)
    down = torch.empty((t * k, x.shape[1]), dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _grouped_gemm(act, w2, down, sorted_ids, expert_ids, weights, k, True, block_m, b2)
    return down.view(t, k, -1).sum(dim=1).to(x.dtype)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> torch.Tensor:
    impl = fused_moe_triton if use_triton(x) else fused_moe_torch
    return impl(
        x,
        w13,
        w2,
        topk_weights,
        topk_ids,
        w13_bias,
        w2_bias,
        activation,
        swiglu_alpha,
        swiglu_limit,
    )


@torch.library.custom_op("pagemill::fused_moe", mutates_args=())
def _fused_moe_op(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> torch.Tensor:
    return fused_moe(
        x,
        w13,
        w2,
        topk_weights,
        topk_ids,
        w13_bias,
        w2_bias,
        activation,
        swiglu_alpha,
        swiglu_limit,
    )


@_fused_moe_op.register_fake
def _(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("pagemill::fused_moe_int4", mutates_args=())
def _fused_moe_int4_op(
    x: torch.Tensor,
    w13_qweight: torch.Tensor,
    w13_scales_zeros: torch.Tensor,
    w2_qweight: torch.Tensor,
    w2_scales_zeros: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    group_sizes: list[int],
    planes: list[int],
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> torch.Tensor:
    return fused_moe_int4_cpu(
        x,
        w13_qweight,
        w13_scales_zeros,
        w2_qweight,
        w2_scales_zeros,
        topk_weights,
        topk_ids,
        group_sizes,
        planes,
        w13_bias,
        w2_bias,
        activation,
        swiglu_alpha,
        swiglu_limit,
    )


@_fused_moe_int4_op.register_fake
def _(
    x: torch.Tensor,
    w13_qweight: torch.Tensor,
    w13_scales_zeros: torch.Tensor,
    w2_qweight: torch.Tensor,
    w2_scales_zeros: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    group_sizes: list[int],
    planes: list[int],
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> torch.Tensor:
    return torch.empty_like(x)
