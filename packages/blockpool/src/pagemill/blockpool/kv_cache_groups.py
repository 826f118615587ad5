"""KV cache groups: which layers share one block table, and how their memory is laid out.

A model that mixes full-attention and sliding-window layers (Gemma 2/3, gpt-oss, Cohere2)
needs every block of a long context for its full layers but only the last window's blocks
for its windowed ones. One table per request for all layers would keep the windowed layers'
old KV alive as long as the full layers need theirs. So the layers are split into groups of
one attention type, each with its own block table per request (vLLM's hybrid allocator):
the windowed groups give back what their window left behind, the full groups keep all.

Every group draws from the one block pool: a block id means "slot tensor j's block b" for
each of the `group_size` KV tensors, and group g's i-th layer reads and writes tensor i.
So a block is `group_size` layers' worth of KV wherever it goes, and the pool's memory is
shared by all groups in whatever ratio the running requests need (a static split between
full and windowed pools would have to guess that ratio: long contexts need mostly full
blocks, short ones mostly windowed). This needs groups of equal size: the layers of each
type are cut into chunks of `group_size` layers (vLLM's uniform page size); a last, shorter
chunk leaves some tensors unused by its blocks, which is the price of the shared pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One group: its model layers (in tensor order) and its window (None: full attention).

    `sliding_window` is transformers' window: a query at p reads keys p-W+1..p.
    """

    layer_ids: tuple[int, ...]
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if not self.layer_ids:
            raise ValueError("a KV cache group needs at least one layer")
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w <= 0):
            raise ValueError(f"sliding_window must be None or a positive int, got {w!r}")


def group_layers_by_window(layer_windows: Sequence[int]) -> list[KVCacheGroupSpec]:
    """Groups for a model whose layer i attends through `layer_windows[i]` keys (0: all).

    Full-attention groups come first (group 0 then holds whole prefix chains, and is the
    group KV events describe). One attention type gives one group of every layer, which
    is exactly today's single table. Several types: the group size is the fewest layers
    of any type, or the most when the counts are close (under 1.5x: fewer, larger groups
    for little padding), as vLLM's uniform-page grouping does, and each type's layers are
    cut into chunks of that size in layer order.
    """
    if not layer_windows:
        raise ValueError("a model needs at least one layer")
    by_type: dict[int, list[int]] = {}
    for layer, w in enumerate(layer_windows):
        if w < 0:
            raise ValueError(f"layer {layer} has a negative window {w}")
        by_type.setdefault(int(w), []).append(layer)
    order = sorted(by_type, key=lambda w: (w != 0, w))
    if len(order) == 1:
        (w,) = order
        return [KVCacheGroupSpec(tuple(by_type[w]), w or None)]
    sizes = [len(by_type[w]) for w in order]
    lo, hi = min(sizes), max(sizes)
    size = hi if hi < 1.5 * lo else lo
    groups = []
    for w in order:
        layers = by_type[w]
        for i in range(0, len(layers), size):
            groups.append(KVCacheGroupSpec(tuple(layers[i : i + size]), w or None))
    return groups


def group_size(groups: Sequence[KVCacheGroupSpec]) -> int:
    """KV tensors the pool needs: the largest group's layer count."""
    return max(len(g.layer_ids) for g in groups)


def layer_tensor_index(groups: Sequence[KVCacheGroupSpec], num_layers: int) -> list[int]:
    """For each model layer, the KV tensor it reads and writes (its place in its group)."""
    index = [-1] * num_layers
    for g in groups:
        for i, layer in enumerate(g.layer_ids):
            if not 0 <= layer < num_layers or index[layer] != -1:
                raise ValueError(f"layer {layer} is out of range or in two KV cache groups")
            index[layer] = i
    missing = [i for i, t in enumerate(index) if t == -1]
    if missing:
        raise ValueError(f"layers {missing} are in no KV cache group")
    return index


def layer_group(groups: Sequence[KVCacheGroupSpec], num_layers: int) -> list[int]:
    """For each model layer, the index of its group (whose block table it reads)."""
    out = [-1] * num_layers
    for gi, g in enumerate(groups):
        for layer in g.layer_ids:
            out[layer] = gi
    return out
