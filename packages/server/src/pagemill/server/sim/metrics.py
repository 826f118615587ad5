"""What a simulated run measured: per-request latencies and time-weighted memory use.

Both simulators (paged continuous batching and the static baseline) fill the same
:class:`RunRecorder`, so their summaries are computed by one piece of code and differ only in
what the systems did.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


@dataclass
class RequestTrace:
    arrival_time: float
    prompt_len: int
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    ignored: bool = False


@dataclass
class RunResult:
    """Summary of one simulated run; times in virtual seconds."""

    name: str
    num_requests: int
    num_finished: int
    num_ignored: int
    duration_s: float
    output_tokens: int
    computed_tokens: int
    prompt_tokens_computed: int
    num_steps: int
    throughput_tok_s: float
    request_throughput: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_mean_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    itl_max_s: float
    # Mean of (finish - arrival) / output tokens: the PagedAttention paper's "normalized latency".
    normalized_latency_s: float
    kv_utilization: float
    mean_batch_size: float
    max_batch_size: int
    num_preemptions: int = 0
    prefix_cache_hit_rate: float = math.nan
    # Series for the plots (not part of the printed table).
    timeline: list[tuple[float, float, int]] = field(default_factory=list, repr=False)
    ttfts: list[float] = field(default_factory=list, repr=False)
    itls: list[float] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, float | int | str]:
        """The scalar fields, e.g. for JSON output."""
        skip = {"timeline", "ttfts", "itls"}
        return {k: v for k, v in self.__dict__.items() if k not in skip}


class RunRecorder:
    """Collects token timestamps and, per step, the KV memory reserved vs holding real tokens."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.traces: dict[str, RequestTrace] = {}
        self.num_steps = 0
        self.computed_tokens = 0
        self.prompt_tokens_computed = 0
        self._busy_time = 0.0
        self._reserved_time = 0.0  # integral of reserved KV slots over time
        self._real_time = 0.0  # integral of KV slots holding real tokens
        self._batch_time = 0.0
        self.max_batch_size = 0
        self.timeline: list[tuple[float, float, int]] = []

    def arrive(self, request_id: str, arrival_time: float, prompt_len: int) -> None:
        self.traces[request_id] = RequestTrace(arrival_time, prompt_len)

    def step(
        self,
        end_time: float,
        duration: float,
        batch_size: int,
        num_tokens: int,
        num_prompt_tokens: int,
        reserved_slots: int,
        real_slots: int,
    ) -> None:
        """One model step that ran for ``duration`` and ended at ``end_time``."""
        if real_slots > reserved_slots or real_slots < 0:
            raise AssertionError(f"real KV slots {real_slots} outside [0, {reserved_slots}]")
        self.num_steps += 1
        self.computed_tokens += num_tokens
        self.prompt_tokens_computed += num_prompt_tokens
        self._busy_time += duration
        self._reserved_time += reserved_slots * duration
        self._real_time += real_slots * duration
        self._batch_time += batch_size * duration
        self.max_batch_size = max(self.max_batch_size, batch_size)
        util = real_slots / reserved_slots if reserved_slots else 0.0
        self.timeline.append((end_time, util, batch_size))

    def token(self, request_id: str, time: float, count: int = 1) -> None:
        times = self.traces[request_id].token_times
        if count == 1:
            times.append(time)
        else:
            times.extend([time] * count)

    def finish(self, request_id: str, time: float, ignored: bool = False) -> None:
        trace = self.traces[request_id]
        trace.finish_time = time
        trace.ignored = ignored

    def result(
        self, num_preemptions: int = 0, prefix_cache_hit_rate: float = math.nan
    ) -> RunResult:
        traces = list(self.traces.values())
        done = [t for t in traces if t.finish_time is not None and not t.ignored]
        ignored = sum(1 for t in traces if t.ignored)
        start = min((t.arrival_time for t in traces), default=0.0)
        end = max((t.finish_time for t in traces if t.finish_time is not None), default=start)
        duration = end - start
        ttfts = [t.token_times[0] - t.arrival_time for t in done if t.token_times]
        tpots = [
            (t.token_times[-1] - t.token_times[0]) / (len(t.token_times) - 1)
            for t in done
            if len(t.token_times) > 1
        ]
        itls = [b - a for t in done for a, b in zip(t.token_times, t.token_times[1:])]
        output_tokens = sum(len(t.token_times) for t in done)
        normalized = [
            (t.finish_time - t.arrival_time) / len(t.token_times)
            for t in done
            if t.token_times and t.finish_time is not None
        ]
        busy = self._busy_time
        return RunResult(
            name=self.name,
            num_requests=len(traces),
            num_finished=len(done),
            num_ignored=ignored,
            duration_s=duration,
            output_tokens=output_tokens,
            computed_tokens=self.computed_tokens,
            prompt_tokens_computed=self.prompt_tokens_computed,
            num_steps=self.num_steps,
            throughput_tok_s=output_tokens / duration if duration > 0 else math.nan,
            request_throughput=len(done) / duration if duration > 0 else math.nan,
            ttft_mean_s=_mean(ttfts),
            ttft_p50_s=percentile(ttfts, 50),
            ttft_p99_s=percentile(ttfts, 99),
            tpot_mean_s=_mean(tpots),
            tpot_p50_s=percentile(tpots, 50),
            tpot_p99_s=percentile(tpots, 99),
            itl_p50_s=percentile(itls, 50),
            itl_p99_s=percentile(itls, 99),
            itl_max_s=max(itls, default=math.nan),
            normalized_latency_s=_mean(normalized),
            kv_utilization=self._real_time / self._reserved_time
            if self._reserved_time
            else math.nan,
            mean_batch_size=self._batch_time / busy if busy else math.nan,
            max_batch_size=self.max_batch_size,
            num_preemptions=num_preemptions,
            prefix_cache_hit_rate=prefix_cache_hit_rate,
            timeline=self.timeline,
            ttfts=ttfts,
            itls=itls,
        )
