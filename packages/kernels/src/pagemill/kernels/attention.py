"""Paged attention over a flattened varlen batch: one call for mixed prefill and decode.

The runtime concatenates every scheduled token of every request into ``q [T, H, D]``;
request ``s`` owns rows ``query_start_loc[s]:query_start_loc[s+1]`` and its K/V live in
the paged cache at the blocks listed in ``block_tables[s]``. Its ``seq_lens[s]`` counts
every token of its context including this step's, so query ``j`` of request ``s`` sits at
position ``seq_lens[s] - q_len_s + j`` and sees keys at positions ``<=`` that (causal,
with cached prefix tokens from earlier steps or prefix hits visible to all of them).

Every layer of a step attends over the same batch, so what depends only on the batch is
planned once per step (`plan_attention`) and each layer only runs kernels
(`paged_attention(..., plan=plan)`). The backends live in `attention_cpu` (torch) and
`attention_triton`; this module checks arguments, plans and dispatches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from pagemill.kernels import cpu_native
from pagemill.kernels._dispatch import check_triton_device, use_triton
from pagemill.kernels._opaque import OpaqueBase
from pagemill.kernels.attention_cpu import TorchPlan, plan_torch, run_torch
from pagemill.kernels.attention_triton import TritonPlan, plan_triton, run_triton
from pagemill.kernels.kv_quant import check_scale, is_quantized_kv

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

Backend = Literal["torch", "triton"]


@dataclass(frozen=True, eq=False)
class AttentionPlan(OpaqueBase):
    """Everything attention needs about one step's batch, computed once, read by every layer.

    The metadata tensors are int32 and contiguous, on the device the plan was made for;
    with a plan, they are what the kernels read. ``k_cache_shape``, ``num_heads`` and
    ``dtype`` are what the plan was made for: each call checks its tensors against them
    (attribute reads only). ``impl`` is the backend's precomputed state: a `TorchPlan`
    (decode chunks with their gather indices and masks, prefill segments) or a
    `TritonPlan` (grid, tile sizes, context splits and their workspace); None when the
    step has no query token.

    It is an opaque object to torch.compile (see `pagemill.kernels.ops`): a compiled model
    graph passes it whole to the attention op instead of tracing into it.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    num_tokens: int
    num_seqs: int
    backend: Backend
    impl: TorchPlan | TritonPlan | None
    k_cache_shape: tuple[int, int, int, int]
    num_heads: int
    dtype: torch.dtype


