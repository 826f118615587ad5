"""Outputs at prompt positions: pooled vectors (embeddings) and prompt logprobs.

A generation step needs one hidden row per request (its last token's). Two kinds of request
need more of the prompt, and both must work across chunked prefill, where a prompt is
computed over several steps:

- a pooling request needs the final-norm hidden states of its prompt (the last one, the
  first one, or all of them averaged). Nothing is kept but what the pooling type reads: a
  running sum for MEAN, one row for CLS, nothing for LAST; the vector leaves when the
  chunk that completes the prompt has run;
- a request with `prompt_logprobs` needs the logits of every prompt position but the last
  (position i predicts prompt token i+1). They are computed a slice of rows at a time (under
  tensor parallelism the rows join the step's gathered logit rows instead), and the
  per-chunk results, a few ids and floats per position, wait on the host until the prompt
  is complete.

Per-request state is dropped when its request finishes, and rebuilt from scratch when it
is (re)admitted (`is_new`: after a preemption the prompt is computed again from the start).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from pagemill.runtime.pooling_params import PoolingParams, PoolingType

if TYPE_CHECKING:
    from pagemill.runtime.engine.protocol import PromptLogprobsRows
    from pagemill.scheduler import ScheduledRequest

# Rows of logits turned into fp32 logprobs at once: bounds the temporary of a long chunk.
_LOGPROB_SLICE = 256


@dataclass(slots=True)
class _PoolTask:
    request_id: str
    first: int  # hidden row of the chunk's first token
    end: int  # one past its last
    start_pos: int
    num_prompt_tokens: int
    finishes: bool
    params: PoolingParams


@dataclass(slots=True)
class _LogprobTask:
    request_id: str
    num_rows: int  # logit rows this step (prompt positions start .. start + num_rows - 1)
    targets: list[int]  # the prompt token each row predicts
    num_top: int
    finishes: bool


@dataclass(slots=True)
class PromptWork:
    """A step's prompt-position outputs: what the forward must keep and for whom."""

    logit_rows: list[int] = field(default_factory=list)  # in `logprobs` task order
    pool: list[_PoolTask] = field(default_factory=list)
    logprobs: list[_LogprobTask] = field(default_factory=list)


def wants_prompt_outputs(s: ScheduledRequest) -> bool:
    """Whether this share of a step computes prompt positions someone asked outputs for.

    Cheap for the common case: a decode step's start lies past the prompt.
    """
    request = s.request
    if s.start_pos >= request.num_prompt_tokens:
        return False
    if request.pooling_params is not None:
        return True
    # A request recomputed after a preemption already delivered its prompt logprobs.
    return (
        getattr(request.sampling_params, "prompt_logprobs", None) is not None
        and request.num_output_tokens == 0
    )


