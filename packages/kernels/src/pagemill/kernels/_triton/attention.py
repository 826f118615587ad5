"""Triton kernels of paged attention: the varlen kernel and the merge of context splits.

Launch parameters come from `pagemill.kernels.attention_triton.plan_triton`; what each
parameter means is documented there. ``num_seqs`` and ``stride_bt`` change with every
batch, so they are not specialised: one compiled kernel serves batches of 1, 7 or 64
requests alike (no recompilation when the batch size or the table width changes). The
number of context splits is the grid's third axis, not a compile-time constant, for the
same reason; only whether the context is split (``SPLIT``) is. A layer's sliding
``window`` (0: none) is a runtime integer too — one compiled kernel serves windowed and
global layers alike — while soft-capping is a compile-time switch (``SOFTCAP``), since it
adds work to every score. The stride of an 8-bit cache's scales over KV heads (0: one per
layer, 1: one per head) is a runtime integer for the same reason. Attention sinks
(``SINKS``, gpt-oss: one logit per query head) seed the online softmax as a key with a
zero value would — running max the sink, sum 1 — in the first context split only, so the
merge counts the sink once.
"""

import triton
import triton.language as tl

from pagemill.kernels._triton.fp8 import kv_decode


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


@triton.jit(do_not_specialize=["num_seqs", "stride_bt", "window"])
def paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    bt_ptr,
    qsl_ptr,
    seq_lens_ptr,
    part_acc_ptr,
    part_ml_ptr,
    scale_log2,
    k_scale_ptr,
    v_scale_ptr,
    # 0: the layer's one scale, 1: one per KV head. A compile-time constant, so a per-layer
    # cache compiles as it did before per-head scales (no index arithmetic kept live: some
    # tight 8-bit configurations spilled with it).
    scale_stride: tl.constexpr,
    softcap,
    sinks_ptr,
    window,
    num_seqs,
    split_len,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
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
    SPLIT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    FP8: tl.constexpr,
    E4M3: tl.constexpr,
    INT8: tl.constexpr,
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
    qv = tl.load(
        q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
    )
    if DOT_FP32:
        qv = qv.to(tl.float32)

    if FP8:
        # 8-bit K/V: this KV head's K scale folds into the score scale, its V scale into the
        # output (scale_stride 0: the layer's one scale, 1: one per KV head).
        scale_log2 = scale_log2 * tl.load(k_scale_ptr + kvh * scale_stride)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if SINKS:
        # log2 units, as every score here; the sink is not scaled.
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0) * 1.4426950408889634
        seeded = (split == 0) & row_ok
        m_i = tl.where(seeded, sink, m_i)
        l_i = tl.where(seeded, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    kv_end = tl.minimum(ctx, first_pos + q_tile + BLOCK_Q)
    kv_begin = 0
    if SPLIT:
        # Flash-decoding: this program covers one slice of the context; a second kernel
        # merges the slices' partial softmax states.
        kv_begin = split * split_len
        kv_end = tl.minimum(kv_end, kv_begin + split_len)
    if window > 0:
        # Sliding window: no query of the tile sees a key before its first query's window.
        kv_begin = tl.maximum(kv_begin, first_pos + q_tile - window + 1)
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
        k = tl.load(k_ptr + k_off[:, None] + d[None, :], mask=kv_mask, other=0)
        v = tl.load(v_ptr + v_off[:, None] + d[None, :], mask=kv_mask, other=0)
        if FP8:
            # uint8 views of the fp8 cache; every fp8 value is exact in fp16 and bf16.
            k = kv_decode(k, E4M3, INT8).to(qv.dtype)
            v = kv_decode(v, E4M3, INT8).to(qv.dtype)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(qv, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(qv, tl.trans(k))
        if SOFTCAP:
            # softcap * tanh(x / softcap) on the natural-units score, tanh written with exp2.
            x = s * (scale_log2 * 0.6931471805599453 / softcap)
            th = 1.0 - 2.0 / (tl.exp2(x * 2.885390081777927) + 1.0)
            s = th * (softcap * 1.4426950408889634)
        else:
            s = s * scale_log2
        allowed = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        if window > 0:
            allowed = allowed & (pos[None, :] > q_pos[:, None] - window)
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

    if FP8:
        acc = acc * tl.load(v_scale_ptr + kvh * scale_stride)
    if SPLIT:
        # Partial state per (token, head, split): unnormalised acc, running max (log2 units), sum.
        num_splits = tl.num_programs(2)
        part = (
            (q_begin + tok).to(tl.int64) * (GROUP * tl.num_programs(1)) + head
        ) * num_splits + split
        tl.store(part_acc_ptr + part[:, None] * D_PAD + d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        o_off = (q_begin + tok).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
        tl.store(
            out_ptr + o_off[:, None] + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit(do_not_specialize=["num_splits"])
def merge_splits_kernel(
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    num_splits,
    NUM_HEADS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    sp_ok = sp < num_splits
    d = tl.arange(0, D_PAD)
    base = (t * NUM_HEADS + h) * num_splits
    m = tl.load(part_ml_ptr + (base + sp) * 2, mask=sp_ok, other=float("-inf"))
    l_part = tl.load(part_ml_ptr + (base + sp) * 2 + 1, mask=sp_ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))
    acc = tl.load(
        part_acc_ptr + (base + sp)[:, None] * D_PAD + d[None, :], mask=sp_ok[:, None], other=0.0
    )
    num = tl.sum(acc * w[:, None], 0)
    den = tl.sum(l_part * w, 0)
    den = tl.where(den == 0.0, 1.0, den)
    tl.store(
        out_ptr + t * stride_ot + h * stride_oh + d,
        (num / den).to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )
