"""Batched LoRA: every token of a step adds its own adapter's low-rank delta.

One step serves requests of several adapters and of the base model together (punica's
SGMV, vLLM's ``lora_shrink`` / ``lora_expand``). A layer holds every loaded adapter
stacked by slot: ``lora_a`` [L, S * R, in] (the S slices of a fused projection — q|k|v,
gate|up — one after the other along the rank, each padded to the rank R) and ``lora_b``
[L, out, S * R], block-diagonal: slice j's B fills the output rows ``slice_starts[j] :
slice_starts[j + 1]`` and the rank columns ``j * R : (j + 1) * R``, zeros elsewhere (the
adapter's scaling is folded in when it is loaded). Block-diagonal, the expand of a fused
projection is one GEMM on CPU; the zeros cost S times the expand's small FLOPs. A token's
slot comes from the model runner once per step, as `lora_segments`: the step's token
indices sorted by slot (``sorted_ids``) and where each slot's run starts (``seg_starts``
[L + 1]); base-model tokens (slot -1) sort past the last run and are never touched.

* `pagemill.kernels.lora_cpu`: the CPU path where it was built — one native call per
  projection, tokens read in place through ``sorted_ids``, B's non-zero blocks only; it
  takes fp32 stacks with B stored transposed (the runtime's CPU layout).
* `add_lora_torch`: the CPU path otherwise — per slot that has tokens one shrink and one expand
  GEMM on its contiguous rows: in place in x and y when each slot's tokens are already one
  run in token order (`lora_token_runs`), else on the adapter tokens gathered once in slot
  order and scattered back; cost follows the tokens that use an adapter, never the number
  of slots.
* `add_lora_triton`: the GPU path (`pagemill.kernels._triton.lora`) — a shrink launch
  (x @ Aᵀ into an fp32 [S, T, R] buffer) and an expand launch (buffer @ Bᵀ added to y),
  each over (token block, slice, slot) programs; programs past a slot's run exit at once.
* `add_lora`: dispatch by device and layout; ``torch.ops.pagemill.add_lora`` is the same as
  an opaque op that updates ``y`` in place, for compiled graphs (the per-slot loop depends on
  the step's mapping, which a graph cannot specialise on).
"""

from __future__ import annotations

import torch

from pagemill.kernels import lora_cpu
from pagemill.kernels._dispatch import (
    cdiv,
    check_triton_device,
    interpreting,
    lazy_kernels,
    next_pow2,
    use_triton,
)

_kernels = lazy_kernels("lora")


