"""Turns one row of logits per sampled request into one token per row, for the whole batch.

Order of operations (HF's and vLLM's): penalties on the raw logits, then temperature, then
top-k, top-p and min-p masks, then the draw. Everything runs in fp32 and is vectorised over
the batch; only seeded rows get a Python loop, because each must draw from its own generator.

Random rows use the exponential race: with q_i ~ Exp(1) independent, argmax_i p_i / q_i is
distributed exactly as Categorical(p). It needs no cumulative sum or searchsorted, works on
unnormalised masked rows, and each row consumes a fixed amount of randomness (one draw per
vocab entry) from its generator — so a seeded row's token depends only on its own logits and
its own generator, never on which other requests share the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Protocol

import torch

from pagemill.runtime.sampling_params import SamplingParams, SamplingType


class SamplingState(Protocol):
    """What the sampler needs of a request (the engine builds and owns one per request)."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Logprob of the sampled token per row; None when no row asked for logprobs.
    logprobs: list[float] | None
    # Per row, the top-n (token, logprob) pairs when that row's params.logprobs is set.
    top_logprobs: list[list[tuple[int, float]] | None]


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one seeded request, on the device its logits live on."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def _exponential(
    shape: tuple[int, ...], gen: torch.Generator, device: torch.device
) -> torch.Tensor:
    """Exp(1) noise drawn from `gen`, on `device` (drawn where the generator lives, then moved)."""
    # -log(U) with U uniform in (0, 1] is Exp(1); on CPU it is ~3x faster than exponential_.
    noise = torch.empty(shape, dtype=torch.float32, device=gen.device)
    noise.uniform_(generator=gen)
    noise = torch.log1p(noise.neg_()).neg_()
    # A draw of exactly 0 (u = 0 happens: millions of draws per step) would turn p / q into
    # inf, or NaN for a masked p = 0, and argmax would pick it; the clamp keeps masked
    # tokens at 0 and changes nothing else measurable.
    noise.clamp_min_(torch.finfo(torch.float32).tiny)
    return noise.to(device, non_blocking=True)


