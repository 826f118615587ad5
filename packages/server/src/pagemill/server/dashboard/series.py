"""The dashboard's charts over time, folded from the engine's own per-step figures.

Why here and not in the engine: the server is already told about every step
(`StepObserver.on_step`, which feeds Prometheus): the scheduler's gauges and the step's
`IterationStats` (tokens, TTFTs, inter-token latencies). Folding them into half-second
buckets on the API side costs the engine nothing (with an engine process, the reader
thread does it) and keeps the last few minutes of history, so a page opened now has a
past to draw.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

DEFAULT_BUCKET_S = 0.5
DEFAULT_HISTORY = 600  # points: 5 minutes of half-second buckets


class TokenClock:
    """Per-step token figures from a scheduler's updates, for engines that do not report
    `IterationStats` themselves (the simulator's replay, scripted engines): each request's
    first and last token times, kept until it finishes."""

    def __init__(self) -> None:
        self._first: dict[str, float] = {}
        self._last: dict[str, float] = {}

    def observe(
        self, clock: float, updates: list[Any], scheduler: Any
    ) -> tuple[int, int, list[float], list[float]]:
        """(prompt tokens of first tokens, generated tokens, TTFTs, inter-token latencies)
        of one step ending at `clock`."""
        gen = prompt = 0
        ttft: list[float] = []
        itl: list[float] = []
        for u in updates:
            if not u.new_token_ids:
                continue
            gen += len(u.new_token_ids)
            rid = u.request_id
            if rid not in self._first:
                req = scheduler.get_request(rid)
                self._first[rid] = clock
                if req is not None:
                    ttft.append(clock - req.arrival_time)
                    prompt += req.num_prompt_tokens
            else:
                itl.append(clock - self._last[rid])
            self._last[rid] = clock
            if u.finished:
                self._first.pop(rid, None)
                self._last.pop(rid, None)
        return prompt, gen, ttft, itl


class SeriesRecorder:
    """`add_step(...)` per engine step; closed buckets come out as chart points.

    A point: `t` (wall seconds, bucket end), `tok_s` (generated tokens/s), `prompt_s`
    (prompt tokens/s), `batch` (mean running requests per step), `waiting`, `kv` (KV
    usage %, last in the bucket), `ttft` and `itl` (mean, ms; None when none happened),
    `step_ms` (mean step time), `steps`, and `spec_accept` (speculative decoding: % of the
    draft tokens verified in the bucket that were accepted; None when none were). After an
    idle stretch a point of Nones is inserted so the charts show a gap, not a line across it.
    """

    def __init__(
        self,
        bucket_s: float = DEFAULT_BUCKET_S,
        history: int = DEFAULT_HISTORY,
        clock: Any = time.time,
    ) -> None:
        self.bucket_s = bucket_s
        self.clock = clock
        self.points: deque[dict[str, Any]] = deque(maxlen=history)
        self._start: float | None = None
        self._spec_totals = (0, 0)  # the engine's drafted / accepted totals at the last step
        self._reset()

    def _reset(self) -> None:
        self._steps = 0
        self._gen = 0
        self._prompt = 0
        self._batch = 0
        self._waiting = 0
        self._kv = 0.0
        self._ttft: list[float] = []
        self._itl_sum = 0.0
        self._itl_n = 0
        self._step_s = 0.0
        self._drafted = 0
        self._accepted = 0

    def add_step(
        self, stats: Any, iteration_stats: Any, step_seconds: float, now: float | None = None
    ) -> list[dict[str, Any]]:
        """Fold one step in; returns the points this closed (usually none)."""
        now = self.clock() if now is None else now
        closed = self.flush(now)
        if self._start is None:
            self._start = now
        self._steps += 1
        self._step_s += step_seconds
        self._batch += stats.num_running
        self._waiting = stats.num_waiting
        self._kv = stats.kv_cache_usage
        drafted = getattr(stats, "spec_num_draft_tokens", 0)
        accepted = getattr(stats, "spec_num_accepted_tokens", 0)
        self._drafted += max(0, drafted - self._spec_totals[0])
        self._accepted += max(0, accepted - self._spec_totals[1])
        self._spec_totals = (drafted, accepted)
        it = iteration_stats
        if it is not None:
            self._gen += it.num_generation_tokens
            self._prompt += it.num_prompt_tokens
            self._ttft.extend(it.time_to_first_tokens)
            itl = it.inter_token_latencies
            if itl:
                self._itl_sum += sum(itl)
                self._itl_n += len(itl)
        return closed

    def flush(self, now: float | None = None) -> list[dict[str, Any]]:
        """Close the open bucket if its time is over (also called on a timer, so the charts
        catch up when the engine goes idle); returns the points closed."""
        now = self.clock() if now is None else now
        start = self._start
        if start is None or now - start < self.bucket_s:
            return []
        closed = [self._close(start + self.bucket_s)] if self._steps else []
        if now - start >= 2 * self.bucket_s:  # idle in between: a gap, then a fresh bucket
            if closed or (self.points and not self.points[-1].get("gap")):
                closed.append({"t": round(start + 2 * self.bucket_s, 3), "gap": True})
            self._start = None
        else:
            self._start = start + self.bucket_s
        self.points.extend(closed)
        return closed

    def _close(self, t: float) -> dict[str, Any]:
        span = self.bucket_s
        steps = max(1, self._steps)
        point = {
            "t": round(t, 3),
            "tok_s": round(self._gen / span, 1),
            "prompt_s": round(self._prompt / span, 1),
            "batch": round(self._batch / steps, 2),
            "waiting": self._waiting,
            "kv": round(100.0 * self._kv, 2),
            "ttft": round(1e3 * sum(self._ttft) / len(self._ttft), 2) if self._ttft else None,
            "itl": round(1e3 * self._itl_sum / self._itl_n, 2) if self._itl_n else None,
            "step_ms": round(1e3 * self._step_s / steps, 3),
            "steps": self._steps,
            "spec_accept": (
                round(100.0 * self._accepted / self._drafted, 1) if self._drafted else None
            ),
        }
        self._reset()
        return point

    def history(self) -> list[dict[str, Any]]:
        return list(self.points)
