"""Synthetic serving workloads: length distributions, Poisson arrivals, shared system prompts.

Everything is drawn from one ``random.Random(seed)`` so a workload is a pure function of its
spec: the two systems compared in a simulation see the very same requests at the very same
virtual times. Prompt tokens are random ids (distinct across requests, so only the shared
system prompt can hit the prefix cache).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

DISTRIBUTIONS = ("fixed", "uniform", "lognormal", "exponential")


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution with a mean, clipped to ``[minimum, maximum]``.

    ``uniform`` spans mean * (1 ± spread); ``lognormal`` has sigma = ``spread`` (heavy tail, the
    shape of chat datasets such as ShareGPT); ``exponential`` is the memoryless extreme.
    """

    mean: int
    kind: str = "lognormal"
    spread: float = 0.6
    minimum: int = 1
    maximum: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in DISTRIBUTIONS:
            raise ValueError(
                f"length distribution must be one of {DISTRIBUTIONS}, got {self.kind!r}"
            )
        if self.mean < 1 or self.minimum < 1:
            raise ValueError(
                f"mean and minimum lengths must be >= 1, got {self.mean}, {self.minimum}"
            )
        if self.maximum is not None and self.maximum < self.minimum:
            raise ValueError(f"maximum length {self.maximum} is below the minimum {self.minimum}")
        if self.spread < 0:
            raise ValueError(f"spread must be >= 0, got {self.spread}")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = float(self.mean)
        elif self.kind == "uniform":
            lo = self.mean * (1 - min(self.spread, 1.0))
            hi = self.mean * (1 + min(self.spread, 1.0))
            value = rng.uniform(lo, hi)
        elif self.kind == "lognormal":
            sigma = self.spread
            value = rng.lognormvariate(math.log(self.mean) - sigma * sigma / 2, sigma)
        else:
            value = rng.expovariate(1.0 / self.mean)
        n = max(self.minimum, round(value))
        return n if self.maximum is None else min(n, self.maximum)


@dataclass(frozen=True)
class WorkloadSpec:
    """``request_rate`` in requests per virtual second; ``inf`` sends everything at t = 0."""

    num_requests: int = 200
    prompt_len: LengthDist = LengthDist(256)
    output_len: LengthDist = LengthDist(256)
    request_rate: float = math.inf
    system_prompt_len: int = 0
    system_prompt_fraction: float = 1.0
    vocab_size: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not self.request_rate > 0:
            raise ValueError(
                f"request_rate must be > 0 (inf = all at once), got {self.request_rate}"
            )
        if self.system_prompt_len < 0:
            raise ValueError(f"system_prompt_len must be >= 0, got {self.system_prompt_len}")
        if not 0 <= self.system_prompt_fraction <= 1:
            raise ValueError("system_prompt_fraction must be in [0, 1]")
        if self.vocab_size < 2:
            raise ValueError("vocab_size must be >= 2")


@dataclass(frozen=True)
class SimRequest:
    """One synthetic request: its prompt ids, how many tokens it will generate, when it arrives."""

    index: int
    request_id: str
    arrival_time: float
    prompt_token_ids: tuple[int, ...]
    output_len: int
    # A chat's later turn: sent no earlier than this request (the turn before) finished.
    after: str | None = None
    # Chat workloads: which shared system prompt the request starts with, whose turn it is.
    group: int | None = None
    user: int | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def generate_workload(spec: WorkloadSpec, max_model_len: int) -> list[SimRequest]:
    """Requests sorted by arrival; prompt + output is clipped to ``max_model_len`` so no request
    is refused for length (the comparison is about scheduling, not validation)."""
    if max_model_len < 2:
        raise ValueError("max_model_len must be >= 2")
    rng = random.Random(spec.seed)
    system = [rng.randrange(spec.vocab_size) for _ in range(spec.system_prompt_len)]
    requests = []
    t = 0.0
    for i in range(spec.num_requests):
        if math.isfinite(spec.request_rate) and i > 0:
            t += rng.expovariate(spec.request_rate)
        use_system = bool(system) and rng.random() < spec.system_prompt_fraction
        prefix = system if use_system else []
        user_len = spec.prompt_len.sample(rng)
        out_len = spec.output_len.sample(rng)
        user_len = min(user_len, max_model_len - 1 - len(prefix))
        if user_len < 1:
            raise ValueError(
                f"system prompt ({len(prefix)} tokens) leaves no room under max_model_len "
                f"({max_model_len})"
            )
        prompt = prefix + [rng.randrange(spec.vocab_size) for _ in range(user_len)]
        out_len = max(1, min(out_len, max_model_len - len(prompt)))
        requests.append(SimRequest(i, f"req-{i}", t, tuple(prompt), out_len))
    return requests


