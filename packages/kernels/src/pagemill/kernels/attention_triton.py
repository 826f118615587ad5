"""The Triton paged-attention planner and launcher (the kernels are in `_triton.attention`).

`plan_triton` turns the step's shapes into launch parameters (grid, tile sizes, warps,
context splits and the split workspace) once; `run_triton` launches with them for each
layer. The grid is sized from shapes alone, so neither planning nor launching syncs with
the device. Nothing here imports Triton: the kernels module is imported at the first launch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagemill.kernels._dispatch import cdiv, interpreting, lazy_kernels, next_pow2
from pagemill.kernels.kv_quant import is_quantized_kv

_kernels = lazy_kernels("attention")


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
    num_warps: int
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

    What this planner chooses is compiled ahead of time for sm_80 and sm_90 for every dtype,
    head size and GQA group it serves (shared memory within the target's limit, no register
    spills in the 16-bit configurations): tests/test_aot_compile.py.
    """
    _, block_size, num_kv_heads, head_dim = k_cache_shape
    group = num_heads // num_kv_heads
    group_pad = next_pow2(group)
    decode_only = num_tokens == num_seqs
    interp = interpreting()
    dot_fp32 = interp or dtype == torch.float32
    d_pad = max(16, next_pow2(head_dim))
    # Tiles, checked ahead of time for sm_80 and sm_90 (tests/test_aot_compile.py): 16-bit
    # inputs take tensor-core tiles (BLOCK_M 64 for prefill); fp32 runs its dots on the CUDA
    # cores (ieee), whose operands live in registers, so its tiles are smaller. The
    # interpreter gets small tiles. Warps: see below.
    if block_m is None:
        block_m = 16 if decode_only or dot_fp32 else 64
    block_m = max(next_pow2(block_m), group_pad, 16)
    block_q = 1 if decode_only else block_m // group_pad
    if block_n is None:
        if interp:
            block_n = 32
        elif dot_fp32:
            block_n = 32 if d_pad <= 64 else 16
        else:
            block_n = 64 if d_pad <= 128 else 32
    block_n = max(16, next_pow2(block_n))
    capacity = max(1, table_width * block_size)  # host-side bound on any context: no sync
    if num_splits is None:
        num_splits = (
            _default_splits(device, num_seqs * num_kv_heads, capacity) if decode_only else 1
        )
    if num_splits > 1 and not decode_only:
        raise ValueError("split-context attention is for decode-only batches")
    # Slices are whole KV tiles; rounding up may leave fewer slices than asked.
    split_len = cdiv(cdiv(capacity, max(1, num_splits)), block_n) * block_n
    num_splits = cdiv(capacity, split_len)
    # Warps: 4, or 8 where a tile's per-thread registers (fp32 accumulator and scores, and
    # for fp32 also the Q/K/V dot operands) make ptxas spill with 4 on sm_80 or sm_90 (the
    # AOT test fails on any spill). 16-bit: every 64-row prefill tile, head size 64 included
    # (its 64 x 64 accumulator is at the edge and spills on sm_80); decode tiles (BLOCK_M
    # 16) keep 4. fp32: head size 128 and up (hd128 prefill spills on sm_80), decode too:
    # one rule per head size, and 8 warps halve each thread's share of the dot operands.
    num_warps = 8 if (d_pad >= 128 if dot_fp32 else block_m >= 64) else 4
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
        dot_fp32=dot_fp32,
        num_splits=num_splits,
        split_len=split_len,
        num_warps=num_warps,
        part_acc=part_acc,
        part_ml=part_ml,
    )


_SM_COUNT: dict[int, int] = {}


