"""What the engine hands back for a request: text, tokens, logprobs and timings.

An output's shape follows the request's `SamplingParams.output_kind`: DELTA (the default)
carries only what is new since the previous output of that completion, so a stream costs
O(new tokens) per step whatever the length of the generation; FINAL_ONLY and CUMULATIVE
carry the whole completion (built once at the end, or every step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

# Per generated token: {token_id: logprob}. The sampled token comes first, then the top-n
# tokens in decreasing order of probability (the sampled one is not repeated if among them).
# The engine and the server keep plain floats; the offline `LLM` hands out `Logprob`s.
SampleLogprobs = list[dict[int, float]]
# Per prompt position: None for the first, then {token_id: logprob} with the prompt's own
# token first and the top-n after it (vLLM's `prompt_logprobs`).
PromptLogprobs = list[dict[int, float] | None]


class Logprob(float):
    """One token's log probability, as vLLM's `Logprob`: `.logprob`, `.rank` (1 = the most
    likely token of the vocabulary; None where the engine did not rank it: a sampled token
    outside the requested top-n) and `.decoded_token`.

    A float subclass, so code written for pagemill's earlier plain-float entries keeps
    working (`max(entry.values())`, arithmetic, approx comparisons).
    """

    __slots__ = ("decoded_token", "rank")
    rank: int | None
    decoded_token: str | None

    def __new__(
        cls, logprob: float, rank: int | None = None, decoded_token: str | None = None
    ) -> Logprob:
        self = super().__new__(cls, logprob)
        self.rank = rank
        self.decoded_token = decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return (
            f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, "
            f"decoded_token={self.decoded_token!r})"
        )

    def __reduce__(self) -> tuple[type[Logprob], tuple[float, int | None, str | None]]:
        return (Logprob, (float(self), self.rank, self.decoded_token))


def rank_logprobs(
    entry: dict[int, float], num_top: int, decode: Callable[[int], str | None]
) -> dict[int, Logprob]:
    """An engine entry (sampled token first, then the top `num_top` in decreasing order,
    the sampled one not repeated) as `Logprob`s with their ranks."""
    items = list(entry.items())
    sampled_id, sampled_lp = items[0]
    tops = items[1:]
    # The sampled token was one of the top-n exactly when the entry is one short.
    if len(items) == num_top and num_top > 0:
        at = sum(1 for _, lp in tops if lp > sampled_lp)
        tops.insert(at, (sampled_id, sampled_lp))
        ranks = {t: i + 1 for i, (t, _) in enumerate(tops)}
    else:
        ranks = {t: i + 1 for i, (t, _) in enumerate(tops)}
    return {t: Logprob(lp, ranks.get(t), decode(t)) for t, lp in entry.items()}


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
    """One of the `n` completions of a request (the new part of it, for DELTA outputs).

    `finish_reason` is "stop" | "length" | "abort" | None (still running); `stop_reason`
    is the stop token id or stop string that ended it (None for EOS or length).
    `cumulative_logprob` and `logprobs` are None unless the request asked for logprobs.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # From the offline `LLM`, the values are `Logprob`s (floats with rank and decoded text).
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after an engine step.

    For DELTA outputs of an `n > 1` request, `outputs` holds only the completions that
    changed in this step (each with its `index`); `finished` is true once all have ended.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=0.0))
    # Set when the request asked for prompt_logprobs (for DELTA outputs: once, in the first).
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class EmbeddingOutput:
    """The pooled vector of one prompt (vLLM's `EmbeddingOutput`)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """An embedding request's result (vLLM's shape: `outputs.embedding`).

    `finish_reason` is "stop" when the vector is there; "length" (the prompt can never fit
    the KV pool), "abort" or "error" leave `outputs.embedding` empty.
    """

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    finish_reason: str = "stop"
    num_cached_tokens: int = 0