def plan_attention(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    k_cache_shape: tuple[int, int, int, int],
    num_heads: int,
    dtype: torch.dtype,
    query_lens: np.ndarray | Sequence[int] | None = None,
    context_lens: np.ndarray | Sequence[int] | None = None,
    backend: Backend | None = None,
) -> AttentionPlan:
    """Plan one step's attention for every layer whose cache has ``k_cache_shape``.

    ``k_cache_shape`` is ``(num_blocks, block_size, num_kv_heads, head_dim)``.
    ``query_lens``/``context_lens`` are the same data as ``query_start_loc``/``seq_lens``,
    given on the host by callers that have them (the model runner) so planning never syncs
    with the device; when None they are read once from the tensors. Given ones are trusted
    to match the tensors (comparing would sync). The metadata is validated here, once.
    ``backend`` defaults to the tensors' device (CUDA: Triton, else
    torch); "triton" on CPU tensors is for the interpreter (``TRITON_INTERPRET=1``).
    """
    return _plan(
        query_start_loc,
        seq_lens,
        block_tables,
        k_cache_shape=k_cache_shape,
        num_heads=num_heads,
        dtype=dtype,
        query_lens=query_lens,
        context_lens=context_lens,
        backend=backend,
        num_tokens=None,
    )


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
    plan: AttentionPlan | None = None,
    window: int = 0,
    softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q`` over the paged cache: the plan's backend, else by q's device.

    ``window`` > 0 makes it sliding-window attention: a query at position ``p`` sees the
    keys at ``p - window < pos <= p`` (transformers' convention: ``window`` keys including
    its own). ``softcap`` > 0 caps the scaled scores as ``softcap * tanh(s / softcap)``
    before the softmax (Gemma 2). Both are per layer, so they are arguments of the call,
    not of the per-step plan, which every layer shares. An 8-bit cache is read as
    ``float(x) * k_scale`` / ``* v_scale`` (fp32, 0-dim: one per layer, or [num_kv_heads]:
    one per KV head; None: 1.0; see `pagemill.kernels.kv_quant`). ``sinks`` [num_heads]
    (gpt-oss's attention sinks, None: none) are one learned logit per head that joins each
    query's softmax denominator and attends to no value: ``softmax([s_1..s_n, sink])`` with
    the sink's column dropped, so a head can put weight nowhere. Like the window, they are
    the layer's.
    """
    _check_window(window, softcap)
    if plan is None:
        triton_backend = use_triton(q)
    else:
        triton_backend = plan.backend == "triton"
    impl = paged_attention_triton if triton_backend else paged_attention_torch
    return impl(
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        out=out,
        plan=plan,
        window=window,
        softcap=softcap,
        k_scale=k_scale,
        v_scale=v_scale,
        sinks=sinks,
    )


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
    plan: AttentionPlan | None = None,
    window: int = 0,
    softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The CPU serving backend: batched GEMMs for decodes, one SDPA per prefilling request.

    Decode-only steps (every query length 1) are the common case of serving and run as a
    few batched calls (requests bucketed by context length) over K/V gathered through the
    block tables; requests with several query tokens (prefill chunks) each get one SDPA
    call with a causal mask offset by their cached prefix (equal fresh prompts share one),
    or, in bf16 with the native kernels built, all of them one call of the native causal
    kernel (see `attention_cpu`). Products accumulate in fp32 and
    softmax runs in fp32 for every input dtype. Without a plan, the batch is planned here.
    """
    _check_tensors(q, k_cache, v_cache, out)
    _check_window(window, softcap)
    check_scale("k_scale", k_scale, k_cache.shape[2])
    check_scale("v_scale", v_scale, k_cache.shape[2])
    sinks = _check_sinks(sinks, q)
    if plan is None:
        plan = _plan(
            query_start_loc,
            seq_lens,
            block_tables,
            k_cache_shape=tuple(k_cache.shape),
            num_heads=q.shape[1],
            dtype=q.dtype,
            query_lens=None,
            context_lens=None,
            backend="torch",
            num_tokens=q.shape[0],
        )
    else:
        _check_plan(plan, "torch", q, k_cache, block_tables, query_start_loc, seq_lens)
    if out is None:
        out = torch.empty_like(q)
    if not isinstance(plan.impl, TorchPlan):
        return out
    return run_torch(
        plan.impl,
        q,
        k_cache,
        v_cache,
        scale,
        out,
        window=int(window),
        softcap=float(softcap),
        k_scale=k_scale,
        v_scale=v_scale,
        sinks=sinks,
    )


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
    plan: AttentionPlan | None = None,
    window: int = 0,
    softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One launch for the whole mixed batch: online softmax over KV tiles, fp32 accumulation.

    Without a plan, the launch is planned here from shapes alone (CUDA metadata is not
    read, so the call never syncs with the device).
    """
    _check_tensors(q, k_cache, v_cache, out)
    _check_window(window, softcap)
    check_scale("k_scale", k_scale, k_cache.shape[2])
    check_scale("v_scale", v_scale, k_cache.shape[2])
    sinks = _check_sinks(sinks, q)
    if plan is None:
        plan = _plan(
            query_start_loc,
            seq_lens,
            block_tables,
            k_cache_shape=tuple(k_cache.shape),
            num_heads=q.shape[1],
            dtype=q.dtype,
            query_lens=None,
            context_lens=None,
            backend="triton",
            num_tokens=q.shape[0],
        )
    else:
        _check_plan(plan, "triton", q, k_cache, block_tables, query_start_loc, seq_lens)
    check_triton_device(q, k_cache, v_cache, *(() if out is None else (out,)))
    if out is None:
        out = torch.empty_like(q)
    if not isinstance(plan.impl, TritonPlan):
        return out
    return run_triton(
        plan.impl,
        q,
        k_cache,
        v_cache,
        plan.block_tables,
        plan.query_start_loc,
        plan.seq_lens,
        scale,
        out,
        window=int(window),
        softcap=float(softcap),
        k_scale=k_scale,
        v_scale=v_scale,
        sinks=sinks,
    )


# ----------------------------------------------------------------------------- planning


def _plan(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    k_cache_shape: tuple[int, ...],
    num_heads: int,
    dtype: torch.dtype,
    query_lens: np.ndarray | Sequence[int] | None,
    context_lens: np.ndarray | Sequence[int] | None,
    backend: Backend | None,
    num_tokens: int | None,
) -> AttentionPlan:
    """`plan_attention`, plus ``num_tokens`` when a call plans for its own q.

    The torch path needs the lengths' values; the Triton launch needs shapes only, so a
    call with CUDA metadata and no host lengths reads nothing (no sync) and skips the
    value checks, as the kernel always did. Host-side values are always checked: it's free.
    """
    shape = _check_layout(k_cache_shape, num_heads, dtype)
    _check_metadata(block_tables, query_start_loc, seq_lens)
    if backend is None:
        backend = "triton" if use_triton(query_start_loc) else "torch"
    elif backend not in ("torch", "triton"):
        raise ValueError(f"backend must be 'torch' or 'triton', got {backend!r}")
    if backend == "triton":
        check_triton_device(query_start_loc, seq_lens, block_tables)
    num_seqs, table_width = block_tables.shape
    qsl, lens, tables = (_int32(t) for t in (query_start_loc, seq_lens, block_tables))
    if backend == "torch":
        q_lens, ctx_lens = _host_lens(
            query_start_loc, seq_lens, query_lens, context_lens, num_tokens, table_width, shape[1]
        )
        total = int(q_lens.sum())
        impl: TorchPlan | TritonPlan | None = None
        if total and num_seqs:
            native = (
                dtype in _FLOAT_DTYPES
                and qsl.device.type == "cpu"
                and cpu_native.load() is not None
            )
            impl = plan_torch(q_lens, ctx_lens, tables, shape, native=native)
    else:
        if (
            num_tokens is None
            or not query_start_loc.is_cuda
            or query_lens is not None
            or context_lens is not None
        ):
            num_tokens = int(
                _host_lens(
                    query_start_loc,
                    seq_lens,
                    query_lens,
                    context_lens,
                    num_tokens,
                    table_width,
                    shape[1],
                )[0].sum()
            )
        total = num_tokens
        impl = None
        if total and num_seqs:
            impl = plan_triton(total, num_seqs, table_width, shape, num_heads, dtype, qsl.device)
    return AttentionPlan(qsl, lens, tables, total, num_seqs, backend, impl, shape, num_heads, dtype)


def _host_lens(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: np.ndarray | Sequence[int] | None,
    context_lens: np.ndarray | Sequence[int] | None,
    num_tokens: int | None,
    table_width: int,
    block_size: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Query and context lengths as int64 host arrays, checked against each other and the
    tables (what each call used to check, now once per step)."""
    num_seqs = seq_lens.shape[0]
    if query_lens is None:
        starts = _host_int64(query_start_loc)
        q_lens = starts[1:] - starts[:-1]
    else:
        q_lens = np.ascontiguousarray(query_lens, dtype=np.int64)
        if q_lens.shape != (num_seqs,):
            raise ValueError(
                f"query_lens must hold num_seqs={num_seqs} lengths, got {q_lens.shape}"
            )
        starts = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=starts[1:])
    if context_lens is None:
        ctx_lens = _host_int64(seq_lens)
    else:
        ctx_lens = np.ascontiguousarray(context_lens, dtype=np.int64)
        if ctx_lens.shape != (num_seqs,):
            raise ValueError(
                f"context_lens must hold num_seqs={num_seqs} lengths, got {ctx_lens.shape}"
            )
    expected = int(starts[-1]) if num_tokens is None else num_tokens
    if starts[0] != 0 or starts[-1] != expected or (num_seqs and q_lens.min() < 0):
        raise ValueError(
            f"query_start_loc must rise from 0 to num_tokens={expected}; got {starts.tolist()}"
        )
    if num_seqs:
        over = q_lens > ctx_lens
        if over.any():
            s = int(over.argmax())
            raise ValueError(
                f"seq {s}: {q_lens[s]} query tokens but seq_lens is {ctx_lens[s]} "
                "(seq_lens counts the whole context including this step)"
            )
        longest = int(ctx_lens.max())
        if longest > table_width * block_size:
            raise ValueError(
                f"a context of {longest} tokens needs more than the {table_width} blocks "
                "block_tables holds"
            )
    return q_lens, ctx_lens


