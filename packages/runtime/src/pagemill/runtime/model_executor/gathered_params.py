"""Small per-layer parameters (the norms' weights) gathered into one tensor per dtype.

A compiled graph takes every tensor it reads from a module as an input of its own, and each
input costs every call, whatever its size: the frame's bytecode fetches it by its attribute
path, the wrapper passes it on, the C++ wrapper turns it into a pointer. A decoder has two
norms a layer, 61 inputs for a 30-layer model, each a few hundred values. Gathered into
one tensor, with each Parameter's data a view of it, the graph reads them as slices of
that one input (`gathered_view`), views its wrapper makes in C++. The packed weights get
the same from the mapping they are moved into (`huge_page_weights.arena_view`).

A module class opts in by naming its parameters in `gathered_params`; the values, and what
eager code reads (`module.weight`), are unchanged.
"""

from __future__ import annotations

import math

import torch
from torch import nn

# (name, element offset in a 1-D store, shape): where a tensor lies in the tensor it was
# moved into (a module's gathered parameters here, its packed buffers in
# `huge_page_weights`).
Slot = tuple[str, int, tuple[int, ...]]

# Each parameter starts 64 bytes into its own line: vector loads of a norm's weight stay
# aligned as they were in a tensor of its own.
_ALIGN_BYTES = 64


def gather_small_params(model: nn.Module) -> int:
    """Gather the CPU parameters named by each module class's `gathered_params` into one
    tensor per dtype, each Parameter's data a view of it. Returns how many moved."""
    groups: dict[torch.dtype, list[nn.Parameter]] = {}
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name in getattr(type(module), "gathered_params", ()):
            p = module._parameters.get(name)
            if p is None or p.device.type != "cpu" or not p.is_contiguous():
                continue
            if id(p) not in holders:  # a parameter two modules share moves once
                holders[id(p)] = []
                groups.setdefault(p.dtype, []).append(p)
            holders[id(p)].append((module, name))
    for dtype, params in groups.items():
        align = max(1, _ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += -(-p.numel() // align) * align
        store = torch.zeros(total, dtype=dtype)
        for p, offset in zip(params, offsets):
            view = store[offset : offset + p.numel()].view(p.shape)
            view.copy_(p.detach())
            p.data = view  # the same Parameter object: state_dict and sharing unchanged
            for module, name in holders[id(p)]:
                # Plain attributes, not buffers: the gathered tensor is not the module's state.
                module.gathered = store
                module.__dict__["gathered_slots"] = (
                    *getattr(module, "gathered_slots", ()),
                    (name, offset, tuple(p.shape)),
                )
    return sum(len(params) for params in groups.values())


def slot_view(
    store: torch.Tensor | None, slots: tuple[Slot, ...], name: str
) -> torch.Tensor | None:
    """The tensor `name` of `slots` ((name, element offset, shape) each) as a slice of the
    1-D `store`, or None when `store` is None or `name` has no slot."""
    if store is None:
        return None
    for slot, offset, shape in slots:
        if slot == name:
            return store[offset : offset + math.prod(shape)].view(shape)
    return None


def gathered_view(module: nn.Module, name: str) -> torch.Tensor | None:
    """`module`'s gathered parameter `name` as a slice of the gathered tensor, or None when
    it was not gathered: what a compiled graph reads instead of the parameter itself."""
    return slot_view(getattr(module, "gathered", None), getattr(module, "gathered_slots", ()), name)
