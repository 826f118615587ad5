"""SiLU-and-mul, the gate of the Llama MLP: ``silu(x[..., :I]) * x[..., I:]``.

The gate and up projections are one fused matmul upstream, so the activation reads both
halves of its output at once. Rounding mirrors the unfused torch expression (silu rounded
to the input dtype, then the product rounded) to keep greedy decoding bit-compatible.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagemill.kernels._dispatch import (
    cdiv,
    check_triton_device,
    lazy_kernels,
    next_pow2,
    use_triton,
)

_kernels = lazy_kernels("activation")


def _half(x: torch.Tensor) -> int:
    if x.dim() < 1 or x.shape[-1] % 2 != 0:
        raise ValueError(f"silu_and_mul needs an even last axis [..., 2I], got {tuple(x.shape)}")
    return x.shape[-1] // 2


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    i = _half(x)
    # torch's vectorised silu (contiguous input) and its strided fallback differ in the last
    # bit; the reference model applies silu to a contiguous gate projection, so match that.
    return F.silu(x[..., :i].contiguous()) * x[..., i:]


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    i = _half(x)
    check_triton_device(x)
    x2 = x.reshape(-1, 2 * i).contiguous()
    y = torch.empty((x2.shape[0], i), dtype=x.dtype, device=x.device)
    block = min(1024, next_pow2(i))
    if x2.shape[0] > 0 and i > 0:
        _kernels.silu_and_mul_kernel[(x2.shape[0], cdiv(i, block))](
            x2, y, x2.stride(0), y.stride(0), INTER=i, BLOCK=block
        )
    return y.view(*x.shape[:-1], i)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_triton(x) if use_triton(x) else silu_and_mul_torch(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU's gate (Gemma): ``gelu(x[..., :I], approximate="tanh") * x[..., I:]``.

    Plain torch ops on every device (on CUDA they are elementwise kernels already); the
    rounding is the unfused expression's, as transformers computes it.
    """
    i = _half(x)
    return F.gelu(x[..., :i].contiguous(), approximate="tanh") * x[..., i:]