class PromptOutputs:
    """The runner's per-request state for pooling and prompt logprobs, across chunks."""

    def __init__(self) -> None:
        self._pooled_partial: dict[str, torch.Tensor] = {}
        self._logprob_parts: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    def forget(self, request_id: str) -> None:
        self._pooled_partial.pop(request_id, None)
        self._logprob_parts.pop(request_id, None)

    def plan(
        self, scheduled: Sequence[ScheduledRequest], which: Sequence[int], qsl: np.ndarray
    ) -> PromptWork:
        """The step's tasks for `scheduled[i]`, i in `which` (see `wants_prompt_outputs`);
        `qsl` is the step's query_start_loc (each request's first hidden row)."""
        work = PromptWork()
        for i in which:
            s = scheduled[i]
            request = s.request
            rid = s.request_id
            if s.is_new:
                self.forget(rid)
            num_prompt = request.num_prompt_tokens
            end = s.start_pos + s.num_tokens
            first = int(qsl[i])
            params = request.pooling_params
            if params is not None:
                assert isinstance(params, PoolingParams)
                work.pool.append(
                    _PoolTask(
                        rid,
                        first,
                        int(qsl[i + 1]),
                        s.start_pos,
                        num_prompt,
                        end >= num_prompt,
                        params,
                    )
                )
                continue
            stop = min(end, num_prompt - 1)
            n = max(0, stop - s.start_pos)
            work.logit_rows.extend(range(first, first + n))
            work.logprobs.append(
                _LogprobTask(
                    rid,
                    n,
                    request.all_token_ids[s.start_pos + 1 : stop + 1],
                    int(request.sampling_params.prompt_logprobs),  # type: ignore[attr-defined]
                    end >= num_prompt,
                )
            )
        return work

    def pool(self, hidden: torch.Tensor, work: PromptWork) -> dict[str, list[float]]:
        """Fold this step's hidden rows into each pooling request; the finished vectors."""
        done: dict[str, list[float]] = {}
        for task in work.pool:
            rid = task.request_id
            kind = task.params.resolved_type
            rows = hidden[task.first : task.end]
            if kind is PoolingType.MEAN:
                total = rows.float().sum(0)
                partial = self._pooled_partial.get(rid)
                self._pooled_partial[rid] = total if partial is None else partial + total
            elif kind is PoolingType.CLS and task.start_pos == 0:
                self._pooled_partial[rid] = rows[0].float().clone()
            if not task.finishes:
                continue
            if kind is PoolingType.LAST:
                vector = rows[-1].float()
            else:
                vector = self._pooled_partial.pop(rid)
                if kind is PoolingType.MEAN:
                    vector = vector / task.num_prompt_tokens
            done[rid] = finish_vector(vector, task.params).tolist()
        return done

    def prompt_logprobs(
        self, logits_of: Callable[[int, int], torch.Tensor], work: PromptWork
    ) -> dict[str, PromptLogprobsRows]:
        """Logprobs of the prompt tokens; `logits_of(lo, hi)` gives the logits of
        `work.logit_rows[lo:hi]`, asked for a slice at a time. Returns the requests whose
        prompt completed this step."""
        done: dict[str, PromptLogprobsRows] = {}
        offset = 0
        for task in work.logprobs:
            rid = task.request_id
            parts = self._logprob_parts.setdefault(rid, [])
            for lo in range(0, task.num_rows, _LOGPROB_SLICE):
                hi = min(task.num_rows, lo + _LOGPROB_SLICE)
                rows = logits_of(offset + lo, offset + hi)
                parts.append(_logprob_rows(rows, task.targets[lo:hi], task.num_top))
            offset += task.num_rows
            if task.finishes:
                parts = self._logprob_parts.pop(rid)
                if parts:
                    ids = torch.cat([p[0] for p in parts]).tolist()
                    values = torch.cat([p[1] for p in parts]).tolist()
                    ranks = torch.cat([p[2] for p in parts]).tolist()
                else:  # a one-token prompt: no position has a logprob
                    ids, values, ranks = [], [], []
                done[rid] = (ids, values, ranks)
        return done


def _logprob_rows(
    logits: torch.Tensor, targets: list[int], num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[target, top-1, ...] ids, their logprobs (raw model logprobs, as vLLM's default
    `raw_logprobs`: before any sampling option) and the target's rank, on the host."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target = torch.tensor(targets, dtype=torch.int64, device=logits.device).unsqueeze(1)
    actual = logprobs.gather(1, target)
    rank = (logprobs > actual).sum(dim=-1) + 1
    if num_top:
        top = logprobs.topk(num_top, dim=-1)
        ids = torch.cat([target, top.indices], dim=1)
        values = torch.cat([actual, top.values], dim=1)
    else:
        ids, values = target, actual
    return ids.cpu(), values.cpu(), rank.cpu()


def finish_vector(vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """Matryoshka truncation (`dimensions`), then L2 normalization when asked for."""
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = F.normalize(vector, p=2, dim=-1)
    return vector
