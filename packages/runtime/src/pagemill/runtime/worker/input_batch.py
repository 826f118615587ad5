"""The persistent batch: one row per running request, kept across steps.

Between two steps the batch barely changes: most requests decode one more token, a few
finish, a few arrive. So the model runner keeps each running request's block table and
sampling parameters in preallocated arrays, row by row, and a step only writes what
changed: new block ids at the end of a row, a row for an admitted request, a row removed
for a finished or preempted one. The sampling metadata of the whole batch is built once
per change of composition and reused by every step in between, by the one builder
(`SamplingColumns` rows written at admission, `SamplingMetadata.build`).

The block table here is a mirror for the device, not an owner: the KV cache manager holds
each request's table, and a row is written from the scheduler output's `new_block_ids`
only (the whole table when a request is (re)admitted, appended blocks otherwise). Under a
sliding window shared by every layer, the entries no query can read any more are turned
into block 0 here too (`drop_blocks_before`): the KV cache manager may have given those
blocks to another request, and a path that gathers and masks them should read the
never-written null block, not someone else's KV.

With KV cache groups (a model mixing full-attention and windowed layers) a row has one
table per group (`group_tables`, group 0's is `block_table`), all of one length, written
from `ScheduledRequest.group_block_ids`; each windowed group's entries are dropped by its
own window.

Rows stay in admission order (a removed row is closed up, not swapped with the last one),
which is the scheduler's order too: in the common step that schedules every running
request, the flattened batch and the sampling rows are plain prefixes of these arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagemill.runtime.sample.sampling_metadata import (
    SamplingColumns,
    SamplingMetadata,
    TokenHistory,
)
from pagemill.runtime.sampling_params import SamplingParams
from pagemill.scheduler import Request


@dataclass(slots=True)
class CachedRequestState:
    """What the runner keeps of a live request, across preemptions, until it finishes.

    The seeded generator lives here and not in the row: a preempted request gets a new
    row when it comes back, but must continue its random stream, not restart it.
    """

    request: Request
    params: SamplingParams
    generator: torch.Generator | None
    # Ids that cannot be sampled before min_tokens: the stop ids, and EOS unless ignored.
    banned_until_min: frozenset[int]
    # With a penalty: the views the metadata gets every time (the history is bound to
    # them) and the request's token history, which survives every rebuild of the batch's
    # metadata, so a step appends one token to it instead of re-reading the whole history.
    prompt_view: Sequence[int] | None = None
    output_view: Sequence[int] | None = None
    history: TokenHistory | None = None

    @classmethod
    def create(cls, request: Request, device: torch.device) -> CachedRequestState:
        params = request.sampling_params
        if not isinstance(params, SamplingParams):
            params = SamplingParams()
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=device)
            gen.manual_seed(params.seed)
        banned = set(request.stop_token_ids)
        if request.eos_token_id is not None and not request.ignore_eos:
            banned.add(request.eos_token_id)
        state = cls(request, params, gen, frozenset(banned))
        if (
            params.repetition_penalty != 1.0
            or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0
        ):
            state.prompt_view = request.prompt_token_ids
            state.output_view = request.output_token_ids
            prompt = state.prompt_view if params.repetition_penalty != 1.0 else None
            state.history = TokenHistory(prompt, state.output_view)
        return state


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_blocks_per_req: int,
        device: torch.device,
        num_groups: int = 1,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_blocks_per_req = max_blocks_per_req
        self.device = device
        self.req_ids: list[str] = []
        self.states: list[CachedRequestState] = []
        self.row_of: dict[str, int] = {}
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        # Leading entries of each row already turned into block 0 (`drop_blocks_before`).
        self.num_dropped = np.zeros(max_num_reqs, dtype=np.int32)
        # Per KV cache group (group 0's are the two arrays above).
        self.group_tables = [self.block_table] + [
            np.zeros_like(self.block_table) for _ in range(num_groups - 1)
        ]
        self.group_dropped = [self.num_dropped] + [
            np.zeros_like(self.num_dropped) for _ in range(num_groups - 1)
        ]
        self.sampling_columns = SamplingColumns.empty(max_num_reqs)
        self._metadata: SamplingMetadata | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    # ------------------------------------------------------------------ composition

    def add(
        self,
        state: CachedRequestState,
        block_ids: list[int],
        group_ids: tuple[list[int], ...] | None = None,
    ) -> int:
        row = len(self.req_ids)
        if row >= self.max_num_reqs:
            raise ValueError(f"more than max_num_seqs={self.max_num_reqs} requests in the batch")
        rid = state.request.request_id
        if rid in self.row_of:
            raise ValueError(f"request {rid!r} already has a row in the batch")
        self.req_ids.append(rid)
        self.states.append(state)
        self.row_of[rid] = row
        self.num_blocks[row] = 0
        for dropped in self.group_dropped:
            dropped[row] = 0
        self.append_blocks(row, block_ids, group_ids)
        self.sampling_columns.set_row(row, state.params)
        self._metadata = None
        return row

    def append_blocks(
        self, row: int, block_ids: list[int], group_ids: tuple[list[int], ...] | None = None
    ) -> None:
        """Append to the row's table(s); `group_ids` gives every group's ids (None: the
        same `block_ids` for every group, as profiling batches do)."""
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.max_blocks_per_req:
            raise ValueError(
                f"request {self.req_ids[row]!r} would hold {end} blocks; max_model_len allows "
                f"{self.max_blocks_per_req}"
            )
        if group_ids is None:
            for table in self.group_tables:
                table[row, start:end] = block_ids
        else:
            for table, ids in zip(self.group_tables, group_ids):
                if len(ids) != end - start:
                    raise ValueError("KV cache groups' new block ids differ in length")
                table[row, start:end] = ids
        self.num_blocks[row] = end

    def truncate_blocks(self, row: int, num_blocks: int) -> None:
        """Cut the row's table(s) to `num_blocks` entries: the manager gave the tail back
        (`ScheduledRequest.num_kept_blocks`), and later blocks are appended after it."""
        if num_blocks < int(self.num_blocks[row]):
            self.num_blocks[row] = num_blocks
            for dropped in self.group_dropped:
                dropped[row] = min(int(dropped[row]), num_blocks)

    def drop_blocks_before(
        self, row: int, first_read_pos: int, block_size: int, group: int = 0
    ) -> None:
        """Point the row's blocks wholly before `first_read_pos` at block 0 (the null block
        of a sliding-window pool) in `group`'s table: no query from here on reads them."""
        dropped = self.group_dropped[group]
        end = min(first_read_pos // block_size, int(self.num_blocks[row]))
        start = int(dropped[row])
        if end > start:
            self.group_tables[group][row, start:end] = 0
            dropped[row] = end

    def remove(self, request_id: str) -> None:
        """Drop a request's row (no-op if it has none) and close the gap, keeping the order."""
        row = self.row_of.pop(request_id, None)
        if row is None:
            return
        n = len(self.req_ids)
        if row < n - 1:
            width = int(self.num_blocks[row + 1 : n].max())
            for table in self.group_tables:
                table[row : n - 1, :width] = table[row + 1 : n, :width]
            self.num_blocks[row : n - 1] = self.num_blocks[row + 1 : n]
            for dropped in self.group_dropped:
                dropped[row : n - 1] = dropped[row + 1 : n]
            self.sampling_columns.close_gap(row, n)
            for rid in self.req_ids[row + 1 :]:
                self.row_of[rid] -= 1
        del self.req_ids[row]
        del self.states[row]
        self._metadata = None

    # ------------------------------------------------------------------ sampling

    def sampling_metadata(self, rows: np.ndarray | None = None) -> SamplingMetadata:
        """Metadata of the sampled rows (None: every row, in order; built once per change)."""
        if rows is None:
            if self._metadata is None:
                self._metadata = self._build(slice(0, len(self.req_ids)), self.states)
            return self._metadata
        return self._build(rows, [self.states[i] for i in rows.tolist()])

    def _build(self, sel: slice | np.ndarray, states: list[CachedRequestState]) -> SamplingMetadata:
        return SamplingMetadata.build(
            self.sampling_columns.take(sel),
            [s.params for s in states],
            output_token_ids=[_output_of(s) for s in states],
            prompt_token_ids=[_prompt_of(s) for s in states],
            generators={i: s.generator for i, s in enumerate(states) if s.generator is not None},
            banned_until_min=[s.banned_until_min for s in states],
            device=self.device,
            token_histories=[s.history for s in states],
        )


def _output_of(state: CachedRequestState) -> Sequence[int]:
    view = state.output_view
    return state.request.output_token_ids if view is None else view


def _prompt_of(state: CachedRequestState) -> Sequence[int]:
    view = state.prompt_view
    return state.request.prompt_token_ids if view is None else view
