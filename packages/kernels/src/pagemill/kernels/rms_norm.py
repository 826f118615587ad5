"""RMSNorm as the Llama family computes it, with the residual add fused in.

Rounding follows transformers' ``LlamaRMSNorm`` step by step — statistics in fp32, the
normalised value rounded to the input dtype *before* the weight multiply, the residual sum
rounded to the input dtype — because greedy decoding must match the reference token for
token, and a last-bit difference in bf16 is enough to flip an argmax.
"""

from __future__ import annotations

import torch

from pagemill.kernels._dispatch import check_triton_device, lazy_kernels, next_pow2, use_triton

_kernels = lazy_kernels("rms_norm")


def _check_args(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"weight must be [hidden={x.shape[-1] if x.dim() else '?'}], got {tuple(weight.shape)}"
        )
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual must match x ({tuple(x.shape)}, {x.dtype}); "
            f"got {tuple(residual.shape)}, {residual.dtype}"
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
        _kernels.rms_norm_kernel[(x2.shape[0],)](
            x2,
            r2,
            weight.contiguous(),
            y,
            s,
            x2.stride(0),
            r2.stride(0),
            y.stride(0),
            s.stride(0),
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
