"""The one record of a generation request: tokens, block hashes, progress, stop rules,
status, and the sampling parameters the runner needs.

The engine builds it, the scheduler mutates it, the model runner reads it (through
`ScheduledRequest.request`). `all_token_ids` is the only token list: the block hasher and
the runner read it, and `prompt_token_ids` / `output_token_ids` are views over it, so a
decode step appends one token once and nothing has to be kept in sync.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagemill.scheduler.token_ids_view import TokenIdsView

if TYPE_CHECKING:
    from pagemill.blockpool import BlockHash
    from pagemill.blockpool.hashing import BlockHasher


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request; every value after PREEMPTED is terminal."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_IGNORED = 6
    # The forward pass or the sampler failed on this request alone (see EngineCore).
    FINISHED_ERROR = 7

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        """The OpenAI-style reason of a terminal status; None while the request is alive."""
        return _FINISH_REASONS.get(status)


_FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "ignored",
    RequestStatus.FINISHED_ERROR: "error",
}


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


class Request:
    """One sequence to generate; priority: lower value is served sooner.

    `arrival_time` and `first_scheduled_time` are `time.monotonic()` readings (one clock for
    every latency figure; wall-clock time can jump). `sampling_params` is carried for the
    engine and the model runner; the scheduler never reads it.
    """

    __slots__ = (
        "_seq",
        "all_token_ids",
        "arrival_time",
        "block_hasher",
        "block_hashes",
        "cache_salt",
        "eos_token_id",
        "first_scheduled_time",
        "ignore_eos",
        "lora_int_id",
        "max_tokens",
        "min_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "pooling_params",
        "priority",
        "request_id",
        "sampling_params",
        "skip_reading_prefix_cache",
        "spec_token_ids",
        "status",
        "stop_reason",
        "stop_token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int | None = None,
        min_tokens: int = 0,
        eos_token_id: int | None = None,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        sampling_params: object = None,
        pooling_params: object = None,
        skip_reading_prefix_cache: bool = False,
        lora_int_id: int = 0,
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        tokens = list(prompt_token_ids)
        if not tokens:
            raise ValueError(f"request {request_id!r}: the prompt must hold at least one token")
        if max_tokens is not None:
            _check_int("max_tokens", max_tokens, 1)
        _check_int("min_tokens", min_tokens, 0)
        if max_tokens is not None and min_tokens > max_tokens:
            raise ValueError(
                f"request {request_id!r}: min_tokens={min_tokens} exceeds max_tokens={max_tokens}"
            )
        _check_int("priority", priority, -(2**63))
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")

        self.request_id = request_id
        self.all_token_ids: list[int] = tokens
        self.num_prompt_tokens = len(tokens)
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.eos_token_id = eos_token_id
        # A frozenset makes the per-token stop check O(1) whatever the list length.
        self.stop_token_ids: frozenset[int] = frozenset(stop_token_ids)
        self.ignore_eos = ignore_eos
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else float(arrival_time)
        self.cache_salt = cache_salt
        self.sampling_params = sampling_params
        # Set for an embedding request (the runner pools instead of sampling); opaque here.
        self.pooling_params = pooling_params
        # Admit without prefix-cache hits: the runner needs an output at every prompt
        # position (prompt logprobs, mean pooling), which a hit would skip (vLLM's name).
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        # The LoRA adapter it runs with (0: the base model): a key of its cached blocks,
        # and SchedulerConfig.max_loras bounds the distinct ones running together.
        _check_int("lora_int_id", lora_int_id, 0)
        self.lora_int_id = lora_int_id

        # Hashes of the full blocks of all_token_ids, kept complete by append_output_token
        # once the scheduler has attached its KV cache manager's hasher.
        self.block_hashes: list[BlockHash] = []
        self.block_hasher: BlockHasher | None = None
        self.num_computed_tokens = 0
        # Draft tokens a proposer guessed for the next step (speculative decoding, vLLM's
        # name): scheduled after the request's next token and verified by the runner; never
        # part of all_token_ids, so neither hashed nor counted. The scheduler consumes them.
        self.spec_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        # Arrival order inside one scheduler: the last tie-breaker of every ordering.
        self._seq = -1

    @property
    def prompt_token_ids(self) -> TokenIdsView:
        return TokenIdsView(self.all_token_ids, 0, self.num_prompt_tokens)

    @property
    def output_token_ids(self) -> TokenIdsView:
        """Live: a view kept by the caller shows the tokens appended later."""
        return TokenIdsView(self.all_token_ids, self.num_prompt_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def get_finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        """Append a sampled token and hash the block it fills, if it fills one."""
        tokens = self.all_token_ids
        tokens.append(token_id)
        hasher = self.block_hasher
        # One token fills a block exactly when the length becomes a multiple of the block
        # size; every other token costs this test alone (not even a look at block_hashes).
        # The hasher hashes every full block still missing, so hashes never fall behind
        # for longer than one block even if tokens were added some other way.
        if hasher is not None and not len(tokens) % hasher.block_size:
            self.block_hashes.extend(hasher(self))

    def __repr__(self) -> str:
        return (
            f"Request(id={self.request_id!r}, status={self.status.name}, "
            f"prompt={self.num_prompt_tokens}, out={self.num_output_tokens}, "
            f"computed={self.num_computed_tokens}, priority={self.priority})"
        )
