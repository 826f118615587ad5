"""Batch-size buckets for CUDA graphs, and a decode batch padded to its bucket.

A CUDA graph replays fixed kernels with fixed arguments over fixed buffers, so one graph
serves exactly one shape. Capturing one per batch size up to `max_num_seqs` would cost
start-up time and memory for every size; instead sizes are rounded up to a few buckets
(1, 2, 4, 8, ... and `max_num_seqs` itself) and a batch of n requests runs the graph of
the smallest bucket >= n, with the rows past n padded so they compute discarded garbage:

- input id 0 and position 0 (any valid index: embedding and rotary just read row 0);
- KV slot -1: the KV-write kernels skip negative slots, so nothing is written anywhere;
- query length 1 (`query_start_loc` keeps rising by one) and context length 0 with a
  block-table row of zeros: the attention kernel's key loop for that row is empty, so it
  reads no K/V at all and writes zeros (its normaliser of 0 is replaced by 1, no NaN);
- block tables are widened to the full `max_blocks_per_seq` (zeros past a request's own
  blocks, never read since each row's context bounds its reads), so the attention launch
  is planned once per bucket for the worst-case context (see `cuda_graphs`).

Everything here is host-side NumPy: the padded step is laid out in one int32 array, copied
to the graph's device buffer in one transfer. Pure functions, so CPU tests cover them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a graph: powers of two below `max_num_seqs`, then itself.

    At most ~2x the work of a batch is padding, and there are log2(max_num_seqs) + 1 graphs.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    buckets = []
    size = 1
    while size < max_num_seqs:
        buckets.append(size)
        size *= 2
    buckets.append(max_num_seqs)
    return buckets


def bucket_for(num_seqs: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding `num_seqs` rows (buckets ascending), None if none does."""
    for bucket in buckets:
        if bucket >= num_seqs:
            return bucket
    return None


@dataclass(frozen=True, slots=True)
class DecodeLayout:
    """Where each input of a padded decode step of `bucket` rows lies in one int32 array:
    input ids, positions, KV slots, query_start_loc, seq_lens, block tables (row-major)."""

    bucket: int
    table_width: int

    @property
    def sizes(self) -> tuple[int, int, int, int, int, int]:
        b = self.bucket
        return (b, b, b, b + 1, b, b * self.table_width)

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    def offsets(self) -> list[int]:
        """Start of each piece (and the end of the last)."""
        out = [0]
        for size in self.sizes:
            out.append(out[-1] + size)
        return out


def pad_decode(
    input_ids: np.ndarray,
    positions: np.ndarray,
    slots: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: np.ndarray,
    layout: DecodeLayout,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """A decode step of n <= bucket rows (one token each) padded to the layout's bucket.

    Returns the packed int32 array (`out` when given, reused across steps). The real rows
    come first, unchanged; the padding is described in the module docstring.
    """
    n = int(input_ids.shape[0])
    b, width = layout.bucket, layout.table_width
    if n > b:
        raise ValueError(f"{n} rows do not fit the bucket of {b}")
    if not (
        positions.shape[0] == slots.shape[0] == seq_lens.shape[0] == block_tables.shape[0] == n
    ):
        raise ValueError("a decode step has one position, slot, length and table row per token")
    if block_tables.shape[1] > width:
        raise ValueError(
            f"block tables of {block_tables.shape[1]} blocks exceed the graph's {width}"
        )
    if out is None:
        out = np.empty(layout.numel, dtype=np.int32)
    o = layout.offsets()
    ids, pos, slot, qsl, lens = (out[o[i] : o[i + 1]] for i in range(5))
    tables = out[o[5] : o[6]].reshape(b, width)
    ids[:n] = input_ids
    ids[n:] = 0
    pos[:n] = positions
    pos[n:] = 0
    slot[:n] = slots
    slot[n:] = -1
    qsl[:] = np.arange(b + 1, dtype=np.int32)
    lens[:n] = seq_lens
    lens[n:] = 0
    tables[:] = 0
    tables[:n, : block_tables.shape[1]] = block_tables
    return out
