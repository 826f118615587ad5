"""The torch attention path (the CPU serving backend) and its per-step planner.

Everything that depends only on the step's batch — the decode/prefill split, length-sorted
decode chunks, gather indices, masks, prefill segments — is built once by `plan_torch`;
`run_torch` then only gathers and multiplies, once per layer. Decodes run as a few batched
GEMMs (or one SDPA for small chunks) over K/V gathered through the block tables; every
prefilling request gets one SDPA call with a causal mask offset by its cached prefix, except
that adjacent fresh prompts of one length share one call (a short prompt's SDPA costs
more in per-call overhead than in arithmetic). Products accumulate in fp32 and softmax
runs in fp32 for every input dtype.

With bf16 q and cache on a CPU whose compiler builds it, every prefill segment of a step
instead goes through one call of a native causal kernel (`csrc/prefill_cpu.cpp`: AMX-BF16
tiles where the CPU has them, else AVX512-BF16), which reads K/V through the block tables
itself: no gather, no per-request call, one parallel region per layer. Its weights are
rounded to bf16 before the second product, as torch's CPU flash attention does.

A layer with a sliding window, a score soft-cap or attention sinks (all per layer, so
arguments of `run_torch`, not of the shared plan) takes the same gathers with a mask and,
where SDPA cannot express it (soft-capping, sinks), explicit fp32 scores; a windowed
prefill gathers only the blocks its window reaches.

An fp8 cache is widened to q's dtype as it is gathered (exact: every fp8 value is a bf16
and an fp16 value); its per-tensor scales fold into the softmax scale (K) and the output
(V), so no scaled copy of K or V is ever made. Per-KV-head scales fold the same way, one
level down: each query head's rows of q take its KV head's K scale (q is the smallest
operand of a step), each output head its V scale.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from pagemill.kernels import cpu_native
from pagemill.kernels.kv_quant import is_quantized_kv

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


@dataclass(frozen=True, slots=True)
class DecodeChunk:
    """Single-token queries of similar context length, attended in one batched call.

    ``rows`` are the chunk's rows of q and of out (None: all of them, in order).
    ``small`` chunks gather whole blocks (``gather`` holds block ids) for one SDPA call;
    the others gather head-major token rows (``gather`` holds rows of the cache viewed as
    ``[-1, head_dim]``) for two GEMMs. Either way each request gets ``width`` keys, the
    longest context ``max_len`` rounded up to whole blocks on the small path. ``mask``
    marks the padding past each context (None for a single request, cut exactly instead).
    ``lens`` are the chunk's context lengths (windowed layers mask below them too).
    """

    rows: torch.Tensor | None
    max_len: int
    width: int
    small: bool
    gather: torch.Tensor
    mask: torch.Tensor | None
    workspace_numel: int
    lens: torch.Tensor


@dataclass(frozen=True, slots=True)
class PrefillSegment:
    """One request with several query tokens: q/out rows ``start:stop`` over ``ctx`` keys.

    ``mask`` is None when the queries are the whole context (plain causal), else the
    causal mask offset by the cached prefix.
    """

    start: int
    stop: int
    ctx: int
    block_ids: torch.Tensor
    mask: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class PrefillBatch:
    """Fresh prompts (no cached prefix) of one length ``q_len``, adjacent in q's rows
    ``start:start + n * q_len``: one causal SDPA call over all of them instead of one per
    prompt. ``block_ids`` are their blocks, ``nblk`` per prompt, prompt after prompt."""

    start: int
    n: int
    q_len: int
    nblk: int
    block_ids: torch.Tensor


@dataclass(frozen=True, slots=True)
class NativePrefill:
    """Every prefill segment of the step for the native causal kernel (`csrc/prefill_cpu.cpp`):
    ``seg`` int32 [n, 3] = (first row, query length, context length), ``tables`` their
    block-table rows (contiguous int32), ``workspace_numel`` the bf16 elements of its
    packed K/V."""

    seg: torch.Tensor
    tables: torch.Tensor
    workspace_numel: int


@dataclass(frozen=True, slots=True)
class NativeDecode:
    """Every decode row of the step for the native kernel (`cpu_native`), which reads K/V
    in place: ``rows`` of q/out (None: all, in order), their tables and context lengths
    (contiguous int32)."""

    rows: torch.Tensor | None
    tables: torch.Tensor
    lens: torch.Tensor


@dataclass(frozen=True, slots=True)
class TorchPlan:
    """A step's batch as the torch path runs it; ``workspace_numel`` sizes the gather buffers
    once for the largest chunk, so a layer fetches them with one lookup. With the native
    kernel, the decode rows are in ``native`` and ``decode`` is empty."""

    decode: tuple[DecodeChunk, ...]
    prefill: tuple[PrefillSegment, ...]
    workspace_numel: int
    native: NativeDecode | None = None
    # How the plain (no window, cap or sinks) path runs ``prefill``: runs of equal fresh
    # prompts batched, the other segments (by index into ``prefill``) one call each.
    batches: tuple[PrefillBatch, ...] = ()
    singles: tuple[int, ...] | None = None
    # The plain path's prefill on the native kernel where it serves the layer's tensors.
    native_prefill: NativePrefill | None = None


def plan_torch(
    query_lens: np.ndarray,
    context_lens: np.ndarray,
    block_tables: torch.Tensor,
    k_cache_shape: tuple[int, int, int, int],
    native: bool = False,
) -> TorchPlan:
    """Plan a validated, non-empty batch (host lengths, int64) for `run_torch`.

    With ``native`` the decode rows go to the native kernel (no gathered copy) instead of
    the gather-and-GEMM chunks.
    """
    is_decode = query_lens == 1
    if is_decode.all():
        if native:
            return TorchPlan((), (), 0, _plan_native(None, context_lens, block_tables))
        decode = _plan_decode(None, context_lens, block_tables, k_cache_shape)
        return TorchPlan(decode, (), max(c.workspace_numel for c in decode))

    dev = block_tables.device
    starts = np.zeros(len(query_lens) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=starts[1:])
    decode_seqs = np.flatnonzero(is_decode)
    decode = ()
    native_decode = None
    if decode_seqs.size:
        rows = torch.from_numpy(starts[decode_seqs]).to(dev)
        sel = torch.from_numpy(decode_seqs).to(dev)
        if native:
            native_decode = _plan_native(rows, context_lens[decode_seqs], block_tables[sel])
        else:
            decode = _plan_decode(rows, context_lens[decode_seqs], block_tables[sel], k_cache_shape)
    block_size = k_cache_shape[1]
    prefill = []
    for s in np.flatnonzero(query_lens > 1).tolist():
        ctx, q_len = int(context_lens[s]), int(query_lens[s])
        nblk = -(-ctx // block_size)
        mask = None
        if q_len != ctx:
            qpos = torch.arange(ctx - q_len, ctx, device=dev)
            mask = torch.arange(ctx, device=dev)[None, :] <= qpos[:, None]
        prefill.append(
            PrefillSegment(
                int(starts[s]),
                int(starts[s + 1]),
                ctx,
                block_tables[s, :nblk].to(torch.int64),
                mask,
            )
        )
    workspace = max((c.workspace_numel for c in decode), default=0)
    batches, singles = _plan_batches(prefill, block_size)
    native_prefill = None
    if native and prefill and _switch(_NATIVE_PREFILL_ENV):
        native_prefill = _plan_native_prefill(
            query_lens, context_lens, starts, block_tables, k_cache_shape
        )
    return TorchPlan(
        decode, tuple(prefill), workspace, native_decode, batches, singles, native_prefill
    )


def _plan_native_prefill(
    query_lens: np.ndarray,
    context_lens: np.ndarray,
    starts: np.ndarray,
    block_tables: torch.Tensor,
    k_cache_shape: tuple[int, int, int, int],
) -> NativePrefill:
    sel = np.flatnonzero(query_lens > 1)
    seg = np.stack([starts[sel], query_lens[sel], context_lens[sel]], axis=1).astype(np.int32)
    ctx = context_lens[sel].astype(np.int64)
    _, _, num_kv_heads, head_dim = k_cache_shape
    per_pair = 2 * (-(-ctx // 32) * 32) * head_dim
    tables = block_tables[torch.from_numpy(sel).to(block_tables.device)]
    return NativePrefill(
        torch.from_numpy(np.ascontiguousarray(seg)),
        tables.to(torch.int32).contiguous(),
        int(per_pair.sum()) * num_kv_heads,
    )


def _plan_batches(
    segs: list[PrefillSegment], block_size: int
) -> tuple[tuple[PrefillBatch, ...], tuple[int, ...]]:
    """Runs of fresh prompts of equal length, adjacent in q, as batches (two or more
    prompts: per-call costs dominate a short prompt's SDPA); the rest stay single."""
    batches: list[PrefillBatch] = []
    singles: list[int] = []
    i = 0
    while i < len(segs):
        j = i + 1
        if segs[i].mask is None:
            q_len = segs[i].stop - segs[i].start
            while (
                j < len(segs)
                and segs[j].mask is None
                and segs[j].start == segs[j - 1].stop
                and segs[j].stop - segs[j].start == q_len
            ):
                j += 1
        if j - i >= 2:
            nblk = -(-segs[i].ctx // block_size)
            ids = torch.cat([seg.block_ids for seg in segs[i:j]])
            batches.append(
                PrefillBatch(segs[i].start, j - i, segs[i].stop - segs[i].start, nblk, ids)
            )
        else:
            singles.extend(range(i, j))
        i = j
    return tuple(batches), tuple(singles)


def _plan_native(
    rows: torch.Tensor | None, context_lens: np.ndarray, tables: torch.Tensor
) -> NativeDecode:
    lens = torch.from_numpy(np.ascontiguousarray(context_lens, dtype=np.int32))
    return NativeDecode(rows, tables.to(torch.int32).contiguous(), lens)


def _plan_decode(
    rows: torch.Tensor | None,
    context_lens: np.ndarray,
    tables: torch.Tensor,
    k_cache_shape: tuple[int, int, int, int],
) -> tuple[DecodeChunk, ...]:
    """Decode rows (``rows`` of q/out, or all rows in order when None) as chunks.

    Requests are sorted by context length and cut into chunks of similar length (and
    bounded size), so the padding to each chunk's longest context stays small.
    """
    n = len(context_lens)
    dev = tables.device
    per_token = k_cache_shape[2] * k_cache_shape[3]
    lens = torch.from_numpy(context_lens).to(dev)
    longest, shortest = int(context_lens.max()), int(context_lens.min())
    if shortest >= _DECODE_MIN_FILL * longest and n * longest * per_token <= _DECODE_CHUNK_ELEMS:
        return (_plan_chunk(rows, tables, lens, longest, k_cache_shape),)
    lens_list = context_lens.tolist()
    order = sorted(range(n), key=lens_list.__getitem__, reverse=True)
    chunks = []
    start = 0
    while start < n:
        longest = lens_list[order[start]]
        cap = max(1, _DECODE_CHUNK_ELEMS // max(1, longest * per_token))
        stop = start + 1
        while (
            stop < n and stop - start < cap and lens_list[order[stop]] >= _DECODE_MIN_FILL * longest
        ):
            stop += 1
        idx = torch.tensor(order[start:stop], device=dev)
        chunks.append(
            _plan_chunk(
                idx if rows is None else rows[idx], tables[idx], lens[idx], longest, k_cache_shape
            )
        )
        start = stop
    return tuple(chunks)


def _plan_chunk(
    rows: torch.Tensor | None,
    tables: torch.Tensor,
    lens: torch.Tensor,
    max_len: int,
    k_cache_shape: tuple[int, int, int, int],
) -> DecodeChunk:
    n = tables.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache_shape
    dev = tables.device
    nblk = -(-max_len // block_size)
    # Table padding (-1 or stale ids) past a request's length is read but masked out.
    blocks = tables[:, :nblk].to(torch.int64).clamp_(min=0)
    if n * max_len <= _DECODE_SMALL_TOKENS:
        width = nblk * block_size
        mask = None
        if n > 1:
            mask = (torch.arange(width, device=dev) < lens[:, None])[:, None, None, :]
        return DecodeChunk(
            rows,
            max_len,
            width,
            True,
            blocks.reshape(-1),
            mask,
            n * width * num_kv_heads * head_dim,
            lens,
        )
    # Row of (position p, KV head h) in the cache viewed as [-1, head_dim]:
    # slot(p) * num_kv_heads + h.
    pos = torch.arange(max_len, device=dev)
    tokens = (
        blocks.mul_(block_size * num_kv_heads).index_select(1, pos // block_size)
        + (pos % block_size) * num_kv_heads
    )
    gather = (
        tokens.unsqueeze(1) + torch.arange(num_kv_heads, device=dev).view(1, num_kv_heads, 1)
    ).view(-1)
    mask = (pos >= lens[:, None]).view(n, 1, 1, max_len) if n > 1 else None
    return DecodeChunk(
        rows, max_len, max_len, False, gather, mask, n * num_kv_heads * max_len * head_dim, lens
    )


def run_torch(
    plan: TorchPlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
    softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One layer's attention over a planned batch: only gathers, GEMMs and SDPA calls.

    ``window`` > 0: sliding-window attention (keys ``p - window < pos <= p``); ``softcap``
    > 0: scores capped as ``softcap * tanh(s / softcap)``; ``sinks`` (fp32 [num_heads]):
    one extra logit per head in each softmax's denominator (see `paged_attention`).
    """
    plain = window <= 0 and softcap <= 0 and sinks is None
    ks = 1.0
    vs: float | torch.Tensor = 1.0
    q_native = q
    quantized = is_quantized_kv(k_cache.dtype)
    if quantized:
        if k_scale is not None and k_scale.dim() == 1:
            # One K scale per KV head: onto q's rows of that head's group (see the docstring).
            q = q * _per_query_head(k_scale, q.shape[1]).to(q.dtype)
        elif k_scale is not None:
            ks = float(k_scale)
        if v_scale is not None and v_scale.dim() == 1:
            vs = _per_query_head(v_scale, q.shape[1])  # [H, 1]: times each head's rows
        elif v_scale is not None:
            vs = float(v_scale)
    native_scale = scale
    scale = scale * ks
    if plan.native is not None:
        nd = plan.native
        lib = cpu_native.load()
        if lib is None or not cpu_native.supports(q, k_cache):
            raise ValueError(
                "this plan was made for the native CPU decode kernel, which "
                "cannot serve these tensors; plan again with them"
            )
        cpu_native.paged_decode(
            lib,
            q_native,
            k_cache,
            v_cache,
            out,
            nd.tables,
            nd.lens,
            nd.rows,
            native_scale,
            window,
            softcap,
            k_scale if quantized else None,
            v_scale if quantized else None,
            sinks,
        )
    if plan.decode:
        kbuf, vbuf = _buffers(plan.workspace_numel, q.dtype, q.device)
        for chunk in plan.decode:
            qc = q if chunk.rows is None else q[chunk.rows]
            if not plain:
                o = _decode_masked(
                    qc, k_cache, v_cache, chunk, scale, kbuf, vbuf, window, softcap, sinks
                )
            elif chunk.small:
                o = _decode_small(qc, k_cache, v_cache, chunk, scale, kbuf, vbuf)
            else:
                o = _decode_gemm(qc, k_cache, v_cache, chunk, scale, kbuf, vbuf)
            if not _is_one(vs):
                o = (o * vs).to(o.dtype)  # a per-head vs is fp32
            if chunk.rows is None:
                out.copy_(o)
            else:
                out.index_copy_(0, chunk.rows, o)
    if (
        plan.prefill
        and plain
        and _native_prefill(plan.native_prefill, q, k_cache, v_cache, scale, out)
    ):
        if not _is_one(vs):
            for seg in plan.prefill:
                out[seg.start : seg.stop].mul_(vs)
    elif plan.prefill:
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        if plain:
            for batch in plan.batches:
                _prefill_batch(q, k_cache, v_cache, batch, scale, out, vs)
        singles = plan.singles if plain and plan.singles is not None else range(len(plan.prefill))
        for i in singles:
            seg = plan.prefill[i]
            if not plain:
                _prefill_masked(q, k_cache, v_cache, seg, scale, out, window, softcap, sinks)
                if not _is_one(vs):
                    out[seg.start : seg.stop].mul_(vs)
                continue
            k = _blocks(k_cache, seg.block_ids, q.dtype).view(-1, num_kv_heads, head_dim)
            v = _blocks(v_cache, seg.block_ids, q.dtype).view(-1, num_kv_heads, head_dim)
            k, v = k[: seg.ctx].transpose(0, 1), v[: seg.ctx].transpose(0, 1)
            qs = q[seg.start : seg.stop].transpose(0, 1)
            if seg.mask is None:
                o = F.scaled_dot_product_attention(
                    qs, k, v, is_causal=True, scale=scale, enable_gqa=True
                )
            else:
                o = F.scaled_dot_product_attention(
                    qs, k, v, attn_mask=seg.mask, scale=scale, enable_gqa=True
                )
            o = o.transpose(0, 1)
            if not _is_one(vs):
                o = (o * vs).to(o.dtype)  # a per-head vs is fp32
            out[seg.start : seg.stop] = o
    return out


_PREFILL_SOURCE = Path(__file__).parent / "csrc" / "prefill_cpu.cpp"
# Set to 0 to keep SDPA for prefill (e.g. to compare the two).
_NATIVE_PREFILL_ENV = "PAGEMILL_NATIVE_PREFILL"
# Set to 0 to keep the native prefill on the vector units (AVX512-BF16) where AMX serves.
_PREFILL_AMX_ENV = "PAGEMILL_CPU_PREFILL_AMX"
_native_prefill_off = False


def _switch(name: str) -> bool:
    """A 0/1 switch that is on unless set to 0; any other value is refused (read per plan
    and call, so tests and benchmarks can flip it; checked once at import too)."""
    value = os.environ.get(name, "1").strip() or "1"
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


for _name in (_NATIVE_PREFILL_ENV, _PREFILL_AMX_ENV):
    _switch(_name)


def build_prefill() -> Path | None:
    """The prefill kernel's library, built for this CPU (see `native_build`)."""
    return cpu_native.build_shared(_PREFILL_SOURCE, "the CPU prefill kernel", "using SDPA")


@functools.cache
def _prefill_lib() -> ctypes.CDLL | None:
    target = build_prefill()
    if target is None:
        return None
    lib = ctypes.CDLL(str(target))
    fn = lib.pagemill_prefill_causal
    fn.restype = ctypes.c_int
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, i64, ptr, ptr, i64]
    fn.argtypes += [i32, i32, i32, i32, i32, ctypes.c_float, ptr, i64, i32, i32]
    return lib


def _native_prefill(
    plan: NativePrefill | None,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> bool:
    """Every prefill segment through the native kernel, if it serves these tensors (bf16
    q, cache and out, head dim a multiple of 32, dense rows) and a positive scale (its
    softmax takes the max before scaling); False: nothing was done."""
    global _native_prefill_off
    if (
        plan is None
        or _native_prefill_off
        or not scale > 0
        or q.dtype != torch.bfloat16
        or k_cache.dtype != torch.bfloat16
        or out.dtype != torch.bfloat16
        or q.device.type != "cpu"
        or k_cache.shape[3] % 32
        or k_cache.shape[3] > 256
        or v_cache.dtype != torch.bfloat16
        or not k_cache.is_contiguous()
        or not v_cache.is_contiguous()
        or q.stride(2) != 1
        or out.stride(2) != 1
    ):
        return False
    lib = _prefill_lib()
    if lib is None:
        return False
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    work = _prefill_work(plan.workspace_numel)
    status = lib.pagemill_prefill_causal(
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        out.stride(1),
        plan.seg.data_ptr(),
        plan.tables.data_ptr(),
        plan.tables.stride(0),
        plan.seg.shape[0],
        q.shape[1],
        num_kv_heads,
        head_dim,
        block_size,
        float(scale),
        work.data_ptr(),
        work.numel(),
        torch.get_num_threads(),
        int(_switch(_PREFILL_AMX_ENV)),
    )
    if status == 2:  # built without AVX512-BF16: SDPA from now on
        _native_prefill_off = True
        return False
    if status:
        raise RuntimeError(f"prefill_cpu refused its arguments (status {status})")
    return True


def _prefill_work(numel: int) -> torch.Tensor:
    """A grow-only bf16 buffer per thread for the native prefill's packed K/V (a fresh one
    would be page-faulted in at every layer)."""
    buf = getattr(_workspace, "prefill", None)
    if buf is None or buf.numel() < numel:
        buf = _workspace.prefill = torch.empty(max(numel, 1), dtype=torch.bfloat16)
    return buf


def _prefill_batch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PrefillBatch,
    scale: float,
    out: torch.Tensor,
    vs: float | torch.Tensor,
) -> None:
    """A run of fresh prompts of one length: one gather of all their blocks, one causal
    SDPA call with the prompts on its batch axis (GQA on its head axis)."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    n, q_len = batch.n, batch.q_len
    width = batch.nblk * block_size
    shape = (n, width, num_kv_heads, head_dim)
    k = _blocks(k_cache, batch.block_ids, q.dtype).view(shape)[:, :q_len].transpose(1, 2)
    v = _blocks(v_cache, batch.block_ids, q.dtype).view(shape)[:, :q_len].transpose(1, 2)
    rows = slice(batch.start, batch.start + n * q_len)
    qs = q[rows].view(n, q_len, q.shape[1], head_dim).transpose(1, 2)
    o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
    o = o.transpose(1, 2)
    if not _is_one(vs):
        o = (o * vs).to(o.dtype)  # a per-head vs is fp32
    out[rows].view(n, q_len, q.shape[1], head_dim).copy_(o)


def _is_one(vs: float | torch.Tensor) -> bool:
    return not isinstance(vs, torch.Tensor) and vs == 1.0


def _per_query_head(scale: torch.Tensor, num_heads: int) -> torch.Tensor:
    """A per-KV-head scale [KV] as one value per query head [H, 1] (GQA: each KV head's
    scale repeated over its group), in fp32."""
    return scale.repeat_interleave(num_heads // scale.shape[0])[:, None]


def _blocks(cache: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Whole blocks of a cache in the compute dtype (an fp8 cache widened, unscaled)."""
    got = cache.index_select(0, ids)
    return got.to(dtype) if got.dtype != dtype else got


def _buffers(
    numel: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    key = (dtype, str(device))
    cache = getattr(_workspace, "bufs", None)
    if cache is None:
        cache = _workspace.bufs = {}
    bufs = cache.get(key)
    if bufs is None or bufs[0].numel() < numel:
        bufs = (
            torch.empty(numel, dtype=dtype, device=device),
            torch.empty(numel, dtype=dtype, device=device),
        )
        cache[key] = bufs
    return bufs


def _gather_rows(
    table: torch.Tensor, rows: torch.Tensor, buf: torch.Tensor, shape: tuple[int, ...]
) -> torch.Tensor:
    """Rows of the 2-D ``table`` (a view of a paged cache) copied into ``buf`` as ``shape``."""
    width = table.shape[1]
    bits = _BIT_VIEWS.get(table.element_size())
    numel = rows.numel() * width
    if table.dtype != buf.dtype:  # an fp8 cache: widened (exactly) into the buffer
        got = buf[:numel].view(-1, width)
        got.copy_(torch.index_select(table, 0, rows))
    elif bits is None:
        got = torch.index_select(table, 0, rows, out=buf[:numel].view(-1, width))
    else:
        got = torch.index_select(
            table.view(bits), 0, rows, out=buf[:numel].view(bits).view(-1, width)
        ).view(table.dtype)
    return got.view(shape)


def _gather_chunk_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: DecodeChunk,
    n: int,
    kbuf: torch.Tensor,
    vbuf: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode chunk's K and V as [n, kv_heads, width, head_dim]: a small chunk gathers
    whole blocks (a transposed view), a large one head-major rows (contiguous: what the
    GEMM path multiplies)."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    if chunk.small:
        shape = (n, chunk.width, num_kv_heads, head_dim)
        row = block_size * num_kv_heads * head_dim
        k = _gather_rows(k_cache.view(-1, row), chunk.gather, kbuf, shape)
        v = _gather_rows(v_cache.view(-1, row), chunk.gather, vbuf, shape)
        return k.transpose(1, 2), v.transpose(1, 2)
    shape = (n, num_kv_heads, chunk.width, head_dim)
    return (
        _gather_rows(k_cache.view(-1, head_dim), chunk.gather, kbuf, shape),
        _gather_rows(v_cache.view(-1, head_dim), chunk.gather, vbuf, shape),
    )


def _decode_small(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: DecodeChunk,
    scale: float,
    kbuf: torch.Tensor,
    vbuf: torch.Tensor,
) -> torch.Tensor:
    """Small decode batches: whole blocks gathered, one SDPA call.

    Below a few thousand context tokens the fixed cost of ops dominates, and this path
    has the fewest: GQA rides on SDPA's query axis (the G query heads of a KV head), so
    K/V are never repeated, and a single request is cut exactly instead of masked.
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    k, v = _gather_chunk_kv(k_cache, v_cache, chunk, n, kbuf, vbuf)
    if chunk.mask is None:
        k, v = k[:, :, : chunk.max_len], v[:, :, : chunk.max_len]
    o = F.scaled_dot_product_attention(
        q.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim),
        k,
        v,
        attn_mask=chunk.mask,
        scale=scale,
    )
    return o.reshape(n, num_heads, head_dim)


def _decode_gemm(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: DecodeChunk,
    scale: float,
    kbuf: torch.Tensor,
    vbuf: torch.Tensor,
) -> torch.Tensor:
    """Attention for single-token queries, all at the end of their contexts.

    K/V are gathered head-major (``[n, kv_heads, max_len, head_dim]``, contiguous) so both
    products are plain batched GEMMs; GQA rides on the GEMM's M dimension (the G query
    heads sharing a KV head), so K/V are read once per KV head, never repeated. Scores and
    softmax are fp32; the products run in the input dtype with fp32 accumulation.
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    k, v = _gather_chunk_kv(k_cache, v_cache, chunk, n, kbuf, vbuf)
    s = torch.matmul(
        q.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim), k.transpose(-1, -2)
    )
    s = s.float().mul_(scale)
    if chunk.mask is not None:
        s.masked_fill_(chunk.mask, float("-inf"))
    p = torch.softmax(s, dim=-1).to(q.dtype)
    return torch.matmul(p, v).view(n, num_heads, head_dim)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor,
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Explicit attention: fp32 scores, optional soft-cap, ``keep`` mask, fp32 softmax.

    ``q`` [..., M, D] against ``k``/``v`` [..., N, D] (broadcast over leading axes, which is
    how GQA groups share a KV head); ``keep`` broadcasts to [..., M, N]; ``sinks`` to
    [..., M, 1]. The order of operations is transformers' eager attention: scale, cap,
    mask, softmax (with the sink's logit in the denominator: it also bounds the max, so
    a row whose keys are all masked still has a finite one).
    """
    s = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)
    if softcap > 0:
        s = torch.tanh(s.div_(softcap)).mul_(softcap)
    s = s.masked_fill_(~keep, float("-inf"))
    if sinks is None:
        p = torch.softmax(s, dim=-1).to(v.dtype)
    else:
        sink = sinks.expand(*s.shape[:-1], 1)
        top = torch.maximum(s.amax(dim=-1, keepdim=True), sink)
        e = s.sub_(top).exp_()
        p = e.div_(e.sum(dim=-1, keepdim=True).add_((sink - top).exp_())).to(v.dtype)
    return torch.matmul(p, v)


def _decode_masked(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: DecodeChunk,
    scale: float,
    kbuf: torch.Tensor,
    vbuf: torch.Tensor,
    window: int,
    softcap: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """A decode chunk of a windowed, soft-capped or sink layer: the chunk's gather, then
    explicit scores masked below each request's window as well as past its context."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    k, v = _gather_chunk_kv(k_cache, v_cache, chunk, n, kbuf, vbuf)
    pos = torch.arange(chunk.width, device=q.device)
    lens = chunk.lens[:, None]
    keep = pos < lens
    if window > 0:
        keep &= pos >= lens - window
    o = _attend(
        q.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim),
        k,
        v,
        keep.view(n, 1, 1, chunk.width),
        scale,
        softcap,
        None if sinks is None else sinks.view(1, num_kv_heads, num_heads // num_kv_heads, 1),
    )
    return o.reshape(n, num_heads, head_dim)


def _prefill_masked(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seg: PrefillSegment,
    scale: float,
    out: torch.Tensor,
    window: int,
    softcap: float,
    sinks: torch.Tensor | None = None,
) -> None:
    """A prefill segment of a windowed, soft-capped or sink layer, written into ``out``.

    With a window, only the blocks from the first query's window start on are gathered, so
    a long prompt's chunk costs its window, not its whole context.
    """
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    q_len = seg.stop - seg.start
    first = seg.ctx - q_len
    b0 = max(0, first - window + 1) // block_size if window > 0 else 0
    ids = seg.block_ids[b0:]
    lo = b0 * block_size
    k = _blocks(k_cache, ids, q.dtype).view(-1, num_kv_heads, head_dim)[: seg.ctx - lo]
    v = _blocks(v_cache, ids, q.dtype).view(-1, num_kv_heads, head_dim)[: seg.ctx - lo]
    kpos = torch.arange(lo, seg.ctx, device=q.device)
    qpos = torch.arange(first, seg.ctx, device=q.device)[:, None]
    keep = kpos <= qpos
    if window > 0:
        keep &= kpos > qpos - window
    qs = q[seg.start : seg.stop].transpose(0, 1)  # [H, L, D]
    k, v = k.transpose(0, 1), v.transpose(0, 1)  # [KVH, N, D]
    if softcap > 0 or sinks is not None:
        num_heads = qs.shape[0]
        group = num_heads // num_kv_heads
        o = _attend(
            qs.reshape(num_kv_heads, group, q_len, head_dim),
            k[:, None],
            v[:, None],
            keep,
            scale,
            softcap,
            None if sinks is None else sinks.view(num_kv_heads, group, 1, 1),
        ).reshape(num_heads, q_len, head_dim)
    else:
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=keep, scale=scale, enable_gqa=True)
    out[seg.start : seg.stop] = o.transpose(0, 1)