def lora_segments(token_slots: torch.Tensor, max_loras: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T] slot per token (-1: the base model) -> (sorted_ids int32 [T], seg_starts int32
    [max_loras + 1]): token indices ordered by slot (stable), and the start of each slot's
    run (slot s owns ``sorted_ids[seg_starts[s] : seg_starts[s + 1]]``). No host sync."""
    slots = token_slots.to(torch.int64)
    keyed = torch.where(slots < 0, max_loras, slots)  # base tokens sort last
    counts = torch.zeros(max_loras + 1, dtype=torch.int64, device=slots.device)
    counts.scatter_add_(0, keyed, torch.ones_like(keyed))
    seg = torch.zeros(max_loras + 1, dtype=torch.int64, device=slots.device)
    torch.cumsum(counts[:max_loras], 0, out=seg[1:])
    order = torch.argsort(keyed, stable=True)
    return order.to(torch.int32), seg.to(torch.int32)


def lora_token_runs(token_slots: torch.Tensor, max_loras: int) -> torch.Tensor:
    """[T] slot per token -> int32 [max_loras + 1]: entry s is the first token of slot s,
    and the last entry is 1 when every slot's tokens are one contiguous run in token order
    (requests of one adapter scheduled side by side, as a batch of decodes usually is).
    Then the CPU path reads and writes each slot's rows in place, with no gather or scatter
    (`add_lora_torch`). No host sync."""
    slots = token_slots.to(torch.int64)
    t = slots.numel()
    out = torch.zeros(max_loras + 1, dtype=torch.int64, device=slots.device)
    if t == 0:
        out[max_loras] = 1
        return out.to(torch.int32)
    pos = torch.arange(t, device=slots.device)
    keyed = torch.where(slots < 0, max_loras, slots)
    first = torch.full((max_loras + 1,), t, dtype=torch.int64, device=slots.device)
    first.scatter_reduce_(0, keyed, pos, reduce="amin")
    last = torch.full((max_loras + 1,), -1, dtype=torch.int64, device=slots.device)
    last.scatter_reduce_(0, keyed, pos, reduce="amax")
    counts = torch.zeros(max_loras + 1, dtype=torch.int64, device=slots.device)
    counts.scatter_add_(0, keyed, torch.ones_like(keyed))
    used = counts[:max_loras] > 0
    span = last[:max_loras] - first[:max_loras] + 1
    out[:max_loras] = torch.where(used, first[:max_loras], 0)
    out[max_loras] = torch.all(~used | (span == counts[:max_loras])).to(torch.int64)
    return out.to(torch.int32)


def _check(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slice_starts: torch.Tensor,
) -> tuple[int, int]:
    if x.dim() != 2 or y.dim() != 2 or lora_a.dim() != 3 or lora_b.dim() != 3:
        raise ValueError(
            "add_lora takes y [T, out], x [T, in], lora_a [L, S*R, in], lora_b [L, out, S*R]"
        )
    slots, sr, k = lora_a.shape
    s = slice_starts.numel() - 1
    r = sr // max(s, 1)
    if (
        x.shape[1] != k
        or y.shape[0] != x.shape[0]
        or tuple(lora_b.shape) != (slots, y.shape[1], sr)
        or s < 1
        or sr != s * r
    ):
        raise ValueError(
            f"add_lora shapes disagree: y {tuple(y.shape)}, x {tuple(x.shape)}, lora_a "
            f"{tuple(lora_a.shape)}, lora_b {tuple(lora_b.shape)}, {s} slice(s)"
        )
    return s, r


def add_lora_torch(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    sorted_ids: torch.Tensor,
    seg_starts: torch.Tensor,
    slice_starts: torch.Tensor,
    token_starts: torch.Tensor | None = None,
) -> None:
    """``y[t] += (x[t] @ A[slot(t)]ᵀ) @ B[slot(t)]ᵀ``, in place; base tokens unchanged.

    When ``token_starts`` (`lora_token_runs`) says every slot's tokens are one run in token
    order, each slot's rows of x and y are read and written where they lie: a shrink GEMM
    and an expand GEMM accumulated into y's rows (``addmm_``), nothing gathered, scattered
    or allocated beyond the small rank-wide product. Otherwise the adapter tokens are
    gathered once in slot order and the delta lands with a gather, an add and an
    `index_copy_` (a token has one slot, so the rows are distinct; a 16-bit `index_add_`
    is a slow scatter on CPU). The GEMMs run in the stacks' dtype (x's rows cast to it
    when they differ)."""
    _check(y, x, lora_a, lora_b, slice_starts)
    bounds = seg_starts.tolist()
    n = bounds[-1]
    if n == 0:
        return
    if token_starts is not None:
        firsts = token_starts.tolist()
        if firsts[-1]:
            runs = [
                (firsts[s], firsts[s] + bounds[s + 1] - bounds[s], s)
                for s in range(lora_a.shape[0])
                if bounds[s + 1] > bounds[s]
            ]
            if x.dtype == lora_a.dtype == y.dtype:
                for lo, hi, slot in runs:
                    y[lo:hi].addmm_(torch.mm(x[lo:hi], lora_a[slot].t()), lora_b[slot].t())
                return
            # One cast of the rows the runs span (base rows between them ride along), and
            # each delta added into y's rows with the cast back folded into the add.
            first = min(lo for lo, _, _ in runs)
            xs = x[first : max(hi for _, hi, _ in runs)].to(lora_a.dtype)
            for lo, hi, slot in runs:
                h = torch.mm(xs[lo - first : hi - first], lora_a[slot].t())
                y[lo:hi].add_(torch.mm(h, lora_b[slot].t()))
            return
    ids = sorted_ids[:n].to(torch.int64)
    xs = x.index_select(0, ids).to(lora_a.dtype)
    delta = torch.empty(n, y.shape[1], dtype=lora_a.dtype, device=x.device)
    for slot in range(lora_a.shape[0]):
        lo, hi = bounds[slot], bounds[slot + 1]
        if hi > lo:  # contiguous rows: the GEMMs read and write them in place
            h = torch.mm(xs[lo:hi], lora_a[slot].t())
            torch.mm(h, lora_b[slot].t(), out=delta[lo:hi])
    y.index_copy_(0, ids, y.index_select(0, ids) + delta.to(y.dtype))


def add_lora_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    sorted_ids: torch.Tensor,
    seg_starts: torch.Tensor,
    slice_starts: torch.Tensor,
    max_slice: int | None = None,
) -> None:
    """The shrink and expand kernels; same contract as `add_lora_torch`. ``max_slice`` (the
    widest slice's columns) sizes the expand grid; derived from ``slice_starts`` when None
    (a host read: layers pass it)."""
    num_slices, r = _check(y, x, lora_a, lora_b, slice_starts)
    check_triton_device(y, x, lora_a, lora_b)
    t, k = x.shape
    slots = lora_a.shape[0]
    if t == 0:
        return
    if max_slice is None:
        max_slice = int((slice_starts[1:] - slice_starts[:-1]).max())
    dot_fp32 = interpreting() or x.dtype == torch.float32
    buf = torch.empty(num_slices, t, r, dtype=torch.float32, device=x.device)
    block_m = 16 if t <= 64 else 64
    # Shrink: rank columns in tiles of up to 64 (one tile for the usual ranks), K walked in
    # tiles; expand: the rank walked in tiles. fp32 (CUDA-core ieee dots, operands in
    # registers) takes smaller tiles, checked ahead of time: tests/aot_compile.
    block_r = min(max(16, next_pow2(r)), 32 if dot_fp32 else 64)
    block_k = 32 if dot_fp32 else 64
    grid_r = cdiv(r, block_r)
    _kernels.lora_shrink_kernel[(cdiv(t, block_m) * grid_r, num_slices, slots)](
        x,
        lora_a,
        buf,
        sorted_ids,
        seg_starts,
        k,
        r,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        buf.stride(0),
        buf.stride(1),
        DOT_FP32=dot_fp32,
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        num_warps=4,
    )
    block_n = 32 if dot_fp32 else 64
    block_r = 16 if dot_fp32 else block_r
    _kernels.lora_expand_kernel[(cdiv(t, block_m) * cdiv(max_slice, block_n), num_slices, slots)](
        buf,
        lora_b,
        y,
        sorted_ids,
        seg_starts,
        slice_starts,
        r,
        max_slice,
        buf.stride(0),
        buf.stride(1),
        lora_b.stride(0),
        lora_b.stride(1),
        y.stride(0),
        DOT_FP32=dot_fp32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        num_warps=4,
    )


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    sorted_ids: torch.Tensor,
    seg_starts: torch.Tensor,
    slice_starts: torch.Tensor,
    max_slice: int = 0,
    token_starts: torch.Tensor | None = None,
) -> None:
    """Add each token's adapter delta to y in place (Triton on CUDA, torch elsewhere);
    ``max_slice`` (the widest slice, 0: read from ``slice_starts``) spares the GPU path a
    host read; ``token_starts`` (`lora_token_runs`, CPU path only) lets contiguous runs
    skip the gather and scatter."""
    if use_triton(x):
        add_lora_triton(
            y, x, lora_a, lora_b, sorted_ids, seg_starts, slice_starts, max_slice or None
        )
        return
    lib = lora_cpu.load() if lora_cpu.use_native and x.device.type == "cpu" else None
    if lib is not None and lora_cpu.supports(
        y, x, lora_a, lora_b, sorted_ids, seg_starts, slice_starts
    ):
        num_slices, rank = _check(y, x, lora_a, lora_b, slice_starts)
        lora_cpu.add_lora_native(
            lib, y, x, lora_a, lora_b, sorted_ids, seg_starts, slice_starts, num_slices, rank
        )
        return
    add_lora_torch(y, x, lora_a, lora_b, sorted_ids, seg_starts, slice_starts, token_starts)


# A plain library op rather than `torch.library.custom_op`: a compiled step calls it once per
# adapted projection, and custom_op's Python wrapper costs several times the dispatch.
_LIB = torch.library.Library("pagemill", "FRAGMENT")
_LIB.define(
    "add_lora(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor sorted_ids, "
    "Tensor seg_starts, Tensor slice_starts, int max_slice=0, Tensor? token_starts=None) -> ()"
)
_LIB.impl("add_lora", add_lora, "CompositeExplicitAutograd")


def _add_lora_fake(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    sorted_ids: torch.Tensor,
    seg_starts: torch.Tensor,
    slice_starts: torch.Tensor,
    max_slice: int = 0,
    token_starts: torch.Tensor | None = None,
) -> None:
    return None


torch.library.register_fake("pagemill::add_lora", _add_lora_fake, lib=_LIB)