@dataclass(frozen=True)
class ChatSpec:
    """Multi-turn chats on shared documents: ``prefixes`` system prompts of ``prefix_len``
    tokens, ``users_per_prefix`` users on each, every user ``turns`` turns. A turn's prompt is
    the system prompt, the conversation so far (messages and answers) and a new message, so
    a user's later turns share more than the system prompt with the earlier ones; each
    turn's output length is the length of the answer its next turn carries. Users arrive
    in a random order (Poisson at ``request_rate``) and take their turns in order,
    interleaved with the others; a turn is sent when the one before it has finished.
    ``turns=1`` is K system prompts x suffixes."""

    prefixes: int = 6
    prefix_len: int = 400
    users_per_prefix: int = 8
    turns: int = 2
    message_len: LengthDist = LengthDist(24, kind="fixed")
    answer_len: LengthDist = LengthDist(24, kind="fixed")
    request_rate: float = math.inf
    vocab_size: int = 30000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prefixes", "prefix_len", "users_per_prefix", "turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.request_rate > 0:
            raise ValueError(
                f"request_rate must be > 0 (inf = all at once), got {self.request_rate}"
            )
        if self.vocab_size < 11:
            raise ValueError("vocab_size must be > 10")

    @property
    def num_requests(self) -> int:
        return self.prefixes * self.users_per_prefix * self.turns


def generate_chat_workload(spec: ChatSpec, max_model_len: int | None = None) -> list[SimRequest]:
    """Every user's turns in the order they are sent (see `ChatSpec`); refuses a
    conversation that outgrows ``max_model_len`` rather than clipping it (a clipped chat
    would no longer extend its own history)."""
    rng = random.Random(spec.seed)

    def tokens(n: int) -> list[int]:
        # Random ids: distinct documents share no tokens by chance that matters. An answer
        # in the history stands for what the model said on the turn before.
        return [rng.randrange(10, spec.vocab_size) for _ in range(n)]

    systems = [tokens(spec.prefix_len) for _ in range(spec.prefixes)]
    conversations: list[list[tuple[list[int], int]]] = []  # user -> each turn's (prompt, answer)
    owner: list[int] = []
    for p in range(spec.prefixes):
        for _ in range(spec.users_per_prefix):
            history = list(systems[p])
            turns = []
            for _ in range(spec.turns):
                history = history + tokens(spec.message_len.sample(rng))
                answer = spec.answer_len.sample(rng)
                turns.append((history, answer))
                history = history + tokens(answer)
            conversations.append(turns)
            owner.append(p)
    # Interleave: repeatedly pick a user with turns left (a user's turns stay in order).
    left = {u: 0 for u in range(len(conversations))}
    order: list[tuple[int, int]] = []
    while left:
        u = rng.choice(sorted(left))
        order.append((u, left[u]))
        left[u] += 1
        if left[u] == spec.turns:
            del left[u]
    out: list[SimRequest] = []
    t = 0.0
    for i, (u, turn) in enumerate(order):
        if math.isfinite(spec.request_rate) and i > 0:
            t += rng.expovariate(spec.request_rate)
        prompt, answer = conversations[u][turn]
        if max_model_len is not None and len(prompt) + answer > max_model_len:
            raise ValueError(
                f"a chat turn needs {len(prompt) + answer} tokens (prompt and answer), over "
                f"max_model_len {max_model_len}: fewer turns or shorter prompts"
            )
        after = f"u{u}-t{turn - 1}" if turn else None
        out.append(SimRequest(i, f"u{u}-t{turn}", t, tuple(prompt), answer, after, owner[u], u))
    return out