def _host_int64(t: torch.Tensor) -> np.ndarray:
    return (t if t.device.type == "cpu" else t.cpu()).numpy().astype(np.int64)


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


# ----------------------------------------------------------------------------- checks


def _check_layout(
    k_cache_shape: tuple[int, ...], num_heads: int, dtype: torch.dtype
) -> tuple[int, int, int, int]:
    if len(k_cache_shape) != 4:
        raise ValueError(
            "k_cache_shape must be (num_blocks, block_size, num_kv_heads, head_dim); "
            f"got {tuple(k_cache_shape)}"
        )
    shape = (
        int(k_cache_shape[0]),
        int(k_cache_shape[1]),
        int(k_cache_shape[2]),
        int(k_cache_shape[3]),
    )
    num_kv_heads = shape[2]
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"attention runs in fp32/fp16/bf16, got {dtype}")
    return shape


def _check_metadata(
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor
) -> None:
    if block_tables.dim() != 2:
        raise ValueError(
            f"block_tables must be [num_seqs, max_blocks], got {tuple(block_tables.shape)}"
        )
    num_seqs = block_tables.shape[0]
    if seq_lens.dim() != 1 or seq_lens.shape[0] != num_seqs:
        raise ValueError(f"seq_lens must be [num_seqs={num_seqs}], got {tuple(seq_lens.shape)}")
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            f"query_start_loc must be [num_seqs + 1 = {num_seqs + 1}], "
            f"got {tuple(query_start_loc.shape)}"
        )
    for name, t in (
        ("block_tables", block_tables),
        ("query_start_loc", query_start_loc),
        ("seq_lens", seq_lens),
    ):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")


