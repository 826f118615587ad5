"""Triton kernel of the paged KV cache write (see `pagemill.kernels.kv_cache`)."""

import triton
import triton.language as tl

from pagemill.kernels._triton.fp8 import kv_encode


@triton.jit(do_not_specialize=["k_scale_stride", "v_scale_stride"])
def write_kv_cache_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    k_scale_stride,
    v_scale_stride,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    FP8: tl.constexpr,
    E4M3: tl.constexpr,
    INT8: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
    t64 = t.to(tl.int64)
    kv = tl.load(k_ptr + t64 * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    vv = tl.load(v_ptr + t64 * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    kdst = kc_ptr + blk * stride_kcb + off * stride_kcs + h[:, None] * stride_kch + d[None, :]
    vdst = vc_ptr + blk * stride_vcb + off * stride_vcs + h[:, None] * stride_vch + d[None, :]
    if FP8:
        # Quantize: x / scale saturated to the format's range (no inf/NaN from outliers),
        # stored as bytes (the caches arrive as uint8 views; FP8 covers int8 codes too).
        # A scale stride of 0 reads the layer's one scale for every head, 1 each head's own.
        h_ok = h < NUM_KV_HEADS
        ks = tl.load(k_scale_ptr + h * k_scale_stride, mask=h_ok, other=1.0)
        vs = tl.load(v_scale_ptr + h * v_scale_stride, mask=h_ok, other=1.0)
        kq = tl.clamp(kv.to(tl.float32) / ks[:, None], -FP8_MAX, FP8_MAX)
        vq = tl.clamp(vv.to(tl.float32) / vs[:, None], -FP8_MAX, FP8_MAX)
        tl.store(kdst, kv_encode(kq, E4M3, INT8), mask=mask)
        tl.store(vdst, kv_encode(vq, E4M3, INT8), mask=mask)
    else:
        tl.store(kdst, kv.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vdst, vv.to(vc_ptr.dtype.element_ty), mask=mask)
