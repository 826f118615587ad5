"""Scheduler limits, checked once at construction so a bad engine flag fails at start-up
with a message naming it, not as a hang or an assertion many steps later."""

from __future__ import annotations

from dataclasses import dataclass, field

POLICIES = ("fcfs", "priority")


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"SchedulerConfig.{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"SchedulerConfig.{name} must be positive, got {value}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step budget and policy of the scheduler.

    Without chunked prefill a prompt is scheduled whole, so the step budget must be able to
    hold the longest allowed prompt. Prefix caching is the KV cache manager's business
    (`CacheConfig.enable_prefix_caching`), not the scheduler's. The engine sets
    `max_model_len` from the model's resolved context length. Each field's docstring is the
    help text of its command-line flag.
    """

    max_num_batched_tokens: int = 2048
    """Most tokens (prefill plus decode) one engine step may compute."""

    max_num_seqs: int = 256
    """Most requests that may be running (holding KV blocks) at once."""

    max_model_len: int = 2048
    """Longest sequence (prompt plus output) a request may reach."""

    long_prefill_token_threshold: int = 0
    """Most prompt tokens one request may prefill per step (0 = no cap), so a long prompt
    cannot starve the decodes and the other prompts that share the step."""

    enable_chunked_prefill: bool = True
    """Split long prompts across steps to fit the per-step token budget."""

    policy: str = field(default="fcfs", metadata={"choices": POLICIES})
    """Admission order: fcfs (arrival order) or priority (lower value first, then arrival)."""
    max_loras: int = 0
    """Most distinct LoRA adapters among the running requests (the device's adapter slots);
    0: no limit (set by the engine when it serves adapters)."""

    def __post_init__(self) -> None:
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_model_len", self.max_model_len)
        t = self.long_prefill_token_threshold
        if isinstance(t, bool) or not isinstance(t, int):
            raise TypeError(
                "SchedulerConfig.long_prefill_token_threshold must be an int, "
                f"got {type(t).__name__}"
            )
        if t < 0:
            raise ValueError(
                f"SchedulerConfig.long_prefill_token_threshold must be >= 0 (0 = off), got {t}"
            )
        if self.policy not in POLICIES:
            raise ValueError(
                f"SchedulerConfig.policy must be one of {POLICIES}, got {self.policy!r}"
            )
        if not self.enable_chunked_prefill:
            if self.max_num_batched_tokens < self.max_model_len:
                raise ValueError(
                    "without chunked prefill a whole prompt must fit one step: "
                    f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                    f"max_model_len ({self.max_model_len}); enable chunked prefill or raise "
                    "the budget"
                )
            if t:
                raise ValueError(
                    "long_prefill_token_threshold chunks prompts, so it needs "
                    "enable_chunked_prefill=True"
                )
