"""Packed CPU weights moved onto huge pages, in one mapping, after loading.

A batch-1 decode step streams every packed weight once (the int4 planes, their scales, the
Q8_0 LM head): tens to hundreds of MB read end to end per token, which is the step's floor.
Loaded tensors come from malloc (or from the weight cache's file) on 4 KB pages, where the
hardware prefetchers stop at every page boundary and the TLB misses every 64 lines; one
2 MB page covers 32,768 lines. So after loading, the packed buffers that a step reads are
copied into one anonymous mapping laid out on huge pages (`pagemill.blockpool.huge_page_zeros`)
and the modules' buffers replaced by views of it; the originals are freed. The bytes are
the same, so is every result.

Only packed buffers move: dense weights (and the dense copies kept for large batches) are
read by oneDNN GEMMs that reuse each weight across many rows, where the page size matters
little, and doubling what moves would double the transient memory of the move.

`PAGEMILL_HUGE_PAGE_WEIGHTS=0` leaves the weights where loading put them. Where the kernel
offers no transparent huge pages the mapping is ordinary pages and nothing else changes.

The mapping is also what a compiled graph reads its packed weights from (`arena_view`).
Dynamo makes every tensor a graph reads from a module a graph input, and each input costs
every call: the frame's bytecode fetches it by its attribute path, the wrapper passes it
on, the C++ wrapper converts it to a pointer. A 30-layer model's 120 packed weights were
120 of those per step, a noticeable share of a batch-1 step that is otherwise mostly
streaming. So every module that had a buffer moved also holds the mapping itself
(`packed_arena`, one tensor, which dynamo passes once however many modules reach it) and
where in it each moved buffer lies (`arena_slots`): a layer's graph slices its weight out
of the one input, a view the wrapper makes in C++.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagemill.blockpool import huge_page_bytes, huge_page_zeros
from pagemill.runtime.model_executor.gathered_params import slot_view
from pagemill.runtime.switches import env_switch

HUGE_PAGE_WEIGHTS_ENV = "PAGEMILL_HUGE_PAGE_WEIGHTS"

# The buffers a packed layer reads in full every step (`layers.linear.Linear`,
# `layers.fused_moe.FusedMoE`).
PACKED_BUFFERS = frozenset(
    {
        "qweight",
        "scales",
        "zeros",
        "scales_and_zeros",
        "w13_qweight",
        "w13_scales_zeros",
        "w2_qweight",
        "w2_scales_zeros",
    }
)

# Each tensor starts on its own cache-line pair: the kernels' vector loads assume 64-byte
# alignment at most, and the adjacent-line prefetcher fetches 128-byte pairs.
_ALIGN = 128


def huge_page_weights_enabled() -> bool:
    """`PAGEMILL_HUGE_PAGE_WEIGHTS` (0 or 1; unset: on)."""
    return env_switch(HUGE_PAGE_WEIGHTS_ENV, default=True)


@dataclass(frozen=True)
class PlacedWeights:
    """What `place_packed_weights` moved: tensors and bytes, and how many of those bytes
    the kernel backs with huge pages now (it may give fewer than asked when memory is
    fragmented)."""

    tensors: int
    nbytes: int
    huge_nbytes: int
    advised: bool

    def summary(self) -> str:
        mib = 1 << 20
        if not self.advised:
            where = "the kernel refused huge pages: ordinary pages"
        else:
            where = f"{self.huge_nbytes / mib:.0f} MiB of it on huge pages"
        size = f"{self.nbytes / mib:.0f} MiB"
        return f"{self.tensors} packed tensors ({size}) in one mapping, {where}"


def arena_view(module: nn.Module, name: str) -> torch.Tensor | None:
    """`module`'s moved uint8 buffer `name` as a slice of the mapping (`packed_arena`), or
    None when it was not moved there. The same bytes as the buffer: a compiled graph reads
    this one so that the mapping is its only input for every packed weight."""
    return slot_view(
        getattr(module, "packed_arena", None), getattr(module, "arena_slots", ()), name
    )


def _targets(model: nn.Module) -> list[tuple[nn.Module, str]]:
    found = []
    for module in model.modules():
        for name, t in module._buffers.items():
            if (
                name in PACKED_BUFFERS
                and t is not None
                and t.device.type == "cpu"
                and t.is_contiguous()
                and t.numel() > 0
            ):
                found.append((module, name))
    return found


def _key(t: torch.Tensor) -> tuple[int, torch.dtype, tuple[int, ...]]:
    return (t.data_ptr(), t.dtype, tuple(t.shape))


def place_packed_weights(model: nn.Module) -> PlacedWeights | None:
    """Copy `model`'s packed CPU buffers into one huge-page mapping and point the modules
    at it. None when there is nothing to move or it is turned off.

    Only the modules hold the originals, so each is freed as soon as its last holder points
    at the mapping: the move costs about one tensor's memory beyond the mapping, not a
    second copy of every packed weight."""
    if not huge_page_weights_enabled():
        return None
    targets = _targets(model)
    if not targets:
        return None
    # A tensor held by two modules (or twice by one) moves once and stays shared.
    offsets: dict[tuple[int, torch.dtype, tuple[int, ...]], int] = {}
    total = 0
    for module, name in targets:
        t = module._buffers[name]
        assert t is not None
        if _key(t) not in offsets:
            offsets[_key(t)] = total
            total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    del t
    raw, advised = huge_page_zeros(total)
    arena = torch.from_numpy(raw)  # the tensor keeps the mapping alive
    # Nothing below allocates tensor memory, so a freed original's address is never reused
    # by a tensor still to be moved.
    moved: dict[tuple[int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}
    for module, name in targets:
        t = module._buffers[name]
        assert t is not None
        key = _key(t)
        if key not in moved:
            start = offsets[key]
            view = arena[start : start + t.numel() * t.element_size()].view(t.dtype)
            moved[key] = view.view(t.shape).copy_(t)
        module._buffers[name] = moved[key]
        if t.dtype == torch.uint8:
            # Plain attributes, not buffers: the mapping is not the module's state.
            module.packed_arena = arena
            module.__dict__["arena_slots"] = (
                *getattr(module, "arena_slots", ()),
                (name, offsets[key], tuple(t.shape)),
            )
        del t
    return PlacedWeights(
        tensors=len(moved),
        nbytes=total,
        huge_nbytes=huge_page_bytes([raw]),
        advised=advised,
    )
