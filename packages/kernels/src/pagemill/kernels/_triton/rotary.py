"""Triton kernel of the rotary embedding, rotate-half layout (see `pagemill.kernels.rotary`)."""

import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    t,
    stride_t,
    stride_h,
    dst_t,
    dst_h,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    H_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    h = tl.arange(0, H_PAD)
    j = tl.arange(0, HALF_PAD)
    mask = (h[:, None] < NUM_HEADS) & (j[None, :] < HALF)
    src = src_ptr + t * stride_t + h[:, None] * stride_h + j[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    ty = dst_ptr.dtype.element_ty
    # Each product is rounded to the storage dtype before the sum, as torch does in bf16/fp16.
    o1 = (x1 * cos).to(ty).to(tl.float32) - (x2 * sin).to(ty).to(tl.float32)
    o2 = (x2 * cos).to(ty).to(tl.float32) + (x1 * sin).to(ty).to(tl.float32)
    dst = dst_ptr + t * dst_t + h[:, None] * dst_h + j[None, :]
    tl.store(dst, o1.to(ty), mask=mask)
    tl.store(dst + HALF, o2.to(ty), mask=mask)


@triton.jit
def rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    qo_ptr,
    ko_ptr,
    cs_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cs,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    H_PAD: tl.constexpr,
    KVH_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, HALF_PAD)
    jm = j < HALF
    ty = qo_ptr.dtype.element_ty
    cos = tl.load(cs_ptr + p * stride_cs + j, mask=jm, other=0.0).to(ty).to(tl.float32)[None, :]
    sin = (
        tl.load(cs_ptr + p * stride_cs + HALF + j, mask=jm, other=0.0)
        .to(ty)
        .to(tl.float32)[None, :]
    )
    _rotate_heads(
        q_ptr,
        qo_ptr,
        t,
        stride_qt,
        stride_qh,
        stride_qot,
        stride_qoh,
        cos,
        sin,
        NUM_HEADS,
        H_PAD,
        HALF,
        HALF_PAD,
    )
    _rotate_heads(
        k_ptr,
        ko_ptr,
        t,
        stride_kt,
        stride_kh,
        stride_kot,
        stride_koh,
        cos,
        sin,
        NUM_KV_HEADS,
        KVH_PAD,
        HALF,
        HALF_PAD,
    )
