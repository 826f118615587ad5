"""How one request wants its tokens chosen and when it wants to stop.

`SamplingParams` is built by users (and by the server from HTTP bodies), so every field is
checked once, here, with an error that names the field: bad values must fail at the API
boundary, not as a NaN or an index error deep in a batched sampler step.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pagemill.runtime.sample.structured_output.params import StructuredOutputsParams

# Below this temperature, dividing the logits would overflow fp32 or make sampling a
# numerically noisy argmax; such requests are treated as greedy instead.
SAMPLING_EPS = 1e-5

# OpenAI's range for a logit_bias value.
MAX_LOGIT_BIAS = 100.0

# Top-n logprobs are computed with one batched topk; a cap keeps that bounded (OpenAI's limit).
MAX_LOGPROBS = 20
# Seeds are 64-bit signed integers: each maps to its own generator state (torch takes the
# value modulo 2**64, so a wider range would alias: -1 and 2**64 - 1 are one seed there).
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1


class RequestOutputKind(enum.Enum):
    """What each output of a request carries.

    DELTA (the default) is what streaming needs and costs O(new tokens) per step;
    CUMULATIVE rebuilds the whole completion every step (O(n) per step, O(n^2) over a
    generation) and exists for callers that want vLLM's old offline shape; FINAL_ONLY
    builds the cumulative view once, when the request ends (offline `LLM`, non-streaming
    HTTP responses).
    """

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


class SamplingType(enum.IntEnum):
    """How a row is sampled: the sampler groups rows by it."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _is_int(x: object) -> bool:
    # bool is an int subclass; `max_tokens=True` is almost certainly a mistake.
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """Sampling and stopping options of one request (vLLM's names and defaults).

    `top_k` 0 or -1 and `top_p` 1.0 and `min_p` 0.0 mean "off". `temperature` 0 means greedy.
    `max_tokens=None` means "until the context is full". `stop` is normalised to a list.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: Sequence[int] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.DELTA
    # Added to the logits of these token ids before anything else (OpenAI's logit_bias).
    logit_bias: Mapping[int, float] | None = None
    # What the output must match (JSON schema, regex, choice, grammar); None: free text.
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: words never to generate. A word's token sequence is banned once its prefix
    # has just been generated (a one-token word: always). Turned into token sequences by the
    # input processor, which knows the tokenizer (`bad_words_token_ids`).
    bad_words: list[str] | None = None
    # The only token ids that may be sampled (vLLM's allowed_token_ids); None: all.
    allowed_token_ids: list[int] | None = None
    # Keep only the last k prompt tokens (vLLM's; -1: as many as the context allows).
    truncate_prompt_tokens: int | None = None
    # Filled by the input processor from `bad_words`: each word's token sequences (with and
    # without a leading space). Set by hand only when there is no tokenizer.
    bad_words_token_ids: list[list[int]] | None = None
    # Logprobs of the prompt's own tokens (vLLM): per prompt position after the first, the
    # actual token's logprob plus the top `prompt_logprobs`; None: not computed.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.stop_token_ids is None:  # OpenAI-style bodies send null for "none"
            self.stop_token_ids = []
        self._validate()
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        self.min_p = float(self.min_p)
        self.presence_penalty = float(self.presence_penalty)
        self.frequency_penalty = float(self.frequency_penalty)
        self.repetition_penalty = float(self.repetition_penalty)
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()} or None
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words) or None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
        if self.bad_words_token_ids is not None:
            self.bad_words_token_ids = [list(w) for w in self.bad_words_token_ids] or None

    def _validate(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {rule}, got {getattr(self, name)!r}")

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not _is_number(self.temperature) or not self.temperature >= 0:
            raise bad("temperature", "must be a number >= 0")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or not (self.top_k in (0, -1) or self.top_k >= 1):
            raise bad("top_k", "must be 0 or -1 (disabled) or an integer >= 1")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (
            not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            raise bad(
                "seed", f"must be None or an integer in [{SEED_MIN}, {SEED_MAX}] (64-bit signed)"
            )
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1 or None")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens must be <= max_tokens, got min_tokens="
                f"{self.min_tokens} > max_tokens={self.max_tokens}"
            )
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stops, (list, tuple)) or not all(
                isinstance(s, str) and s for s in stops
            ):
                raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        if isinstance(self.stop_token_ids, (str, bytes)) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "must be a sequence of non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise bad(name, "must be in [-2, 2]")
        if (
            not _is_number(self.repetition_penalty)
            or not self.repetition_penalty > 0
            or not math.isfinite(self.repetition_penalty)
        ):
            raise bad("repetition_penalty", "must be a finite number > 0")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise bad("logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise bad("prompt_logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a bool")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", "must be a RequestOutputKind")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise bad("logit_bias", "must be a mapping of token id -> bias")
            for t, b in self.logit_bias.items():
                if not _is_int(t) or t < 0:
                    raise bad("logit_bias", "must map non-negative integer token ids to biases")
                if not _is_number(b) or not math.isfinite(b) or abs(b) > MAX_LOGIT_BIAS:
                    raise bad(
                        "logit_bias",
                        f"values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
                    )
        if self.bad_words is not None and (
            isinstance(self.bad_words, (str, bytes))
            or not isinstance(self.bad_words, Sequence)
            or not all(isinstance(w, str) and w.strip() for w in self.bad_words)
        ):
            raise bad("bad_words", "must be a list of non-blank strings")
        if self.allowed_token_ids is not None and (
            isinstance(self.allowed_token_ids, (str, bytes))
            or not isinstance(self.allowed_token_ids, Sequence)
            or not self.allowed_token_ids
            or not all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)
        ):
            raise bad("allowed_token_ids", "must be a non-empty list of non-negative token ids")
        if self.truncate_prompt_tokens is not None and (
            not _is_int(self.truncate_prompt_tokens)
            or not (self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1)
        ):
            raise bad("truncate_prompt_tokens", "must be None, -1 or an integer >= 1")
        if self.bad_words_token_ids is not None and not all(
            isinstance(w, Sequence) and w and all(_is_int(t) and t >= 0 for t in w)
            for w in self.bad_words_token_ids
        ):
            raise bad("bad_words_token_ids", "must be non-empty lists of non-negative token ids")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise bad("structured_outputs", "must be a StructuredOutputsParams")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as a list, typed for callers (after __post_init__ it is always a list)."""
        return list(self.stop) if isinstance(self.stop, list) else []

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop_strings), default=0)

    def child_params(self, index: int) -> SamplingParams:
        """Parameters of the `index`-th of `n` completions, sampled as its own request.

        A seeded request with n > 1 would otherwise give n identical copies; each copy gets
        `seed + index` so the set is reproducible and the copies differ; past the top of the
        64-bit signed range it wraps around to the bottom (never out of range).
        """
        seed = None
        if self.seed is not None:
            seed = (self.seed + index - SEED_MIN) % 2**64 + SEED_MIN
        return dataclasses.replace(self, n=1, seed=seed)