def split_count(sm_count: int, programs: int, capacity: int) -> int:
    """Context slices for a decode batch: about two programs per SM, each slice >= 512
    positions, at most 32. ``programs`` is requests x KV heads; ``capacity`` the longest
    context the block tables can hold."""
    want = -(-2 * sm_count // max(1, programs))
    return max(1, min(want, capacity // 512, 32))


def _default_splits(device: torch.device, programs: int, capacity: int) -> int:
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return split_count(_SM_COUNT[index], programs, capacity)


def _quantized_block_n(plan: TritonPlan, kv_dtype: torch.dtype) -> int:
    """Keys per tile over an 8-bit cache (see the launch in `run_triton`)."""
    if kv_dtype == torch.int8 and plan.d_pad <= 64:
        return max(16, plan.block_n // 4)
    return max(16, plan.block_n // 2)


def _kv_scales(
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    num_kv_heads: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """K and V scales with their shared stride over KV heads (0: one per layer, 1: one per
    head; a per-layer scale beside a per-head one is repeated, a rare mix)."""
    if k_scale is None or v_scale is None:
        one = torch.ones((), dtype=torch.float32, device=device)
        k_scale = one if k_scale is None else k_scale
        v_scale = one if v_scale is None else v_scale
    if k_scale.dim() == v_scale.dim():
        return k_scale, v_scale, int(k_scale.dim())
    return k_scale.expand(num_kv_heads).contiguous(), v_scale.expand(num_kv_heads).contiguous(), 1


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
    window: int = 0,
    softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One layer's attention: the planned launch (plus the merge of context splits).

    ``window``, ``softcap`` and ``sinks`` are the layer's (see `paged_attention`): the
    window is a runtime argument of the one kernel, soft-capping and sinks compiled
    variants.
    """
    if q.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("q and out need a contiguous last (head_dim) axis")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache need a contiguous last (head_dim) axis")
    fp8 = is_quantized_kv(k_cache.dtype)  # fp8 or int8 codes, read as bytes
    scale_stride = 0
    if fp8:
        k_scale, v_scale, scale_stride = _kv_scales(k_scale, v_scale, k_cache.shape[2], q.device)
    split = plan.num_splits > 1
    part_acc = plan.part_acc if split else out  # unused without splits
    part_ml = plan.part_ml if split else out
    _kernels.paged_attention_kernel[plan.grid](
        q,
        k_cache.view(torch.uint8) if fp8 else k_cache,
        v_cache.view(torch.uint8) if fp8 else v_cache,
        out,
        block_tables,
        query_start_loc,
        seq_lens,
        part_acc,
        part_ml,
        float(scale) * math.log2(math.e),
        k_scale if fp8 else out,  # unused without fp8
        v_scale if fp8 else out,
        scale_stride,
        float(softcap) if softcap > 0 else 1.0,
        out if sinks is None else sinks,  # unused without sinks
        int(window),
        block_tables.shape[0],
        plan.split_len,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        BLOCK_SIZE=plan.block_size,
        GROUP=plan.group,
        GROUP_PAD=plan.group_pad,
        BLOCK_Q=plan.block_q,
        BLOCK_M=plan.block_m,
        # The byte decode of an fp8 cache adds registers per key: half the keys per tile
        # (still a divisor of split_len), and 8 warps from head size 128 up, keep ptxas
        # from spilling on sm_80 and sm_90 (the AOT test, full grid). int8's decode costs
        # a little more: at head size 64 under bf16 it takes a quarter of the keys.
        BLOCK_N=_quantized_block_n(plan, k_cache.dtype) if fp8 else plan.block_n,
        HEAD_DIM=plan.head_dim,
        D_PAD=plan.d_pad,
        DOT_FP32=plan.dot_fp32,
        SPLIT=split,
        SOFTCAP=softcap > 0,
        SINKS=sinks is not None,
        FP8=fp8,
        E4M3=k_cache.dtype == torch.float8_e4m3fn,
        INT8=k_cache.dtype == torch.int8,
        num_warps=max(plan.num_warps, 8) if fp8 and plan.d_pad > 64 else plan.num_warps,
    )
    if split:
        _kernels.merge_splits_kernel[(q.shape[0], q.shape[1])](
            part_acc,
            part_ml,
            out,
            out.stride(0),
            out.stride(1),
            plan.num_splits,
            NUM_HEADS=q.shape[1],
            SPLITS_PAD=next_pow2(plan.num_splits),
            HEAD_DIM=plan.head_dim,
            D_PAD=plan.d_pad,
        )
    return out
