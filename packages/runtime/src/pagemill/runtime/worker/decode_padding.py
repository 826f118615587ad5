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


def verify_buckets(max_num_seqs: int, query_len: int, max_num_batched_tokens: int) -> list[int]:
    """Batch sizes that get a graph for verify steps of `query_len` tokens per request (the
    last token and k drafts): the decode buckets whose steps fit the token budget."""
    return [b for b in graph_buckets(max_num_seqs) if b * query_len <= max_num_batched_tokens]


@dataclass(frozen=True, slots=True)
class DecodeLayout:
    """Where each input of a padded step of `bucket` rows of `query_len` tokens each lies in
    one int32 array: input ids, positions, KV slots, query_start_loc, seq_lens, block
    tables (row-major). A decode step has one token per row; a speculative verify step
    (every request verifying k drafts) has k + 1."""

    bucket: int
    table_width: int
    query_len: int = 1

    @property
    def num_tokens(self) -> int:
        return self.bucket * self.query_len

    @property
    def sizes(self) -> tuple[int, int, int, int, int, int]:
        b, t = self.bucket, self.num_tokens
        return (t, t, t, b + 1, b, b * self.table_width)

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
    """A step of n <= bucket rows (`layout.query_len` tokens each) padded to the bucket.

    Returns the packed int32 array (`out` when given, reused across steps). The real rows
    come first, unchanged; the padding is described in the module docstring (a padded row
    of a verify step has `query_len` tokens and context 0: its queries see no key).
    """
    n = int(seq_lens.shape[0])
    b, width, q = layout.bucket, layout.table_width, layout.query_len
    t = n * q
    if n > b:
        raise ValueError(f"{n} rows do not fit the bucket of {b}")
    if block_tables.shape[0] != n:
        raise ValueError("a padded step has one length and table row per request")
    if not (input_ids.shape[0] == positions.shape[0] == slots.shape[0] == t):
        raise ValueError(f"a step of {n} rows of {q} token(s) has {t} ids, positions and slots")
    if block_tables.shape[1] > width:
        raise ValueError(
            f"block tables of {block_tables.shape[1]} blocks exceed the graph's {width}"
        )
    if out is None:
        out = np.empty(layout.numel, dtype=np.int32)
    o = layout.offsets()
    ids, pos, slot, qsl, lens = (out[o[i] : o[i + 1]] for i in range(5))
    tables = out[o[5] : o[6]].reshape(b, width)
    ids[:t] = input_ids
    ids[t:] = 0
    pos[:t] = positions
    pos[t:] = 0
    slot[:t] = slots
    slot[t:] = -1
    qsl[:] = np.arange(b + 1, dtype=np.int32) * q
    lens[:n] = seq_lens
    lens[n:] = 0
    tables[:] = 0
    tables[:n, : block_tables.shape[1]] = block_tables
    return out
