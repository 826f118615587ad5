"""What the sampler knows of a step's sampled rows: tensors, plus a few host scalars.

The sampler never sees requests or `SamplingParams`. A model runner that keeps one row per
running request in preallocated arrays hands the sampler slices of them, built once per
change of the batch, so a decode step costs no per-request Python to describe. The host
scalars (`all_greedy`, `max_top_k`, ...) are what the sampler must know to choose its code
path without reading the tensors back from the device.

`from_params` builds the same thing from scratch, for tests and simple callers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from pagemill.runtime.sampling_params import SamplingParams, SamplingType


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one seeded request, on the device its logits live on."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


@dataclass(frozen=True, slots=True)
class LogitBias:
    """Sparse (row, token id, bias) triples, one per biased token of each row."""

    rows: torch.Tensor
    """[N] int64."""
    token_ids: torch.Tensor
    """[N] int64."""
    values: torch.Tensor
    """[N] fp32."""

    @classmethod
    def from_rows(cls, biases: Sequence[Mapping[int, float] | None],
                  device: torch.device | str = "cpu") -> LogitBias | None:
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
        return cls(torch.tensor(rows, dtype=torch.int64, device=device),
                   torch.tensor(ids, dtype=torch.int64, device=device),
                   torch.tensor(values, dtype=torch.float32, device=device))


@dataclass
class SamplingMetadata:
    """One row per sampled request, in the order of the logits rows."""

    temperature: torch.Tensor
    """[R] fp32. Greedy rows may hold any value: `greedy` / `all_greedy` decide."""
    greedy: torch.Tensor | None
    """[R] bool, rows sampled by argmax; None when all_greedy or all_random."""
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None
    """[R] fp32; None when no row uses top-p (every value 1.0)."""
    top_k: torch.Tensor | None
    """[R] int64, 0 = off (so is any value >= the vocabulary); None when no row uses top-k."""
    min_p: torch.Tensor | None
    """[R] fp32; None when no row uses min-p."""
    max_top_k: int
    """Largest top_k in use (0 if none): sizes the topk head without reading `top_k` back."""
    generators: dict[int, torch.Generator]
    """Row -> that request's own generator (seeded rows); other random rows share one."""
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

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        *,
        output_token_ids: Sequence[Sequence[int]],
        prompt_token_ids: Sequence[Sequence[int]] | None,
        generators: dict[int, torch.Generator] | None = None,
        banned_until_min: Sequence[frozenset[int]] | None = None,
        token_bitmask: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        """The metadata of `params`, one row each, built from scratch.

        A seeded random row without a generator in `generators` gets one here, kept in the
        returned metadata: sampling with the same metadata again continues its stream.
        `banned_until_min[row]` adds ids (EOS, unless the caller ignores it) to the row's
        own `stop_token_ids` as what cannot be sampled before `min_tokens`.
        """
        num_rows = len(params)
        for name, rows in (
            ("output_token_ids", output_token_ids),
            ("prompt_token_ids", prompt_token_ids),
            ("banned_until_min", banned_until_min),
        ):
            if rows is not None and len(rows) != num_rows:
                raise ValueError(f"{name} has {len(rows)} rows for {num_rows} params")
        greedy = [p.sampling_type == SamplingType.GREEDY for p in params]
        # Filters of greedy rows never act, so only random rows decide which are in use.
        random = [p for p, g in zip(params, greedy) if not g]
        use_rep = any(p.repetition_penalty != 1.0 for p in params)
        if use_rep and prompt_token_ids is None:
            raise ValueError("prompt_token_ids are required when a row has a repetition_penalty")

        def column(
            values: list[float] | list[int] | list[bool], dtype: torch.dtype
        ) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        gens = dict(generators or {})
        for row, p in enumerate(params):
            if p.sampling_type == SamplingType.RANDOM_SEED and row not in gens:
                assert p.seed is not None
                gens[row] = make_generator(p.seed, device)
        min_tokens: dict[int, tuple[int, frozenset[int]]] = {}
        for row, p in enumerate(params):
            if p.min_tokens > 0:
                extra = banned_until_min[row] if banned_until_min is not None else frozenset()
                min_tokens[row] = (p.min_tokens, frozenset(p.stop_token_ids) | extra)
        want = [p.logprobs for p in params if p.logprobs is not None]
        all_greedy = all(greedy)
        all_random = bool(params) and not any(greedy)
        return cls(
            temperature=column([p.temperature for p in params], torch.float32),
            greedy=None if all_greedy or all_random else column(greedy, torch.bool),
            all_greedy=all_greedy,
            all_random=all_random,
            top_p=(
                column([p.top_p for p in params], torch.float32)
                if any(p.top_p < 1.0 for p in random)
                else None
            ),
            top_k=(
                column([p.top_k for p in params], torch.int64)
                if any(p.top_k > 0 for p in random)
                else None
            ),
            min_p=(
                column([p.min_p for p in params], torch.float32)
                if any(p.min_p > 0.0 for p in random)
                else None
            ),
            max_top_k=max((p.top_k for p in random), default=0),
            generators=gens,
            no_penalties=not use_rep
            and all(p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 for p in params),
            presence_penalties=column([p.presence_penalty for p in params], torch.float32),
            frequency_penalties=column([p.frequency_penalty for p in params], torch.float32),
            repetition_penalties=column([p.repetition_penalty for p in params], torch.float32),
            prompt_token_ids=None
            if prompt_token_ids is None or not use_rep
            else list(prompt_token_ids),
            output_token_ids=list(output_token_ids),
            min_tokens=min_tokens,
            max_num_logprobs=max(want) if want else None,
            logit_bias=LogitBias.from_rows([p.logit_bias for p in params], device),
            token_bitmask=token_bitmask,
        )