class Sampler:
    """Stateless apart from the shared generator that unseeded random rows draw from."""

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        gen = self._shared.get(device)
        if gen is None:
            gen = make_generator(self._seed, device)
            self._shared[device] = gen
        return gen

    def __call__(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(
                f"Sampler expects logits [num_rows, vocab] with one row per state, got "
                f"shape {tuple(logits.shape)} for {len(states)} states"
            )
        num_rows = logits.shape[0]
        if num_rows == 0:
            return SamplerOutput(token_ids=[], logprobs=None, top_logprobs=[])
        device = logits.device
        params = [s.params for s in states]
        raw = logits.float()
        x = raw
        if _modifies_in_place(states):
            # `raw` must stay the model's distribution for the logprobs (and the caller's
            # logits must not change), so penalties and masks work on a copy.
            x = raw.clone()
            apply_min_tokens(x, states)
            apply_penalties(x, states)

        types = [p.sampling_type for p in params]
        greedy_rows = [i for i, t in enumerate(types) if t == SamplingType.GREEDY]
        random_rows = [i for i, t in enumerate(types) if t != SamplingType.GREEDY]
        token_ids = torch.empty(num_rows, dtype=torch.long, device=device)

        if greedy_rows:
            if len(greedy_rows) == num_rows:
                token_ids = x.argmax(dim=-1)
            else:
                idx = torch.tensor(greedy_rows, device=device)
                token_ids[idx] = x[idx].argmax(dim=-1)

        if random_rows:
            all_random = len(random_rows) == num_rows
            idx = None if all_random else torch.tensor(random_rows, device=device)
            rp = [params[i] for i in random_rows]
            xr = x if all_random else x[idx]
            temps = torch.tensor([p.temperature for p in rp], dtype=torch.float32, device=device)
            xr = xr / temps.unsqueeze(1)
            xr = apply_top_k_top_p_min_p(xr, rp)
            probs = torch.softmax(xr, dim=-1)
            noise = self._race_noise(probs.shape, [states[i] for i in random_rows], device)
            sampled = (probs / noise).argmax(dim=-1)
            if all_random:
                token_ids = sampled
            else:
                token_ids[idx] = sampled

        ids = token_ids.tolist()
        want = [p.logprobs for p in params]
        if all(n is None for n in want):
            return SamplerOutput(token_ids=ids, logprobs=None, top_logprobs=[None] * num_rows)
        sampled_lp, top_lp = _logprobs(raw, token_ids, want)
        return SamplerOutput(token_ids=ids, logprobs=sampled_lp, top_logprobs=top_lp)

    def _race_noise(
        self, shape: torch.Size, states: Sequence[SamplingState], device: torch.device
    ) -> torch.Tensor:
        vocab = shape[1]
        noise = _exponential(tuple(shape), self._shared_generator(device), device)
        for row, state in enumerate(states):
            seed = state.params.seed
            if seed is None:
                continue
            gen = state.generator
            if gen is None:
                # The engine did not make one: make it once and keep it on the state, so
                # successive steps continue the same stream instead of restarting it.
                gen = make_generator(seed, device)
                state.generator = gen
            noise[row] = _exponential((vocab,), gen, device)
        return noise


def _modifies_in_place(states: Sequence[SamplingState]) -> bool:
    for s in states:
        p = s.params
        if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            return True
        if p.min_tokens and len(s.output_token_ids) < p.min_tokens:
            return True
    return False


def apply_min_tokens(x: torch.Tensor, states: Sequence[SamplingState]) -> None:
    """Until min_tokens are out, stop tokens (and EOS unless ignored) cannot be sampled.

    The scheduler would not stop on them anyway, but they would still be appended to the
    output; masking them here is what makes min_tokens mean "at least n real tokens".
    The EOS id is read from an optional `eos_token_id` attribute of the state.
    """
    rows: list[int] = []
    cols: list[int] = []
    vocab = x.shape[1]
    for i, s in enumerate(states):
        p = s.params
        if len(s.output_token_ids) >= p.min_tokens:
            continue
        banned = set(p.stop_token_ids)
        eos = getattr(s, "eos_token_id", None)
        if eos is not None and not p.ignore_eos:
            banned.update([eos] if isinstance(eos, int) else eos)
        for t in banned:
            if 0 <= t < vocab:
                rows.append(i)
                cols.append(t)
    if rows:
        x[torch.tensor(rows, device=x.device), torch.tensor(cols, device=x.device)] = float("-inf")


def apply_penalties(x: torch.Tensor, states: Sequence[SamplingState]) -> None:
    """Repetition (prompt + output), presence and frequency (output) penalties, in place."""
    params = [s.params for s in states]
    need_rep = any(p.repetition_penalty != 1.0 for p in params)
    need_out = any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params)
    if not (need_rep or need_out):
        return
    num_rows, vocab = x.shape
    device = x.device
    out_counts = _token_counts([s.output_token_ids for s in states], num_rows, vocab, device)
    if need_rep:
        # HF semantics: every token seen in prompt or output is pushed towards zero
        # probability mass: positive logits divided, negative multiplied.
        prompt_counts = _token_counts([s.prompt_token_ids for s in states], num_rows, vocab, device)
        seen = (out_counts > 0) | (prompt_counts > 0)
        rep = torch.tensor(
            [p.repetition_penalty for p in params], dtype=torch.float32, device=device
        ).unsqueeze(1)
        penalised = torch.where(x > 0, x / rep, x * rep)
        x.copy_(torch.where(seen, penalised, x))
    if need_out:
        # OpenAI semantics, on generated tokens only.
        freq = torch.tensor(
            [p.frequency_penalty for p in params], dtype=torch.float32, device=device
        ).unsqueeze(1)
        pres = torch.tensor(
            [p.presence_penalty for p in params], dtype=torch.float32, device=device
        ).unsqueeze(1)
        x.sub_(freq * out_counts + pres * (out_counts > 0).float())


def _token_counts(
    rows: Sequence[Sequence[int]], num_rows: int, vocab: int, device: torch.device
) -> torch.Tensor:
    """[num_rows, vocab] fp32 occurrence counts, built with one flat scatter_add."""
    lengths = [len(r) for r in rows]
    counts = torch.zeros(num_rows * vocab, dtype=torch.float32, device=device)
    total = sum(lengths)
    if total:
        ids = torch.tensor(list(chain.from_iterable(rows)), dtype=torch.long, device=device)
        row_of = torch.repeat_interleave(
            torch.arange(num_rows, device=device),
            torch.tensor(lengths, device=device),
        )
        # Ids the logits have no column for (a tokenizer's added tokens beyond the model's
        # vocab) cannot be penalised; they are dropped rather than failing the whole batch.
        ok = (ids >= 0) & (ids < vocab)
        flat = (row_of * vocab + ids)[ok]
        counts.scatter_add_(0, flat, torch.ones(flat.numel(), device=device))
    return counts.view(num_rows, vocab)


