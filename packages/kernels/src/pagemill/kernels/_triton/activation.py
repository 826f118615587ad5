"""Triton kernel of SiLU-and-mul (see `pagemill.kernels.activation`)."""

import triton
import triton.language as tl


@triton.jit
def silu_and_mul_kernel(x_ptr, y_ptr, stride_x, stride_y, INTER: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (act * up).to(y_ptr.dtype.element_ty), mask=mask)
