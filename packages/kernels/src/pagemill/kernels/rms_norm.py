"""RMSNorm as the Llama family computes it, with the residual add fused in.

Rounding follows transformers' ``LlamaRMSNorm`` step by step — statistics in fp32, the
normalised value rounded to the input dtype *before* the weight multiply, the residual sum
rounded to the input dtype — because greedy decoding must match the reference token for
token, and a last-bit difference in bf16 is enough to flip an argmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagemill.kernels._dispatch import check_triton_device, next_pow2, use_triton


def _check_args(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"weight must be [hidden={x.shape[-1] if x.dim() else '?'}], got {tuple(weight.shape)}"
        )
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual must match x ({tuple(x.shape)}, {x.dtype}); got {tuple(residual.shape)}, {residual.dtype}"
        )


def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    _check_args(x, weight, residual)
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    y = (weight * h.to(x.dtype)).to(x.dtype)
    return y if residual is None else (y, x)


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, s_ptr,
    stride_x, stride_r, stride_y, stride_s,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(s_ptr + row * stride_s + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, 0) / N
    h = (h * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (w * h).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    _check_args(x, weight, residual)
    check_triton_device(x, weight, *(() if residual is None else (residual,)))
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden).contiguous()
    y = torch.empty_like(x2)
    r2 = x2 if residual is None else residual.reshape(-1, hidden).contiguous()
    s = torch.empty_like(x2) if residual is not None else y
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight.contiguous(), y, s,
            x2.stride(0), r2.stride(0), y.stride(0), s.stride(0),
            float(eps),
            N=hidden,
            BLOCK=next_pow2(hidden),
            HAS_RESIDUAL=residual is not None,
        )
    y = y.view(x.shape)
    return y if residual is None else (y, s.view(x.shape))


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    impl = rms_norm_triton if use_triton(x) else rms_norm_torch
    return impl(x, weight, eps, residual)
