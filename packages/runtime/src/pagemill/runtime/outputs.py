"""What the engine hands back for a request: cumulative text, tokens, logprobs and timings.

Outputs are cumulative (the whole completion so far, not a delta) like vLLM's offline API;
streaming callers take deltas themselves (the engine's detokenizer offers `get_delta`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Per generated token: {token_id: logprob}. The sampled token comes first, then the top-n
# tokens in decreasing order of probability (the sampled one is not repeated if among them).
SampleLogprobs = list[dict[int, float]]


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic()) of a request's life, for latency figures (TTFT, TPOT)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0


@dataclass
class CompletionOutput:
    """One of the `n` completions of a request.

    `finish_reason` is "stop" | "length" | "abort" | None (still running); `stop_reason`
    is the stop token id or stop string that ended it (None for EOS or length).
    `cumulative_logprob` and `logprobs` are None unless the request asked for logprobs.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after an engine step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=0.0))
