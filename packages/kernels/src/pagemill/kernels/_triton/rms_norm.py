"""Triton kernel of RMSNorm with the fused residual add (see `pagemill.kernels.rms_norm`)."""

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    y_ptr,
    s_ptr,
    stride_x,
    stride_r,
    stride_y,
    stride_s,
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
