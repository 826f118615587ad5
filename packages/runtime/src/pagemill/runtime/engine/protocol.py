"""The messages between the front end (API process) and the engine core: token ids only.

The engine core never sees text: the front end tokenizes, validates and fans out `n`,
then sends one `EngineCoreRequest` per completion; the core answers every step with one
`EngineCoreOutputs` (per request: the new token ids, and once, why it finished).
Detokenization, stop strings, `n > 1` and logprob formatting happen on the front end's side.

The structs are msgspec's: array-like (no field names on the wire), encoded with msgpack
when the core runs in another process, handed over as they are when it runs in this one.
Each message to and from a core process is one `Message` (a tagged union), so one
decoder reads them all and an unknown message is an error, not a guess.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from pagemill.runtime.engine.kv_events import KVEventBatch
from pagemill.runtime.lora.request import LoRARequest
from pagemill.runtime.pooling_params import PoolingParams
from pagemill.runtime.sampling_params import SamplingParams

# Prompt logprobs of one request, position 1..P-1 of its prompt: per position
# [prompt token id, top-1 id, ...], their logprobs, and the prompt token's rank (1 = the
# most likely token).
PromptLogprobsRows = tuple[list[list[int]], list[list[float]], list[int]]


class FinishReason(enum.IntEnum):
    """Why a completion ended, as the engine core knows it. The front end maps it to the
    API's words once (`as_api`): a prompt that can never fit the pool is, to a client, a
    length cut."""

    STOP = 0  # EOS, a stop token, a stop string (front end), a grammar that completed
    LENGTH = 1  # max_tokens or the context
    ABORT = 2  # the caller aborted it
    ERROR = 3  # it broke a step, or its grammar could not be compiled
    IGNORED = 4  # it can never run (the prompt exceeds the pool or the context)

    def as_api(self) -> str:
        return _API_NAMES[self]


_API_NAMES = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.ERROR: "error",
    FinishReason.IGNORED: "length",
}

# The scheduler's words for a finished request (`RequestStatus.finish_reason`).
FINISH_REASONS = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
    "error": FinishReason.ERROR,
    "ignored": FinishReason.IGNORED,
}


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, tag="add"):
    """One completion to compute: the prompt's ids and every rule the core applies itself."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    eos_token_id: int | None
    stop_token_ids: list[int]
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    # An embedding request: the core pools the prompt's hidden states instead of sampling
    # (`sampling_params` is then a fixed greedy one-token placeholder, max_tokens 1).
    pooling_params: PoolingParams | None = None
    # The LoRA adapter it runs with (None: the base model); the core reads its folder.
    lora_request: LoRARequest | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step changed for one request."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    # The stop token id that ended it; for an ignored or failed request, why (the front
    # end logs it; a client never sees the core's words).
    stop_reason: int | str | None = None
    # Sampled requests that asked for logprobs, one row per new token (a verified
    # speculative step emits several): ([sampled id, top ids...], [logprobs]).
    new_logprobs: list[tuple[list[int], list[float]]] | None = None
    # Sent with a request's first tokens: when it was first scheduled (time.monotonic(),
    # one clock for every process of the machine) and how many prompt tokens it found cached.
    first_scheduled_time: float | None = None
    num_cached_tokens: int = 0
    # Once, with the step that completes the prompt: its logprobs (asked for with
    # SamplingParams.prompt_logprobs) or, for a pooling request, its vector (then with no
    # token ids: the request finishes in that same output).
    prompt_logprobs: PromptLogprobsRows | None = None
    pooled: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, gc=False):
    """The core's gauges now and its totals since start."""

    num_running: int = 0
    num_waiting: int = 0  # in the scheduler's queue or waiting for a grammar
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_blocks: int = 0
    block_size: int = 16
    grammar_cache_bytes: int = 0
    # Speculative decoding totals (see spec_decode/metrics.py); 0 when it is off.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    # Graphs still compiling in the background (the steps run eagerly until 0).
    compile_graphs_pending: int = 0


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, tag="outputs"):
    """One step's outputs (or, with `step_seconds` None, the answer to commands that ran
    no step: fresh stats only)."""

    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    step_seconds: float | None = None
    num_scheduled_tokens: int = 0
    engine_index: int = 0
    # This step's KV-cache events, for a data-parallel front end that routes by prefix.
    kv_events: KVEventBatch | None = None


class AbortRequests(msgspec.Struct, array_like=True, tag="abort"):
    """End requests now and free their blocks. `reason` STOP: a stop string the front end
    found (the request finished normally); ABORT: the caller left."""

    request_ids: list[str]
    reason: FinishReason = FinishReason.ABORT


class UtilityCall(msgspec.Struct, array_like=True, tag="call"):
    """Run `pickle.loads(fn)(core)` between steps (stats, tests, the dashboard)."""

    call_id: int
    fn: bytes


class UtilityResult(msgspec.Struct, array_like=True, tag="result"):
    call_id: int
    ok: bool
    value: bytes  # pickled result, or the pickled exception


class Shutdown(msgspec.Struct, array_like=True, tag="shutdown"):
    pass


class EngineCoreReady(msgspec.Struct, array_like=True, tag="ready"):
    """Sent once the core is built: the facts the front end cannot know before."""

    max_model_len: int
    num_blocks: int
    block_size: int
    dtype: str
    device: str
    pid: int


class EngineCoreFailed(msgspec.Struct, array_like=True, tag="failed"):
    """The core could not be built (start-up) or a step failed beyond containment (dead)."""

    message: str
    traceback: str = ""
    at_start: bool = False


class EngineCoreEvent(msgspec.Struct, array_like=True, tag="event"):
    """Something an observer asked the core for, outside the step's outputs (a dashboard
    picture): `kind` names it, `payload` is plain data."""

    kind: str
    payload: dict[str, Any]


Message = (
    EngineCoreRequest
    | EngineCoreOutputs
    | AbortRequests
    | UtilityCall
    | UtilityResult
    | Shutdown
    | EngineCoreReady
    | EngineCoreFailed
    | EngineCoreEvent
)


class Codec:
    """msgpack for everything that crosses a process boundary; one decoder for all."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Message)

    def encode(self, msg: Message) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, data: bytes) -> Message:
        return self._decoder.decode(data)
