"""y = x Wᵀ with W held as 4-bit groups with a scale and a zero point (AWQ, GPTQ,
compressed-tensors w4a16 and GGUF Q4_0/Q4_1 after repacking), dequantized inside the GEMM.

The weight is the runtime's `Int4Groups`: w[n, k] = (q[n, k] - 8) * s[n, k // g] + z[n, k // g]
with q in 0..15 — the same affine form PyTorch's int4 CPU kernel evaluates, so one repack
serves both devices. The GPU layout (`pack_int4_groups`) packs eight consecutive inputs of
one output column into an int32 (input 8r + i at bits 4i of word [r, n], GPTQ's order), so
a tile of K inputs x N outputs reads contiguous words along N; scales and zeros are
[K / g, N], in the activation dtype or fp32 (read as fp32: fp32 keeps a checkpoint's fp16
scales exact under bf16 activations, at twice their bytes). The kernel dequantizes a tile
in fp32, rounds it once to the activation dtype (fp16 / bf16) for the tensor cores and
accumulates in fp32; the torch path computes exactly that, and is the reference.
"""

from __future__ import annotations

import torch

from pagemill.kernels._dispatch import (
    cdiv,
    check_triton_device,
    interpreting,
    lazy_kernels,
    next_pow2,
    use_triton,
)

_kernels = lazy_kernels("int4_gemm")

BLOCK_N = 64
BLOCK_K = 64


def pack_int4_groups(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, K] (0..15), scales / zeros [N, K / g] -> (qweight int32 [K / 8, N],
    scales [K / g, N], zeros [K / g, N] in `dtype`)."""
    n, k = q.shape
    if k % 8:
        raise ValueError(f"int4 GEMM packing needs in_features divisible by 8, got {k}")
    nib = q.to(torch.int64).T.reshape(k // 8, 8, n)
    shifts = (4 * torch.arange(8, dtype=torch.int64, device=q.device)).view(1, 8, 1)
    words = (nib << shifts).sum(dim=1)  # disjoint bits: the sum is the or
    qweight = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return qweight.contiguous(), scales.T.contiguous().to(dtype), zeros.T.contiguous().to(dtype)


def _check(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g: int
) -> tuple[int, int, int]:
    if x.dim() != 2 or qweight.dim() != 2:
        raise ValueError(f"int4 GEMM takes x [M, K] and qweight [K/8, N], got {x.shape}")
    m, k = x.shape
    n = qweight.shape[1]
    if qweight.dtype != torch.int32 or qweight.shape[0] * 8 != k:
        raise ValueError(f"qweight {tuple(qweight.shape)} {qweight.dtype} does not fit K={k}")
    if g <= 0 or k % g or scales.shape != (k // g, n) or zeros.shape != scales.shape:
        raise ValueError(f"scales / zeros must be [K/g, N] = [{k // max(g, 1)}, {n}]")
    return m, n, k


def int4_group_gemm_torch(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    _, n, k = _check(x, qweight, scales, zeros, group_size)
    shifts = (4 * torch.arange(8, dtype=torch.int32, device=x.device)).view(1, 8, 1)
    q = ((qweight.unsqueeze(1) >> shifts) & 0xF).reshape(k, n)
    s = scales.float().repeat_interleave(group_size, dim=0)
    z = zeros.float().repeat_interleave(group_size, dim=0)
    w = ((q.float() - 8.0) * s + z).to(x.dtype)
    return (x.float() @ w.float()).to(x.dtype)


def int4_group_gemm_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    m, n, k = _check(x, qweight, scales, zeros, group_size)
    check_triton_device(x, qweight, scales, zeros)
    x = x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    block_m = min(64, max(16, next_pow2(m)))
    grid = (cdiv(m, block_m), cdiv(n, BLOCK_N))
    _kernels.int4_group_gemm_kernel[grid](
        x,
        qweight,
        scales,
        zeros,
        y,
        m,
        n,
        k,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        y.stride(0),
        GROUP=group_size,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        DOT_FP32=interpreting(),
        num_warps=4,
    )
    return y


def int4_group_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    fn = int4_group_gemm_triton if use_triton(x) else int4_group_gemm_torch
    return fn(x, qweight, scales, zeros, group_size)


# One opaque call in a compiled graph (and a plain kernel launch under CUDA-graph capture):
# inductor neither traces into the Triton launch nor breaks the graph at it.
@torch.library.custom_op("pagemill::int4_group_gemm", mutates_args=())
def _int4_group_gemm_op(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    return int4_group_gemm(x, qweight, scales, zeros, group_size)


@_int4_group_gemm_op.register_fake
def _(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    return x.new_empty(x.shape[0], qweight.shape[1])
