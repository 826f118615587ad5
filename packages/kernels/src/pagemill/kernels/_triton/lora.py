"""Triton shrink and expand of the batched LoRA (see `pagemill.kernels.lora`).

Programs are (token block, slice, slot): a program reads its slot's run of the sorted
token indices and exits when its block lies past the run, so a slot without tokens costs
one load. Within a run every row uses the same adapter, so its A / B tile is read once
per block of tokens.
"""

import triton
import triton.language as tl


@triton.jit
def lora_shrink_kernel(
    x_ptr,
    a_ptr,
    buf_ptr,
    sorted_ids_ptr,
    seg_ptr,
    K,
    R,
    stride_xm,
    stride_al,
    stride_ar,
    stride_bs,
    stride_bm,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """buf[slice, t, :R] = x[t] @ A[slot, slice * R : (slice + 1) * R]ᵀ for t in the run;
    a program computes BLOCK_R of the rank's columns."""
    pid = tl.program_id(0)
    num_r = tl.cdiv(R, BLOCK_R)
    pid_m = pid // num_r
    pid_r = pid % num_r
    sl = tl.program_id(1)
    slot = tl.program_id(2)
    lo = tl.load(seg_ptr + slot)
    hi = tl.load(seg_ptr + slot + 1)
    start = lo + pid_m * BLOCK_M
    if start >= hi:
        return
    offs_m = start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < hi
    rows = tl.load(sorted_ids_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
    a_rows = slot.to(tl.int64) * stride_al + (sl * R + offs_r).to(tl.int64) * stride_ar
    a_ptrs = a_ptr + a_rows[None, :] + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        xt = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        at = tl.load(a_ptrs, mask=mask_k[:, None] & mask_r[None, :], other=0.0)
        if DOT_FP32:
            acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(xt, at)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    out = buf_ptr + sl * stride_bs + rows[:, None] * stride_bm + offs_r[None, :]
    tl.store(out, acc, mask=mask_m[:, None] & mask_r[None, :])


@triton.jit
def lora_expand_kernel(
    buf_ptr,
    b_ptr,
    y_ptr,
    sorted_ids_ptr,
    seg_ptr,
    slice_starts_ptr,
    R,
    MAX_N,
    stride_bs,
    stride_bm,
    stride_bl,
    stride_bn,
    stride_ym,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """y[t, cols of slice] += buf[slice, t, :R] @ B[slot, cols, slice * R : (slice + 1) *
    R]ᵀ for t in the run; the rank is walked BLOCK_R at a time."""
    pid = tl.program_id(0)
    sl = tl.program_id(1)
    slot = tl.program_id(2)
    num_n = tl.cdiv(MAX_N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    lo = tl.load(seg_ptr + slot)
    hi = tl.load(seg_ptr + slot + 1)
    start = lo + pid_m * BLOCK_M
    if start >= hi:
        return
    n0 = tl.load(slice_starts_ptr + sl)
    n1 = tl.load(slice_starts_ptr + sl + 1)
    if pid_n * BLOCK_N >= n1 - n0:
        return
    offs_m = start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < hi
    rows = tl.load(sorted_ids_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n1 - n0
    cols = (n0 + offs_n).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    h_ptrs = buf_ptr + sl * stride_bs + rows[:, None] * stride_bm + offs_r[None, :]
    b_rows = slot.to(tl.int64) * stride_bl + cols[None, :] * stride_bn
    b_ptrs = b_ptr + b_rows + (sl * R + offs_r)[:, None]  # slice's block of the diagonal
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        mask_r = offs_r < R - r0
        h = tl.load(h_ptrs, mask=mask_m[:, None] & mask_r[None, :], other=0.0)
        bt = tl.load(b_ptrs, mask=mask_r[:, None] & mask_n[None, :], other=0.0)
        if DOT_FP32:
            acc += tl.dot(h, bt.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(h.to(bt.dtype), bt)
        h_ptrs += BLOCK_R
        b_ptrs += BLOCK_R
    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)
