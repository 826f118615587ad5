"""Triton kernel of the int4-group dequantizing GEMM (see `pagemill.kernels.int4_gemm`)."""

import triton
import triton.language as tl


@triton.jit
def int4_group_gemm_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_qk,
    stride_sg,
    stride_ym,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_rows + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & n_ok[None, :]
        # Eight inputs share a word: each is read from cache, not memory, after the first.
        words = tl.load(
            qw_ptr + (rk // 8).to(tl.int64)[:, None] * stride_qk + rn[None, :], mask=w_ok, other=0
        )
        q = (words >> ((rk % 8) * 4)[:, None]) & 0xF
        g_off = (rk // GROUP).to(tl.int64)[:, None] * stride_sg + rn[None, :]
        s = tl.load(s_ptr + g_off, mask=w_ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g_off, mask=w_ok, other=0.0).to(tl.float32)
        # (q - 8) * s is exact in fp32; the weight is rounded once to the activation dtype.
        w = ((q.to(tl.float32) - 8.0) * s + z).to(x_ptr.dtype.element_ty)
        if DOT_FP32:  # the interpreter's bf16 dot is wrong: upcast the rounded operands
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    y_off = rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
