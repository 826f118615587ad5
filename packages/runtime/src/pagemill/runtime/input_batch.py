"""The persistent batch: one row per running request, kept across steps.

Between two steps the batch barely changes: most requests decode one more token, a few
finish, a few arrive. So the model runner keeps each running request's block table and
sampling parameters in preallocated arrays, row by row, and a step only writes what
changed: new block ids at the end of a row, a row for an admitted request, a row removed
for a finished or preempted one. The sampling metadata of the whole batch is built once
per change of composition and reused by every step in between.

Rows stay in admission order (a removed row is closed up, not swapped with the last one),
which is the scheduler's order too: in the common step that schedules every running
request, the flattened batch and the sampling rows are plain prefixes of these arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagemill.scheduler import Request

from .sampling_metadata import LogitBias, SamplingMetadata
from .sampling_params import SamplingParams

_SAMPLING_ARRAYS = ("temperature", "greedy", "top_p", "top_k", "min_p", "presence",
                    "frequency", "repetition", "num_logprobs")


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
        return cls(request, params, gen, frozenset(banned))


class InputBatch:
    def __init__(self, max_num_reqs: int, max_blocks_per_req: int, device: torch.device) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_blocks_per_req = max_blocks_per_req
        self.device = device
        self.req_ids: list[str] = []
        self.states: list[CachedRequestState] = []
        self.row_of: dict[str, int] = {}
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        self.temperature = np.ones(max_num_reqs, dtype=np.float32)
        self.greedy = np.zeros(max_num_reqs, dtype=np.bool_)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition = np.ones(max_num_reqs, dtype=np.float32)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)  # -1: none asked
        self._metadata: SamplingMetadata | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    # ------------------------------------------------------------------ composition

    def add(self, state: CachedRequestState, block_ids: list[int]) -> int:
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
        self.append_blocks(row, block_ids)
        p = state.params
        greedy = p.is_greedy
        self.greedy[row] = greedy
        self.temperature[row] = 1.0 if greedy else p.temperature
        self.top_p[row] = p.top_p
        self.top_k[row] = p.top_k
        self.min_p[row] = p.min_p
        self.presence[row] = p.presence_penalty
        self.frequency[row] = p.frequency_penalty
        self.repetition[row] = p.repetition_penalty
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self._metadata = None
        return row

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.max_blocks_per_req:
            raise ValueError(
                f"request {self.req_ids[row]!r} would hold {end} blocks; max_model_len allows "
                f"{self.max_blocks_per_req}"
            )
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def remove(self, request_id: str) -> None:
        """Drop a request's row (no-op if it has none) and close the gap, keeping the order."""
        row = self.row_of.pop(request_id, None)
        if row is None:
            return
        n = len(self.req_ids)
        if row < n - 1:
            width = int(self.num_blocks[row + 1 : n].max())
            self.block_table[row : n - 1, :width] = self.block_table[row + 1 : n, :width]
            for name in ("num_blocks", *_SAMPLING_ARRAYS):
                a = getattr(self, name)
                a[row : n - 1] = a[row + 1 : n]
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
                self._metadata = self._build(slice(0, len(self.req_ids)),
                                             self.states)
            return self._metadata
        return self._build(rows, [self.states[i] for i in rows.tolist()])

    def _build(self, sel: slice | np.ndarray, states: list[CachedRequestState]) -> SamplingMetadata:
        dev = self.device

        def tensor(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a[sel])).to(dev)

        greedy = self.greedy[sel]
        all_greedy = bool(greedy.all())
        all_random = not greedy.any()
        top_p = self.top_p[sel]
        top_k = self.top_k[sel]
        min_p = self.min_p[sel]
        presence, frequency = self.presence[sel], self.frequency[sel]
        repetition = self.repetition[sel]
        use_rep = bool((repetition != 1.0).any())
        no_penalties = not (use_rep or presence.any() or frequency.any())
        num_logprobs = int(self.num_logprobs[sel].max(initial=-1))
        generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        min_tokens = {i: (s.params.min_tokens, s.banned_until_min)
                      for i, s in enumerate(states) if s.params.min_tokens > 0}
        return SamplingMetadata(
            temperature=tensor(self.temperature),
            greedy=None if all_greedy or all_random else tensor(self.greedy),
            all_greedy=all_greedy,
            all_random=all_random,
            top_p=tensor(self.top_p) if bool((top_p < 1.0).any()) else None,
            top_k=tensor(self.top_k) if bool(top_k.any()) else None,
            min_p=tensor(self.min_p) if bool(min_p.any()) else None,
            max_top_k=int(top_k.max(initial=0)),
            generators=generators,
            no_penalties=no_penalties,
            presence_penalties=tensor(self.presence),
            frequency_penalties=tensor(self.frequency),
            repetition_penalties=tensor(self.repetition),
            prompt_token_ids=[s.request.prompt_token_ids for s in states] if use_rep else None,
            output_token_ids=[s.request.output_token_ids for s in states],
            min_tokens=min_tokens,
            max_num_logprobs=None if num_logprobs < 0 else num_logprobs,
            logit_bias=LogitBias.from_rows([s.params.logit_bias for s in states], dev),
        )