def apply_top_k_top_p_min_p(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Masks (to -inf) what top-k, then top-p, then min-p exclude; HF's order.

    Top-k and top-p need the tokens in descending order, but a full sort of the vocabulary
    is by far the slowest op of a step on CPU, and only the head of the order matters:
    - a top-k row needs its k best tokens;
    - a top-p row (without top-k) can only keep tokens with p_i >= (1 - top_p) / vocab:
      all tokens below that bound hold less than 1 - top_p of the mass together, so the
      ones above it already reach top_p and the cut falls among them.
    So one `topk` over the largest head any row needs replaces the sort (a sort is used
    when that head is a sizeable part of the vocabulary anyway). Top-p acts on what top-k
    kept, renormalised. min-p compares each probability with the row's largest; that
    ratio is unchanged by masking others, so it needs no order at all. The top token
    always survives all three.
    """
    vocab = x.shape[1]
    device = x.device
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    use_k = [k < vocab for k in top_k]
    use_p = [p < 1.0 for p in top_p]
    if any(use_k) or any(use_p):
        top_p_t = torch.tensor(top_p, dtype=torch.float32, device=device).unsqueeze(1)
        head = max([1] + [k for k, u in zip(top_k, use_k) if u])
        if any(use_p):
            probs = torch.softmax(x, dim=-1)
            # Half the bound: a margin against rounding in the sums below.
            bound = (1.0 - top_p_t) / (2 * vocab)
            candidates = (probs >= bound).sum(dim=-1).tolist()
            for i in range(len(params)):
                if use_p[i] and not use_k[i]:
                    head = max(head, int(candidates[i]))
        if head <= vocab // 4:
            _, order = x.topk(head, dim=-1)
        else:
            head = vocab
            _, order = x.sort(dim=-1, descending=True)
        ranks = torch.arange(head, device=device).unsqueeze(0)
        k = torch.tensor(top_k, device=device).unsqueeze(1)
        drop = ranks >= k
        if any(use_p):
            kept = probs.gather(1, order).masked_fill(drop, 0.0)
            # Renormalise over the top-k set (the whole head holds it); rows without top-k
            # renormalise over the whole vocabulary, i.e. not at all.
            use_k_t = torch.tensor(use_k, device=device).unsqueeze(1)
            total = torch.where(use_k_t, kept.sum(dim=-1, keepdim=True), 1.0)
            mass_before = (kept.cumsum(dim=-1) - kept) / total
            # Keep the smallest prefix whose mass reaches p: drop a token once the mass of
            # those ranked above it already reaches p.
            # (Only in top-p rows: with top_p = 1 the rounded sum may still reach 1.0.)
            use_p_t = torch.tensor(use_p, device=device).unsqueeze(1)
            drop |= (mass_before >= top_p_t) & use_p_t
        drop[:, 0] = False
        # Outside the head everything is dropped in filtered rows and kept in the others.
        filtered = torch.tensor([a or b for a, b in zip(use_k, use_p)], device=device)
        mask = filtered.unsqueeze(1).expand(-1, vocab).clone()
        mask.scatter_(1, order, drop)
        x = x.masked_fill(mask, float("-inf"))
    if any(m > 0.0 for m in min_p):
        probs = torch.softmax(x, dim=-1)
        m = torch.tensor(min_p, dtype=torch.float32, device=device).unsqueeze(1)
        threshold = probs.max(dim=-1, keepdim=True).values * m
        x = x.masked_fill(probs < threshold, float("-inf"))
    return x


def _logprobs(
    raw: torch.Tensor, token_ids: torch.Tensor, want: Sequence[int | None]
) -> tuple[list[float], list[list[tuple[int, float]] | None]]:
    """Logprobs of the model's own distribution: log_softmax of the raw logits.

    Taken before penalties, temperature and masks (vLLM's default "raw_logprobs"), so a
    logprob means the same thing whatever sampling options produced the token, and greedy
    and sampled requests report comparable numbers.
    """
    logp = torch.log_softmax(raw, dim=-1)
    sampled = logp.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    max_n = max((n for n in want if n is not None), default=0)
    top: list[list[tuple[int, float]] | None] = [None] * len(want)
    if max_n > 0:
        values, indices = logp.topk(max_n, dim=-1)
        values_l, indices_l = values.tolist(), indices.tolist()
        for i, n in enumerate(want):
            if n is not None:
                top[i] = list(zip(indices_l[i][:n], values_l[i][:n]))
    else:
        top = [[] if n is not None else None for n in want]
    return sampled, top