def _check_window(window: int, softcap: float) -> None:
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: no sliding window), got {window}")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0: no soft-capping), got {softcap}")


def _check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """One fp32 logit per query head, contiguous, on q's device (every backend reads it so)."""
    if sinks is None:
        return None
    if sinks.dim() != 1 or sinks.shape[0] != q.shape[1] or not sinks.is_floating_point():
        raise ValueError(
            f"sinks must be one float per query head [{q.shape[1]}], got "
            f"{tuple(sinks.shape)} {sinks.dtype}"
        )
    if sinks.device != q.device:
        raise ValueError(f"sinks are on {sinks.device} but q is on {q.device}")
    if sinks.dtype != torch.float32 or not sinks.is_contiguous():
        sinks = sinks.float().contiguous()
    return sinks


def _check_tensors(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor | None
) -> None:
    """Shape checks only (no device sync): bad shapes would otherwise read stray memory."""
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]; "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.shape[3] != q.shape[2]:
        raise ValueError(f"head_dim mismatch: q has {q.shape[2]}, cache has {k_cache.shape[3]}")
    kv_ok = k_cache.dtype == q.dtype or is_quantized_kv(k_cache.dtype)
    if q.dtype not in _FLOAT_DTYPES or not kv_ok or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            "q must be fp32/fp16/bf16 and k_cache and v_cache share q's dtype or one fp8 "
            f"or int8 dtype; got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device):
        raise ValueError(
            f"out must match q ({tuple(q.shape)}, {q.dtype}, {q.device}); "
            f"got {tuple(out.shape)}, {out.dtype}, {out.device}"
        )


def _check_plan(
    plan: AttentionPlan,
    backend: Backend,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """A call's tensors against what its plan was made for: attribute reads only."""
    if plan.backend != backend:
        raise ValueError(f"a {plan.backend} plan cannot run the {backend} path")
    if q.shape[0] != plan.num_tokens or q.shape[1] != plan.num_heads or q.dtype != plan.dtype:
        raise ValueError(
            f"q is {tuple(q.shape)} {q.dtype} but the plan is for {plan.num_tokens} tokens of "
            f"{plan.num_heads} heads in {plan.dtype}"
        )
    if k_cache.shape != plan.k_cache_shape:
        raise ValueError(
            f"the caches are {tuple(k_cache.shape)} but the plan is for {plan.k_cache_shape}"
        )
    if q.device != plan.query_start_loc.device:
        raise ValueError(f"q is on {q.device} but the plan is on {plan.query_start_loc.device}")
    if (
        block_tables.shape != plan.block_tables.shape
        or query_start_loc.shape != plan.query_start_loc.shape
        or seq_lens.shape != plan.seq_lens.shape
    ):
        raise ValueError(
            "block_tables, query_start_loc and seq_lens must be the plan's "
            f"({tuple(plan.block_tables.shape)}, {tuple(plan.query_start_loc.shape)}, "
            f"{tuple(plan.seq_lens.shape)}); got {tuple(block_tables.shape)}, "
            f"{tuple(query_start_loc.shape)}, {tuple(seq_lens.shape)}"
        )
