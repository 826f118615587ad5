"""SiLU-and-mul, the gate of the Llama MLP: ``silu(x[..., :I]) * x[..., I:]``.

The gate and up projections are one fused matmul upstream, so the activation reads both
halves of its output at once. Rounding mirrors the unfused torch expression (silu rounded
to the input dtype, then the product rounded) to keep greedy decoding bit-compatible.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagemill.kernels._dispatch import check_triton_device, next_pow2, use_triton


def _half(x: torch.Tensor) -> int:
    if x.dim() < 1 or x.shape[-1] % 2 != 0:
        raise ValueError(f"silu_and_mul needs an even last axis [..., 2I], got {tuple(x.shape)}")
    return x.shape[-1] // 2


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    i = _half(x)
    # torch's vectorised silu (contiguous input) and its strided fallback differ in the last
    # bit; the reference model applies silu to a contiguous gate projection, so match that.
    return F.silu(x[..., :i].contiguous()) * x[..., i:]


@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, stride_x, stride_y, INTER: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (act * up).to(y_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    i = _half(x)
    check_triton_device(x)
    x2 = x.reshape(-1, 2 * i).contiguous()
    y = torch.empty((x2.shape[0], i), dtype=x.dtype, device=x.device)
    block = min(1024, next_pow2(i))
    if x2.shape[0] > 0 and i > 0:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(i, block))](
            x2, y, x2.stride(0), y.stride(0), INTER=i, BLOCK=block
        )
    return y.view(*x.shape[:-1], i)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_triton(x) if use_triton(x) else silu_and_mul_torch(x)
