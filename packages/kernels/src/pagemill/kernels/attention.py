"""Paged attention over a flattened varlen batch: one call for mixed prefill and decode.

The runtime concatenates every scheduled token of every request into ``q [T, H, D]``;
request ``s`` owns rows ``query_start_loc[s]:query_start_loc[s+1]`` and its K/V live in
the paged cache at the blocks listed in ``block_tables[s]``. Its ``seq_lens[s]`` counts
every token of its context including this step's, so query ``j`` of request ``s`` sits at
position ``seq_lens[s] - q_len_s + j`` and sees keys at positions ``<=`` that (causal,
with cached prefix tokens from earlier steps or prefix hits visible to all of them).
"""

from __future__ import annotations

import itertools
import math
import threading

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagemill.kernels._dispatch import check_triton_device, interpreting, next_pow2, use_triton

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    """Shape checks only (no device sync): bad metadata would otherwise read stray memory."""
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]; "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim mismatch: q has {head_dim}, cache has {k_cache.shape[3]}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if q.dtype not in _FLOAT_DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"q, k_cache and v_cache must share one of fp32/fp16/bf16; got {q.dtype}, "
            f"{k_cache.dtype}, {v_cache.dtype}"
        )
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [num_seqs, max_blocks], got {tuple(block_tables.shape)}")
    num_seqs = block_tables.shape[0]
    if seq_lens.dim() != 1 or seq_lens.shape[0] != num_seqs:
        raise ValueError(f"seq_lens must be [num_seqs={num_seqs}], got {tuple(seq_lens.shape)}")
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            f"query_start_loc must be [num_seqs + 1 = {num_seqs + 1}], got {tuple(query_start_loc.shape)}"
        )
    for name, t in (("block_tables", block_tables), ("query_start_loc", query_start_loc),
                    ("seq_lens", seq_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device):
        raise ValueError(
            f"out must match q ({tuple(q.shape)}, {q.dtype}, {q.device}); "
            f"got {tuple(out.shape)}, {out.dtype}, {out.device}"
        )


# ----------------------------------------------------------------------------- torch path

# Gathering K/V for a decode batch writes tens of MB; a freshly allocated buffer of that
# size is page-faulted in on every call, which costs more than the copy itself. Reusing
# one grow-only buffer per thread, device and dtype keeps the CPU decode memory-bound.
_workspace = threading.local()

# Upper bound on the K elements gathered at once by the decode path: longer batches are cut
# into chunks of similar length, so the padding to the longest context stays small.
_DECODE_CHUNK_ELEMS = 1 << 23
# A decode chunk's shortest context is at least this fraction of its longest: requests are
# sorted by length and a new chunk starts below it, so padding wastes at most ~25%.
_DECODE_MIN_FILL = 0.75
# index_select moves 2- and 4-byte elements through integer views: its bf16/fp16 paths are
# several times slower than the plain copy of the same bytes.
_BIT_VIEWS = {2: torch.int16, 4: torch.int32}
# Decode chunks of at most this many context tokens (requests x longest context) take the
# whole-block SDPA path: measured on CPU it wins below ~4k tokens, the GEMM path above.
_DECODE_SMALL_TOKENS = 4096


def _buffers(numel: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (dtype, str(device))
    cache = getattr(_workspace, "bufs", None)
    if cache is None:
        cache = _workspace.bufs = {}
    bufs = cache.get(key)
    if bufs is None or bufs[0].numel() < numel:
        bufs = (torch.empty(numel, dtype=dtype, device=device),
                torch.empty(numel, dtype=dtype, device=device))
        cache[key] = bufs
    return bufs


def _gather_rows(
    table: torch.Tensor, rows: torch.Tensor, buf: torch.Tensor, shape: tuple[int, ...]
) -> torch.Tensor:
    """Rows of the 2-D ``table`` (a view of a paged cache) copied into ``buf`` as ``shape``."""
    width = table.shape[1]
    bits = _BIT_VIEWS.get(table.element_size())
    numel = rows.numel() * width
    if bits is None:
        got = torch.index_select(table, 0, rows, out=buf[:numel].view(-1, width))
    else:
        got = torch.index_select(table.view(bits), 0, rows,
                                 out=buf[:numel].view(bits).view(-1, width)).view(table.dtype)
    return got.view(shape)


def _decode_chunk_small(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    max_len: int,
    scale: float,
) -> torch.Tensor:
    """Small decode batches: whole blocks gathered, one SDPA call.

    Below a few thousand context tokens the fixed cost of ops dominates, and this path
    has the fewest: GQA rides on SDPA's query axis (the G query heads of a KV head), so
    K/V are never repeated, and a single request is cut exactly instead of masked.
    """
    n, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    nblk = -(-max_len // block_size)
    width = nblk * block_size
    ids = tables[:, :nblk].to(torch.int64).clamp_(min=0).reshape(-1)
    shape = (n, width, num_kv_heads, head_dim)
    kbuf, vbuf = _buffers(math.prod(shape), q.dtype, q.device)
    k = _gather_rows(k_cache.view(-1, block_size * num_kv_heads * head_dim), ids, kbuf, shape)
    v = _gather_rows(v_cache.view(-1, block_size * num_kv_heads * head_dim), ids, vbuf, shape)
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    if n == 1:
        k, v, mask = k[:, :, :max_len], v[:, :, :max_len], None
    else:
        mask = (torch.arange(width, device=q.device) < lens[:, None])[:, None, None, :]
    o = F.scaled_dot_product_attention(
        q.view(n, num_kv_heads, group, head_dim), k, v, attn_mask=mask, scale=scale
    )
    return o.reshape(n, num_heads, head_dim)


def _decode_chunk(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    max_len: int,
    scale: float,
) -> torch.Tensor:
    """Attention for single-token queries, all at the end of their contexts.

    K/V are gathered head-major (``[n, kv_heads, max_len, head_dim]``, contiguous) so both
    products are plain batched GEMMs; GQA rides on the GEMM's M dimension (the G query
    heads sharing a KV head), so K/V are read once per KV head, never repeated. Scores and
    softmax are fp32; the products run in the input dtype with fp32 accumulation.
    """
    n, num_heads, head_dim = q.shape
    if n * max_len <= _DECODE_SMALL_TOKENS:
        return _decode_chunk_small(q, k_cache, v_cache, tables, lens, max_len, scale)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    dev = q.device
    pos = torch.arange(max_len, device=dev)
    # Table padding (-1 or stale ids) past a request's length is read but masked out.
    ids = tables[:, pos // block_size].to(torch.int64).clamp_(min=0)
    slots = ids * block_size + pos % block_size
    rows = (slots.unsqueeze(1) * num_kv_heads
            + torch.arange(num_kv_heads, device=dev).view(1, num_kv_heads, 1)).view(-1)
    shape = (n, num_kv_heads, max_len, head_dim)
    kbuf, vbuf = _buffers(math.prod(shape), q.dtype, dev)
    k = _gather_rows(k_cache.view(-1, head_dim), rows, kbuf, shape)
    v = _gather_rows(v_cache.view(-1, head_dim), rows, vbuf, shape)
    s = torch.matmul(q.view(n, num_kv_heads, group, head_dim), k.transpose(-1, -2))
    s = s.float().mul_(scale)
    if n > 1:
        s.masked_fill_((pos >= lens[:, None]).view(n, 1, 1, max_len), float("-inf"))
    p = torch.softmax(s, dim=-1).to(q.dtype)
    return torch.matmul(p, v).view(n, num_heads, head_dim)


def _decode_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens_list: list[int],
    scale: float,
    out: torch.Tensor,
    rows: torch.Tensor | None,
) -> None:
    """Decode rows into ``out`` (at ``rows``, or all rows in order when None).

    Requests are sorted by context length and cut into chunks of similar length (and
    bounded size), so the padding to each chunk's longest context stays small.
    """
    n = q.shape[0]
    per_token = k_cache.shape[2] * k_cache.shape[3]
    lens = torch.tensor(lens_list, device=q.device)
    longest, shortest = max(lens_list), min(lens_list)
    if shortest >= _DECODE_MIN_FILL * longest and n * longest * per_token <= _DECODE_CHUNK_ELEMS:
        o = _decode_chunk(q, k_cache, v_cache, tables, lens, longest, scale)
        if rows is None:
            out.copy_(o)
        else:
            out.index_copy_(0, rows, o)
        return
    order = sorted(range(n), key=lens_list.__getitem__, reverse=True)
    start = 0
    while start < n:
        longest = lens_list[order[start]]
        cap = max(1, _DECODE_CHUNK_ELEMS // max(1, longest * per_token))
        stop = start + 1
        while stop < n and stop - start < cap and lens_list[order[stop]] >= _DECODE_MIN_FILL * longest:
            stop += 1
        idx = torch.tensor(order[start:stop], device=q.device)
        o = _decode_chunk(q[idx], k_cache, v_cache, tables[idx], lens[idx], longest, scale)
        out.index_copy_(0, idx if rows is None else rows[idx], o)
        start = stop


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The CPU serving backend: batched GEMMs for decodes, one SDPA per prefilling request.

    Decode-only steps (every query length 1) are the common case of serving and run as a
    few batched calls (requests bucketed by context length) over K/V gathered through the
    block tables; requests with several query tokens (prefill chunks) each get one SDPA
    call with a causal mask offset by their cached prefix. Products accumulate in fp32 and
    softmax runs in fp32 for every input dtype.
    """
    _check_args(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out)
    if out is None:
        out = torch.empty_like(q)
    num_tokens, _, head_dim = q.shape
    num_seqs = block_tables.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_size = k_cache.shape[1]
    num_kv_heads = k_cache.shape[2]
    # Metadata checks on Python lists: this runs once per layer per step, and a handful of
    # list operations costs less than the tensor ops that would do the same.
    starts = query_start_loc.tolist()
    lens_list = seq_lens.tolist()
    q_lens = [b - a for a, b in itertools.pairwise(starts)]
    if starts[0] != 0 or starts[-1] != num_tokens or min(q_lens) < 0:
        raise ValueError(f"query_start_loc must rise from 0 to num_tokens={num_tokens}; got {starts}")
    for s, (ql, ctx) in enumerate(zip(q_lens, lens_list)):
        if ql > ctx:
            raise ValueError(
                f"seq {s}: {ql} query tokens but seq_lens is {ctx} "
                "(seq_lens counts the whole context including this step)"
            )
    if max(lens_list) > block_tables.shape[1] * block_size:
        raise ValueError(
            f"a context of {max(lens_list)} tokens needs more than the "
            f"{block_tables.shape[1]} blocks block_tables holds"
        )

    if num_tokens == num_seqs and all(ql == 1 for ql in q_lens):
        _decode_torch(q, k_cache, v_cache, block_tables, lens_list, scale, out, None)
        return out

    decode_seqs = [s for s in range(num_seqs) if q_lens[s] == 1]
    if decode_seqs:
        sel = torch.tensor(decode_seqs, device=q.device)
        rows = torch.tensor([starts[s] for s in decode_seqs], device=q.device)
        _decode_torch(q[rows], k_cache, v_cache, block_tables[sel],
                      [lens_list[s] for s in decode_seqs], scale, out, rows)

    for s in range(num_seqs):
        q_len = q_lens[s]
        if q_len <= 1:
            continue
        ctx = lens_list[s]
        nblk = -(-ctx // block_size)
        ids = block_tables[s, :nblk].to(torch.int64)
        k = k_cache.index_select(0, ids).view(-1, num_kv_heads, head_dim)[:ctx].transpose(0, 1)
        v = v_cache.index_select(0, ids).view(-1, num_kv_heads, head_dim)[:ctx].transpose(0, 1)
        qs = q[starts[s] : starts[s + 1]].transpose(0, 1)
        if q_len == ctx:
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:
            qpos = torch.arange(ctx - q_len, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale,
                                               enable_gqa=True)
        out[starts[s] : starts[s + 1]] = o.transpose(0, 1)
    return out


# ----------------------------------------------------------------------------- triton path


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


def _launch_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    block_m: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Launch with explicit tile sizes; tests shrink them to cover many tiles cheaply.

    ``num_splits`` > 1 (decode-only batches) cuts each context into slices run by separate
    programs and merged afterwards, so a few long decodes still fill the GPU.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = block_tables.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if q.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("q and out need a contiguous last (head_dim) axis")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache need a contiguous last (head_dim) axis")
    num_kv_heads = k_cache.shape[2]
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
    bt = block_tables.contiguous()
    block_size = k_cache.shape[1]
    capacity = max(1, bt.shape[1] * block_size)  # host-side bound on any context: no sync
    if num_splits is None:
        num_splits = _default_splits(q, num_seqs * num_kv_heads, capacity) if decode_only else 1
    if num_splits > 1 and not decode_only:
        raise ValueError("split-context attention is for decode-only batches")
    # Slices are whole KV tiles; rounding up may leave fewer slices than asked.
    split_len = triton.cdiv(triton.cdiv(capacity, max(1, num_splits)), block_n) * block_n
    num_splits = triton.cdiv(capacity, split_len)
    d_pad = max(16, next_pow2(head_dim))
    if num_splits > 1:
        part_acc = torch.empty(num_tokens * num_heads * num_splits * d_pad, dtype=torch.float32,
                               device=q.device)
        part_ml = torch.empty(num_tokens * num_heads * num_splits * 2, dtype=torch.float32,
                              device=q.device)
    else:
        part_acc = part_ml = out  # unused
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, bt, query_start_loc.contiguous(), seq_lens.contiguous(),
        part_acc, part_ml,
        float(scale) * math.log2(math.e),
        num_seqs,
        split_len,
        q.stride(0), q.stride(1),
        out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        bt.stride(0),
        BLOCK_SIZE=k_cache.shape[1],
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        DOT_FP32=interp or q.dtype == torch.float32,
        NUM_SPLITS=num_splits,
        num_warps=4,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part_acc, part_ml, out, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=next_pow2(num_splits),
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
        )
    return out


_SM_COUNT: dict[int, int] = {}


def _default_splits(q: torch.Tensor, programs: int, capacity: int) -> int:
    """Enough context slices for about two programs per SM, each slice >= 512 positions."""
    if not q.is_cuda:
        return 1
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    want = -(-2 * _SM_COUNT[index] // max(1, programs))
    return max(1, min(want, capacity // 512, 32))


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One launch for the whole mixed batch: online softmax over KV tiles, fp32 accumulation."""
    _check_args(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out)
    check_triton_device(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    if out is None:
        out = torch.empty_like(q)
    return _launch_paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                   scale, out)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    impl = paged_attention_triton if use_triton(q) else paged_attention_torch
    return impl(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out=out)
