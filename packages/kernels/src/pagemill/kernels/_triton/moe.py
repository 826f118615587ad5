"""Triton grouped GEMM of the fused MoE (see `pagemill.kernels.moe`).

One program computes a BLOCK_M x BLOCK_N tile of ``C[pairs] = A[rows] @ B[expert]ᵀ`` for one
block of the expert-sorted (token, slot) pairs: every row of the block belongs to the same
expert (``expert_ids`` per block, runs padded to BLOCK_M by `moe_align_block_size`), so the
expert's weight tile is read once for up to BLOCK_M tokens. Padding pairs (id ==
``num_pairs``) load zeros and store nothing; blocks past the last run (expert -1) exit.
An expert bias (gpt-oss) is added to the tile before the routing weight multiplies it.
"""

import triton
import triton.language as tl


@triton.jit
def fused_moe_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    weights_ptr,
    bias_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_pairs,
    N,
    K,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    stride_bias_e,
    TOP_K: tl.constexpr,
    A_PER_PAIR: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    mask_m = pair < num_pairs
    if A_PER_PAIR:
        row = pair
    else:
        row = pair // TOP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + row[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if DOT_FP32:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_BIAS:
        # The expert's bias joins before the routing weight: w * (x @ W + b), as gpt-oss.
        bias = tl.load(bias_ptr + expert * stride_bias_e + offs_n, mask=mask_n, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + pair, mask=mask_m, other=0.0)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
