"""From engine-core updates to what callers see: text, stop strings, n > 1, logprobs, metrics.

The engine core speaks token ids only (`EngineCoreOutputs`). Everything that needs the
tokenizer or the caller's view of a request lives here, in the front end: incremental
detokenization and stop strings (the one rule that needs text: a match sends an abort with
reason STOP back to the core), gathering the `n` completions of a request back into one
output, logprobs as `{token_id: logprob}` entries, the one mapping of finish reasons to the
API's words, timestamps and the per-step statistics the server turns into Prometheus
metrics. It is driven from one thread at a time (the caller's, or the front end's output
thread under its lock).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagemill.runtime.engine.detokenizer import IncrementalDetokenizer
from pagemill.runtime.engine.protocol import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    PromptLogprobsRows,
)
from pagemill.runtime.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
)
from pagemill.runtime.sample.structured_output import is_grammar_failure
from pagemill.runtime.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

# Per sampled request: ([sampled id, top-1 id, ...], [their logprobs]).
LogprobsRow = tuple[Sequence[int], Sequence[float]]


@dataclass(frozen=True, slots=True)
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    queue_time: float | None
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass(slots=True)
class IterationStats:
    """What one step changed, as increments: Prometheus counters and histograms take them."""

    num_prompt_tokens: int = 0  # prompts whose first token came out in this step
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


AnyRequestOutput = RequestOutput | EmbeddingRequestOutput


@dataclass(slots=True)
class ProcessedOutputs:
    request_outputs: list[AnyRequestOutput]
    # Completions a stop string ended: the engine core must still free their blocks
    # (an abort with reason STOP).
    reqs_to_finish: list[str]
    stats: IterationStats


class _Completion:
    """One of a request's `n` completions: its detokenizer, logprobs and finish state."""

    __slots__ = (
        "cumulative_logprob",
        "detokenizer",
        "finish_reason",
        "index",
        "last_token_time",
        "logprobs",
        "num_logprobs",
        "params",
        "parent",
        "request_id",
        "stop_reason",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        index: int,
        parent: _Parent,
        params: SamplingParams,
        detokenizer: IncrementalDetokenizer | None,
    ) -> None:
        self.request_id = request_id
        # The caller's copy of the completion (the core keeps its own on its side of the
        # boundary): what FINAL_ONLY and CUMULATIVE outputs carry.
        self.token_ids: list[int] = []
        self.index = index
        self.parent = parent
        self.params = params
        self.detokenizer = detokenizer
        self.num_logprobs = params.logprobs
        # Kept whole only when an output will carry the whole list (not for DELTA streams).
        self.logprobs: list[dict[int, float]] | None = (
            [] if params.logprobs is not None and parent.kind != RequestOutputKind.DELTA else None
        )
        self.cumulative_logprob: float | None = None if params.logprobs is None else 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.last_token_time: float | None = None

    def text_delta(self) -> str:
        d = self.detokenizer
        return "" if d is None else d.get_delta(finished=self.finish_reason is not None)

    def whole(self) -> CompletionOutput:
        """The cumulative view: built only for FINAL_ONLY and CUMULATIVE outputs."""
        self.text_delta()  # releases what may be shown (all of it once finished)
        return CompletionOutput(
            index=self.index,
            text="" if self.detokenizer is None else self.detokenizer.sent_text,
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


class _Parent:
    """A request as the caller sees it: a prompt and its `n` completions."""

    __slots__ = (
        "completions",
        "kind",
        "metrics",
        "num_unfinished",
        "pooling",
        "prompt",
        "prompt_logprobs",
        "prompt_logprobs_sent",
        "prompt_token_ids",
        "request_id",
    )

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        kind: RequestOutputKind,
        arrival_time: float,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.kind = kind
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.completions: list[_Completion] = []
        self.num_unfinished = 0
        # An embedding request: one completion, answered with its vector.
        self.pooling = False
        self.prompt_logprobs: PromptLogprobs | None = None
        self.prompt_logprobs_sent = False

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    def output(self, changed: Sequence[CompletionOutput]) -> RequestOutput:
        prompt_logprobs = self.prompt_logprobs
        if self.kind == RequestOutputKind.DELTA:  # a stream carries them once
            if self.prompt_logprobs_sent:
                prompt_logprobs = None
            elif prompt_logprobs is not None:
                self.prompt_logprobs_sent = True
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            list(changed),
            self.finished,
            self.metrics,
            prompt_logprobs,
        )

    def embedding_output(
        self, vector: list[float], reason: str, num_cached_tokens: int = 0
    ) -> EmbeddingRequestOutput:
        return EmbeddingRequestOutput(
            self.request_id,
            EmbeddingOutput(vector),
            self.prompt_token_ids,
            True,
            reason,
            num_cached_tokens,
        )


