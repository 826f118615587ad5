"""What the sampler knows of a step's sampled rows: tensors, plus a few host scalars.

The sampler never sees requests or `SamplingParams`. A model runner that keeps one row per
running request in preallocated arrays (`SamplingColumns`) hands the sampler slices of them,
built once per change of the batch, so a decode step costs no per-request Python to
describe. The host scalars (`all_greedy`, `max_top_k`, ...) are what the sampler must know
to choose its code path without reading the tensors back from the device.

There is one set of rules, here: `SamplingColumns.set_row` turns one request's
`SamplingParams` into its row of numbers, and `SamplingMetadata.build` turns rows into the
metadata. The model runner's input batch calls both; `from_params` (tests, simple
callers) is the same two steps over a list of params.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from pagemill.runtime.sampling_params import SamplingParams


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one seeded request, on the device its logits live on."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


class TokenHistory:
    """One request's tokens as the native penalty pass reads them: its distinct prompt ids
    and its output ids, in int64 arrays at fixed addresses.

    Penalties need every token a row has seen at every step. Converting the token lists
    whole each step is Python work per token (most of the penalties' cost at large
    batches); this record is made once per request and `sync` appends only what the
    output gained since the last step. It is bound to the sequence objects it was made
    from: a row whose output is another sequence (a verified draft's history) gets a
    history of its own (`matches`).
    """

    __slots__ = ("_buf", "_n", "output", "output_ptr", "prompt", "prompt_ids", "prompt_ptr")

    def __init__(self, prompt: Sequence[int] | None, output: Sequence[int]) -> None:
        self.prompt = prompt
        self.output = output
        ids = np.zeros(0, dtype=np.int64)
        if prompt is not None and len(prompt):
            ids = np.unique(np.fromiter(prompt, np.int64, len(prompt)))
        self.prompt_ids = ids
        self.prompt_ptr = ids.ctypes.data if ids.size else 0
        self._buf = np.zeros(max(16, 2 * len(output)), dtype=np.int64)
        self.output_ptr = self._buf.ctypes.data
        self._n = 0

    @property
    def output_ids(self) -> np.ndarray:
        """The output as of the last `sync`."""
        return self._buf[: self._n]

    @property
    def num_output(self) -> int:
        return self._n

    def matches(self, prompt: Sequence[int] | None, output: Sequence[int]) -> bool:
        return output is self.output and (prompt is None or prompt is self.prompt)

    def sync(self) -> int:
        """Append the output's new tokens; returns the output's length."""
        out = self.output
        m = len(out)
        n = self._n
        if m == n:
            return m
        if m < n:  # never happens to a request's output; rebuilt rather than wrong
            n = 0
        if m > self._buf.size:
            buf = np.zeros(2 * m, dtype=np.int64)
            buf[:n] = self._buf[:n]
            self._buf = buf
            self.output_ptr = buf.ctypes.data
        self._buf[n:m] = out[n:m]
        self._n = m
        return m


@dataclass(frozen=True, slots=True)
class LogitBias:
    """Sparse (row, token id, bias) triples, one per biased token of each row."""

    rows: torch.Tensor
    """[N] int64."""
    token_ids: torch.Tensor
    """[N] int64."""
    values: torch.Tensor
    """[N] fp32."""

    def by_row(self, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(offsets [num_rows + 1], token ids, values) on the host, row r's biases at
        offsets[r] .. offsets[r + 1] (what the native pass reads)."""
        rows, ids, values = self.rows.cpu(), self.token_ids.cpu(), self.values.cpu()
        if rows.numel() > 1 and not bool((rows[1:] >= rows[:-1]).all()):
            order = rows.argsort(stable=True)
            rows, ids, values = rows[order], ids[order], values[order]
        counts = torch.bincount(rows, minlength=num_rows)
        return torch.cat([counts.new_zeros(1), counts.cumsum(0)]), ids, values

    @classmethod
    def from_rows(
        cls, biases: Sequence[Mapping[int, float] | None], device: torch.device | str = "cpu"
    ) -> LogitBias | None:
        rows: list[int] = []
        ids: list[int] = []
        values: list[float] = []
        for row, bias in enumerate(biases):
            if bias:
                rows += [row] * len(bias)
                ids += bias.keys()
                values += bias.values()
        if not rows:
            return None
        return cls(
            torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(ids, dtype=torch.int64, device=device),
            torch.tensor(values, dtype=torch.float32, device=device),
        )


@dataclass(frozen=True, slots=True)
class AllowedTokens:
    """Rows that may only sample some ids (vLLM's allowed_token_ids), as sparse pairs."""

    rows: torch.Tensor
    """[A] int64: the rows with a list (each once)."""
    pair_rows: torch.Tensor
    """[P] int64."""
    pair_ids: torch.Tensor
    """[P] int64: (pair_rows[i], pair_ids[i]) may be sampled."""

    @classmethod
    def from_rows(
        cls, allowed: Sequence[Sequence[int] | None], device: torch.device | str = "cpu"
    ) -> AllowedTokens | None:
        rows: list[int] = []
        pair_rows: list[int] = []
        pair_ids: list[int] = []
        for row, ids in enumerate(allowed):
            if ids:
                rows.append(row)
                pair_rows += [row] * len(ids)
                pair_ids += ids
        if not rows:
            return None

        def t(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return cls(t(rows), t(pair_rows), t(pair_ids))


@dataclass(slots=True)
class SamplingColumns:
    """The per-row numbers of the metadata, one NumPy array per field (row i = request i).

    A runner keeps one of these at its batch's capacity and writes a row per admitted
    request (`set_row`); `take` cuts out the rows of a step.
    """

    temperature: np.ndarray
    """float32; 1.0 in greedy rows (never read there: the value only keeps them finite)."""
    greedy: np.ndarray
    """bool: temperature below SAMPLING_EPS."""
    top_p: np.ndarray
    """float32, 1.0 = off."""
    top_k: np.ndarray
    """int64, 0 = off."""
    min_p: np.ndarray
    """float32, 0.0 = off."""
    presence: np.ndarray
    """float32."""
    frequency: np.ndarray
    """float32."""
    repetition: np.ndarray
    """float32, 1.0 = off."""
    num_logprobs: np.ndarray
    """int64, -1 = no logprobs asked."""

    @classmethod
    def empty(cls, num_rows: int) -> SamplingColumns:
        """`num_rows` rows of neutral values (greedy off, every filter and penalty off)."""
        return cls(
            temperature=np.ones(num_rows, dtype=np.float32),
            greedy=np.zeros(num_rows, dtype=np.bool_),
            top_p=np.ones(num_rows, dtype=np.float32),
            top_k=np.zeros(num_rows, dtype=np.int64),
            min_p=np.zeros(num_rows, dtype=np.float32),
            presence=np.zeros(num_rows, dtype=np.float32),
            frequency=np.zeros(num_rows, dtype=np.float32),
            repetition=np.ones(num_rows, dtype=np.float32),
            num_logprobs=np.full(num_rows, -1, dtype=np.int64),
        )

    @classmethod
    def of(cls, params: Sequence[SamplingParams]) -> SamplingColumns:
        columns = cls.empty(len(params))
        for row, p in enumerate(params):
            columns.set_row(row, p)
        return columns

    def set_row(self, row: int, p: SamplingParams) -> None:
        """Row `row` holds `p`'s numbers (the one place they are derived from params)."""
        greedy = p.is_greedy
        self.greedy[row] = greedy
        self.temperature[row] = 1.0 if greedy else p.temperature
        self.top_p[row] = p.top_p
        self.top_k[row] = p.top_k
        self.min_p[row] = p.min_p
        self.presence[row] = p.presence_penalty
        self.frequency[row] = p.frequency_penalty
        self.repetition[row] = p.repetition_penalty
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs

    def take(self, rows: slice | np.ndarray) -> SamplingColumns:
        """The selected rows, in that order (a slice gives views, an index array copies)."""
        return SamplingColumns(*(getattr(self, f.name)[rows] for f in fields(self)))

    def close_gap(self, row: int, num_rows: int) -> None:
        """Move rows row+1 .. num_rows-1 up by one (row `row` is dropped)."""
        for f in fields(self):
            a = getattr(self, f.name)
            a[row : num_rows - 1] = a[row + 1 : num_rows]

    def __len__(self) -> int:
        return len(self.temperature)


@dataclass
class SamplingMetadata:
    """One row per sampled request, in the order of the logits rows."""

    temperature: torch.Tensor
    """[R] fp32. Greedy rows hold 1.0, never read: `greedy` / `all_greedy` decide."""
    greedy: torch.Tensor | None
    """[R] bool, rows sampled by argmax; None when all_greedy or all_random."""
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None
    """[R] fp32; None when no random row uses top-p (filters never act on greedy rows)."""
    top_k: torch.Tensor | None
    """[R] int64, 0 = off (so is any value >= the vocabulary); None when no random row
    uses top-k."""
    min_p: torch.Tensor | None
    """[R] fp32; None when no random row uses min-p."""
    max_top_k: int
    """Largest top_k of a random row (0 if none): sizes the topk head without reading
    `top_k` back."""
    generators: dict[int, torch.Generator]
    """Row -> that request's own generator (seeded random rows); other random rows share
    one."""
    no_penalties: bool
    presence_penalties: torch.Tensor
    """[R] fp32."""
    frequency_penalties: torch.Tensor
    """[R] fp32."""
    repetition_penalties: torch.Tensor
    """[R] fp32."""
    prompt_token_ids: list[Sequence[int]] | None
    """Per row; only needed (and then required) when some row has repetition_penalty != 1."""
    output_token_ids: list[Sequence[int]]
    """Per row, read-only views of the requests' generated tokens."""
    min_tokens: dict[int, tuple[int, frozenset[int]]]
    """Row -> (min_tokens, ids banned until that many tokens are out), for rows with
    min_tokens > 0. The banned ids are the stop ids, and EOS unless ignore_eos."""
    max_num_logprobs: int | None
    """Top-n logprobs computed for every row; None when no row wants logprobs."""
    logit_bias: LogitBias | None = None
    """Biases added to the raw logits (OpenAI's logit_bias); None when no row has any."""
    token_bitmask: torch.Tensor | None = None
    """[R, ceil(V/32)] int32, bit `t % 32` of word `t // 32` set = token t allowed (the
    grammar of a structured-output row; unconstrained rows are all ones). Filled per step
    by the structured-output manager; None when no row is constrained."""
    allowed_token_ids: AllowedTokens | None = None
    """Rows restricted to some ids (vLLM's allowed_token_ids); None when no row is."""
    bad_words_token_ids: dict[int, list[list[int]]] = field(default_factory=dict)
    """Row -> its bad words' token sequences, for rows with bad_words (checked against the
    row's output each step: the prefix is on the host, in `output_token_ids`)."""
    token_histories: list[TokenHistory | None] | None = None
    """Per row, its request's `TokenHistory` for the native penalty pass (made by the
    sampler at first use where the builder had none: then kept here, so sampling with
    the same metadata again appends only new tokens); None when no row has a penalty."""

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def build(
        cls,
        columns: SamplingColumns,
        params: Sequence[SamplingParams],
        *,
        output_token_ids: Sequence[Sequence[int]],
        prompt_token_ids: Sequence[Sequence[int]] | None,
        generators: Mapping[int, torch.Generator] | None = None,
        banned_until_min: Sequence[frozenset[int]] | None = None,
        token_bitmask: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
        token_histories: Sequence[TokenHistory | None] | None = None,
    ) -> SamplingMetadata:
        """The metadata of R rows: `columns` (R rows, as `SamplingColumns.set_row` wrote
        them from `params[i]`) plus what is not a number.

        `generators` maps rows to their request's own generator; a seeded random row
        without one gets one here, kept in the returned metadata (sampling with the same
        metadata again continues its stream). `banned_until_min[row]` adds ids (EOS, unless
        the request ignores it) to the row's own `stop_token_ids` as what cannot be sampled
        before `min_tokens`. `prompt_token_ids` are required when a row has a repetition
        penalty (and dropped otherwise). `token_histories[row]`, kept by the caller across
        steps, spares the penalties reading the row's whole history each step (it must
        have been made from the very sequences passed as the row's prompt and output).
        """
        num_rows = len(params)
        for name, rows in (
            ("columns", columns),
            ("output_token_ids", output_token_ids),
            ("prompt_token_ids", prompt_token_ids),
            ("banned_until_min", banned_until_min),
            ("token_histories", token_histories),
        ):
            if rows is not None and len(rows) != num_rows:
                raise ValueError(f"{name} has {len(rows)} rows for {num_rows} params")
        greedy = columns.greedy
        # Filters of greedy rows never act, so only random rows decide which are in use.
        random = ~greedy
        all_greedy = not bool(random.any())
        all_random = num_rows > 0 and not bool(greedy.any())
        top_k_random = columns.top_k[random]
        use_rep = bool((columns.repetition != 1.0).any())
        if use_rep and prompt_token_ids is None:
            raise ValueError("prompt_token_ids are required when a row has a repetition_penalty")

        def tensor(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)

        gens = {row: g for row, g in (generators or {}).items() if not greedy[row]}
        min_tokens: dict[int, tuple[int, frozenset[int]]] = {}
        bad_words: dict[int, list[list[int]]] = {}
        any_allowed = False
        for row, p in enumerate(params):
            if p.bad_words_token_ids:
                bad_words[row] = p.bad_words_token_ids
            any_allowed = any_allowed or p.allowed_token_ids is not None
            if p.seed is not None and row not in gens and not greedy[row]:
                gens[row] = make_generator(p.seed, device)
            if p.min_tokens > 0:
                extra = banned_until_min[row] if banned_until_min is not None else frozenset()
                min_tokens[row] = (p.min_tokens, frozenset(p.stop_token_ids) | extra)
        num_logprobs = int(columns.num_logprobs.max(initial=-1))
        no_penalties = not (use_rep or columns.presence.any() or columns.frequency.any())
        return cls(
            temperature=tensor(columns.temperature),
            greedy=None if all_greedy or all_random else tensor(greedy),
            all_greedy=all_greedy,
            all_random=all_random,
            top_p=tensor(columns.top_p) if bool((columns.top_p[random] < 1.0).any()) else None,
            top_k=tensor(columns.top_k) if bool((top_k_random > 0).any()) else None,
            min_p=tensor(columns.min_p) if bool((columns.min_p[random] > 0.0).any()) else None,
            max_top_k=int(top_k_random.max(initial=0)),
            generators=gens,
            no_penalties=no_penalties,
            presence_penalties=tensor(columns.presence),
            frequency_penalties=tensor(columns.frequency),
            repetition_penalties=tensor(columns.repetition),
            prompt_token_ids=list(prompt_token_ids)
            if use_rep and prompt_token_ids is not None
            else None,
            output_token_ids=list(output_token_ids),
            min_tokens=min_tokens,
            max_num_logprobs=None if num_logprobs < 0 else num_logprobs,
            logit_bias=LogitBias.from_rows([p.logit_bias for p in params], device),
            token_bitmask=token_bitmask,
            allowed_token_ids=AllowedTokens.from_rows([p.allowed_token_ids for p in params], device)
            if any_allowed
            else None,
            bad_words_token_ids=bad_words,
            token_histories=None if no_penalties else list(token_histories or [None] * num_rows),
        )

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        *,
        output_token_ids: Sequence[Sequence[int]],
        prompt_token_ids: Sequence[Sequence[int]] | None,
        generators: Mapping[int, torch.Generator] | None = None,
        banned_until_min: Sequence[frozenset[int]] | None = None,
        token_bitmask: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        """The metadata of `params`, one row each, built from scratch: `build` over
        `SamplingColumns.of(params)` (see `build` for the arguments)."""
        return cls.build(
            SamplingColumns.of(params),
            params,
            output_token_ids=output_token_ids,
            prompt_token_ids=prompt_token_ids,
            generators=generators,
            banned_until_min=banned_until_min,
            token_bitmask=token_bitmask,
            device=device,
        )
