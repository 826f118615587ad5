"""The Triton paged-attention kernels, their per-step planner and their launcher.

`plan_triton` turns the step's shapes into launch parameters (grid, tile sizes, context
splits and the split workspace) once; `run_triton` launches with them for each layer. The
grid is sized from shapes alone, so neither planning nor launching syncs with the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagemill.kernels._dispatch import interpreting, next_pow2


@triton.jit
def _find_seq(qsl_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """Last request whose first tile index (``qsl[s] // BLOCK_Q + s``) is <= ``tile``.

    Giving request ``s`` the tile range ``[qsl[s] // BLOCK_Q + s, qsl[s+1] // BLOCK_Q + s + 1)``
    covers its ``cdiv(q_len, BLOCK_Q)`` tiles without the host knowing any query length, so
    the grid is sized from shapes alone and launching never syncs with the device.
    """
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if first <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, qsl_ptr, seq_lens_ptr,
    part_acc_ptr, part_ml_ptr,
    scale_log2,
    num_seqs,
    split_len,
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    DOT_FP32: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_seq(qsl_ptr, num_seqs, tile, BLOCK_Q)
    q_begin = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_begin
    q_tile = (tile - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    if q_tile >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + seq)
    first_pos = ctx - q_len

    # Rows of the tile are (query token, query head of this KV group) pairs, so one K/V
    # load serves every head of the group (GQA) and every token of the tile.
    rows = tl.arange(0, BLOCK_M)
    tok = q_tile + rows // GROUP_PAD
    gh = rows % GROUP_PAD
    row_ok = (rows // GROUP_PAD < BLOCK_Q) & (tok < q_len) & (gh < GROUP)
    head = kvh * GROUP + gh
    q_pos = first_pos + tok
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM

    q_off = (q_begin + tok).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    qv = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        qv = qv.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    kv_end = tl.minimum(ctx, first_pos + q_tile + BLOCK_Q)
    kv_begin = 0
    if NUM_SPLITS > 1:
        # Flash-decoding: this program covers one slice of the context; a second kernel
        # merges the slices' partial softmax states.
        kv_begin = split * split_len
        kv_end = tl.minimum(kv_end, kv_begin + split_len)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(kv_begin, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_end
        # int64 before the stride products: large caches overflow int32 offsets.
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        in_blk = (pos % BLOCK_SIZE).to(tl.int64)
        k_off = blk * stride_kb + in_blk * stride_ks + kvh * stride_kh
        v_off = blk * stride_vb + in_blk * stride_vs + kvh * stride_vh
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + k_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + v_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(qv, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(qv, tl.trans(k))
        s = s * scale_log2
        allowed = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_FP32:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if NUM_SPLITS > 1:
        # Partial state per (token, head, split): unnormalised acc, running max (log2 units), sum.
        part = ((q_begin + tok).to(tl.int64) * (GROUP * tl.num_programs(1)) + head) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * D_PAD + d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        o_off = (q_begin + tok).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
        tl.store(out_ptr + o_off[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr,
    stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    sp_ok = sp < NUM_SPLITS
    d = tl.arange(0, D_PAD)
    base = (t * NUM_HEADS + h) * NUM_SPLITS
    m = tl.load(part_ml_ptr + (base + sp) * 2, mask=sp_ok, other=float("-inf"))
    l_part = tl.load(part_ml_ptr + (base + sp) * 2 + 1, mask=sp_ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))
    acc = tl.load(part_acc_ptr + (base + sp)[:, None] * D_PAD + d[None, :], mask=sp_ok[:, None],
                  other=0.0)
    num = tl.sum(acc * w[:, None], 0)
    den = tl.sum(l_part * w, 0)
    den = tl.where(den == 0.0, 1.0, den)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, (num / den).to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)



@dataclass(frozen=True, slots=True)
class TritonPlan:
    """Launch parameters of one step's batch, read by every layer's launch.

    ``part_acc``/``part_ml`` are the split-context workspace (None without splits). Every
    layer reuses them: launches on one stream run in order, so a layer's merge has read
    them before the next layer's attention writes them.
    """

    grid: tuple[int, int, int]
    block_size: int
    group: int
    group_pad: int
    block_q: int
    block_m: int
    block_n: int
    head_dim: int
    d_pad: int
    dot_fp32: bool
    num_splits: int
    split_len: int
    part_acc: torch.Tensor | None
    part_ml: torch.Tensor | None


def plan_triton(
    num_tokens: int,
    num_seqs: int,
    table_width: int,
    k_cache_shape: tuple[int, int, int, int],
    num_heads: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
) -> TritonPlan:
    """Launch parameters from shapes alone; tests pass tile sizes to cover many tiles cheaply.

    ``num_splits`` > 1 (decode-only batches) cuts each context into slices run by separate
    programs and merged afterwards, so a few long decodes still fill the GPU.
    """
    _, block_size, num_kv_heads, head_dim = k_cache_shape
    group = num_heads // num_kv_heads
    group_pad = next_pow2(group)
    decode_only = num_tokens == num_seqs
    interp = interpreting()
    if block_m is None:
        block_m = max(16, group_pad) if decode_only else max(16 if interp else 64, group_pad)
    block_m = max(next_pow2(block_m), group_pad, 16)
    block_q = 1 if decode_only else block_m // group_pad
    if block_n is None:
        block_n = 32 if interp else 64
    block_n = max(16, next_pow2(block_n))
    capacity = max(1, table_width * block_size)  # host-side bound on any context: no sync
    if num_splits is None:
        num_splits = _default_splits(device, num_seqs * num_kv_heads, capacity) if decode_only else 1
    if num_splits > 1 and not decode_only:
        raise ValueError("split-context attention is for decode-only batches")
    # Slices are whole KV tiles; rounding up may leave fewer slices than asked.
    split_len = triton.cdiv(triton.cdiv(capacity, max(1, num_splits)), block_n) * block_n
    num_splits = triton.cdiv(capacity, split_len)
    d_pad = max(16, next_pow2(head_dim))
    part_acc = part_ml = None
    if num_splits > 1:
        parts = num_tokens * num_heads * num_splits
        part_acc = torch.empty(parts * d_pad, dtype=torch.float32, device=device)
        part_ml = torch.empty(parts * 2, dtype=torch.float32, device=device)
    return TritonPlan(
        grid=(num_tokens // block_q + num_seqs, num_kv_heads, num_splits),
        block_size=block_size,
        group=group,
        group_pad=group_pad,
        block_q=block_q,
        block_m=block_m,
        block_n=block_n,
        head_dim=head_dim,
        d_pad=d_pad,
        dot_fp32=interp or dtype == torch.float32,
        num_splits=num_splits,
        split_len=split_len,
        part_acc=part_acc,
        part_ml=part_ml,
    )


_SM_COUNT: dict[int, int] = {}


def _default_splits(device: torch.device, programs: int, capacity: int) -> int:
    """Enough context slices for about two programs per SM, each slice >= 512 positions."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    want = -(-2 * _SM_COUNT[index] // max(1, programs))
    return max(1, min(want, capacity // 512, 32))


def run_triton(
    plan: TritonPlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """One layer's attention: the planned launch (plus the merge of context splits)."""
    if q.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("q and out need a contiguous last (head_dim) axis")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache need a contiguous last (head_dim) axis")
    split = plan.num_splits > 1
    part_acc = plan.part_acc if split else out  # unused without splits
    part_ml = plan.part_ml if split else out
    _paged_attention_kernel[plan.grid](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens,
        part_acc, part_ml,
        float(scale) * math.log2(math.e),
        block_tables.shape[0],
        plan.split_len,
        q.stride(0), q.stride(1),
        out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        BLOCK_SIZE=plan.block_size,
        GROUP=plan.group,
        GROUP_PAD=plan.group_pad,
        BLOCK_Q=plan.block_q,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        HEAD_DIM=plan.head_dim,
        D_PAD=plan.d_pad,
        DOT_FP32=plan.dot_fp32,
        NUM_SPLITS=plan.num_splits,
        num_warps=4,
    )
    if split:
        _merge_splits_kernel[(q.shape[0], q.shape[1])](
            part_acc, part_ml, out, out.stride(0), out.stride(1),
            NUM_HEADS=q.shape[1],
            NUM_SPLITS=plan.num_splits,
            SPLITS_PAD=next_pow2(plan.num_splits),
            HEAD_DIM=plan.head_dim,
            D_PAD=plan.d_pad,
        )
    return out