class OutputProcessor:
    """Owns every caller-facing piece of per-request state; driven by the engine's thread."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._completions: dict[str, _Completion] = {}
        self._pending: list[AnyRequestOutput] = []
        # Requests finished outside a step (aborts) are counted in the next step's stats.
        self._finished_stats: list[FinishedRequestStats] = []
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_requests_finished = 0

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        kind: RequestOutputKind,
        arrival_time: float,
        completions: Sequence[EngineCoreRequest],
    ) -> None:
        parent = _Parent(request_id, prompt, prompt_token_ids, kind, arrival_time)
        parent.pooling = any(r.pooling_params is not None for r in completions)
        for index, request in enumerate(completions):
            params = request.sampling_params
            detok = None
            if self.tokenizer is not None and not parent.pooling:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
            c = _Completion(request.request_id, index, parent, params, detok)
            parent.completions.append(c)
            self._completions[request.request_id] = c
        parent.num_unfinished = len(parent.completions)
        self._parents[request_id] = parent

    def prompt_of(self, request_id: str) -> str | None:
        """The prompt text of a live request or completion id (None: unknown, or given as
        token ids). For observers that were allowed to show it (the dashboard's opt-in)."""
        parent = self._parents.get(request_id)
        if parent is None:
            completion = self._completions.get(request_id)
            parent = completion.parent if completion is not None else None
        return parent.prompt if parent is not None else None

    def is_known(self, request_id: str) -> bool:
        return request_id in self._parents or request_id in self._completions

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """End requests for the caller; returns the completion ids the core must abort.

        Each aborted request is reported once more, finished with reason "abort", by the
        next `process_outputs`, so a caller waiting on it is released.
        """
        to_abort: list[str] = []
        now = time.monotonic()
        for rid in request_ids:
            parent = self._parents.get(rid)
            if parent is None:
                continue
            changed = []
            for c in parent.completions:
                if c.finish_reason is not None:
                    continue
                c.finish_reason = "abort"
                to_abort.append(c.request_id)
                changed.append(c)
            parent.num_unfinished = 0
            self._finish_parent(parent, now)
            if parent.pooling:
                self._pending.append(parent.embedding_output([], "abort"))
                continue
            outputs = [self._completion_output(c, []) for c in changed]
            if parent.kind == RequestOutputKind.DELTA:
                self._pending.append(parent.output(outputs))
            else:
                self._pending.append(parent.output([c.whole() for c in parent.completions]))
        return to_abort

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents) or bool(self._pending)

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ------------------------------------------------------------------ the step

    def process_outputs(self, updates: Sequence[EngineCoreOutput]) -> ProcessedOutputs:
        now = time.monotonic()
        stats = IterationStats()
        outputs = self._pending
        self._pending = []
        reqs_to_finish: list[str] = []
        changed: dict[str, tuple[_Parent, list[CompletionOutput]]] = {}
        for upd in updates:
            c = self._completions.get(upd.request_id)
            if c is None:
                continue  # aborted by the caller since the step was scheduled
            parent = c.parent
            if parent.pooling:
                outputs.append(self._pooled(c, upd, now, stats))
                continue
            if upd.prompt_logprobs is not None and parent.prompt_logprobs is None:
                parent.prompt_logprobs = prompt_logprob_entries(upd.prompt_logprobs)
            tokens = upd.new_token_ids
            entries = None
            if tokens:
                c.token_ids.extend(tokens)
                self._time_tokens(c, parent, upd, now, stats)
                if c.num_logprobs is not None:
                    entries = self._logprob_entries(c, upd.new_logprobs)
            if c.detokenizer is not None:
                stop = c.detokenizer.update(tokens)
                if stop is not None:
                    c.finish_reason, c.stop_reason = "stop", stop
                    if not upd.finished:
                        reqs_to_finish.append(upd.request_id)
            if c.finish_reason is None and upd.finish_reason is not None:
                reason = upd.finish_reason
                c.finish_reason = reason.as_api()
                c.stop_reason = upd.stop_reason
                if reason == FinishReason.ERROR and not is_grammar_failure(upd.stop_reason):
                    # The core's words are for the log; a caller learns only that it failed
                    # (a grammar failure is worded for the caller: it says what to fix).
                    logger.error(
                        "request %s failed in the engine: %s", upd.request_id, upd.stop_reason
                    )
                    c.stop_reason = None
            if c.finish_reason is not None:
                del self._completions[upd.request_id]
                parent.num_unfinished -= 1
                if parent.finished:
                    self._finish_parent(parent, now)
            entry = changed.get(parent.request_id)
            if entry is None:
                entry = changed[parent.request_id] = (parent, [])
            if parent.kind == RequestOutputKind.DELTA:
                entry[1].append(self._completion_output(c, tokens, entries))
        for parent, deltas in changed.values():
            if parent.kind == RequestOutputKind.DELTA:
                outputs.append(parent.output(deltas))
            elif parent.kind == RequestOutputKind.CUMULATIVE or parent.finished:
                outputs.append(parent.output([c.whole() for c in parent.completions]))
        stats.finished_requests, self._finished_stats = self._finished_stats, []
        return ProcessedOutputs(outputs, reqs_to_finish, stats)

    def _pooled(
        self, c: _Completion, upd: EngineCoreOutput, now: float, stats: IterationStats
    ) -> EmbeddingRequestOutput:
        """An embedding request's one output: its vector, or why there is none."""
        parent = c.parent
        reason = "stop"
        if upd.pooled is None:
            # A pooling request only ends without a vector when it failed or never ran.
            finish = upd.finish_reason if upd.finish_reason is not None else FinishReason.ERROR
            reason = finish.as_api()
            if finish == FinishReason.ERROR:
                logger.error("request %s failed in the engine: %s", upd.request_id, upd.stop_reason)
        else:
            num_prompt = len(parent.prompt_token_ids)
            stats.num_prompt_tokens += num_prompt
            self.prompt_tokens_total += num_prompt
        m = parent.metrics
        m.first_scheduled_time = upd.first_scheduled_time
        m.num_cached_tokens = upd.num_cached_tokens
        c.finish_reason = reason
        self._completions.pop(upd.request_id, None)
        parent.num_unfinished = 0
        self._finish_parent(parent, now)
        return parent.embedding_output(upd.pooled or [], reason, upd.num_cached_tokens)

    def _completion_output(
        self, c: _Completion, tokens: list[int], entries: list[dict[int, float]] | None = None
    ) -> CompletionOutput:
        if c.num_logprobs is not None and entries is None:
            entries = []
        return CompletionOutput(
            c.index,
            c.text_delta(),
            tokens,
            c.cumulative_logprob,
            entries,
            c.finish_reason,
            c.stop_reason,
        )

    def _time_tokens(
        self,
        c: _Completion,
        parent: _Parent,
        upd: EngineCoreOutput,
        now: float,
        stats: IterationStats,
    ) -> None:
        n = len(upd.new_token_ids)
        m = parent.metrics
        if upd.first_scheduled_time is not None and (
            m.first_scheduled_time is None or upd.first_scheduled_time < m.first_scheduled_time
        ):
            m.first_scheduled_time = upd.first_scheduled_time
        if m.first_token_time is None:
            m.first_token_time = now
            m.num_cached_tokens = upd.num_cached_tokens
            stats.time_to_first_tokens.append(now - m.arrival_time)
            stats.num_prompt_tokens += len(parent.prompt_token_ids)
            self.prompt_tokens_total += len(parent.prompt_token_ids)
        if c.last_token_time is not None:
            stats.inter_token_latencies.extend([(now - c.last_token_time) / n] * n)
        c.last_token_time = now
        m.last_token_time = now
        stats.num_generation_tokens += n
        self.generation_tokens_total += n

    def _logprob_entries(
        self, c: _Completion, rows: Sequence[LogprobsRow] | None
    ) -> list[dict[int, float]]:
        """One entry per new token (a verified speculative step brings several)."""
        entries: list[dict[int, float]] = []
        n = c.num_logprobs or 0
        for ids, lps in rows or ():
            entry = {int(ids[0]): float(lps[0])}
            for t, lp in zip(ids[1 : 1 + n], lps[1 : 1 + n]):
                entry.setdefault(int(t), float(lp))
            if c.cumulative_logprob is not None:
                c.cumulative_logprob += float(lps[0])
            if c.logprobs is not None:
                c.logprobs.append(entry)
            entries.append(entry)
        return entries

    def _finish_parent(self, parent: _Parent, now: float) -> None:
        """Bookkeeping once every completion has ended (or the caller aborted)."""
        if self._parents.pop(parent.request_id, None) is None:
            return
        for c in parent.completions:
            self._completions.pop(c.request_id, None)
        m = parent.metrics
        m.finished_time = now
        self.num_requests_finished += 1
        reasons = [c.finish_reason for c in parent.completions if c.finish_reason]
        queue = (
            None
            if m.first_scheduled_time is None
            else max(0.0, m.first_scheduled_time - m.arrival_time)
        )
        self._finished_stats.append(
            FinishedRequestStats(
                reasons[0] if reasons else "abort",
                now - m.arrival_time,
                queue,
                len(parent.prompt_token_ids),
                sum(len(c.token_ids) for c in parent.completions),
            )
        )


def prompt_logprob_entries(rows: PromptLogprobsRows) -> PromptLogprobs:
    """The core's rows as vLLM's prompt_logprobs: None for the first position (nothing
    predicts it), then {prompt token: logprob, top-1: logprob, ...} per position."""
    ids, values, _ = rows
    entries: PromptLogprobs = [None]
    for row_ids, row_values in zip(ids, values):
        entry = {int(row_ids[0]): float(row_values[0])}
        for t, lp in zip(row_ids[1:], row_values[1:]):
            entry.setdefault(int(t), float(lp))
        entries.append(entry)
    return entries
