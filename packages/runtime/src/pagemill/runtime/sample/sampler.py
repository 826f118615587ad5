"""Turns one row of logits per sampled request into one token per row, for the whole batch.

The sampler reads only a `SamplingMetadata` (tensors and a few host scalars), never requests,
so a model runner can keep those tensors across steps and hand over slices of them.

Order of operations (HF's and vLLM's): logit_bias, allowed_token_ids, min_tokens and
bad-words bans and penalties on the raw logits, then the grammar's token bitmask (structured
output), then temperature, then top-k, top-p and min-p, then the draw. Everything runs in
fp32 and is vectorised over the batch; Python loops only over seeded rows (each draws from
its own generator), min_tokens rows, bad-words rows and penalised rows (each appends its
new tokens to its `TokenHistory`, the arrays penalties read).

On CPU, logit_bias and the penalties are one native pass (`_penalize_native`) that writes
the fp32 copy the rest reads, touching only the ids each row has seen or biased, with the
torch path's arithmetic op for op (`apply_penalties` serves elsewhere). The bans that follow
only write -inf, which no bias or penalty moves, so running them after is the same result.

Random rows are drawn by inverse CDF in token-id order: one float64 uniform per row (a
seeded row's from its own generator), the first token whose running sum of unnormalised
probabilities exceeds u x the row's sum (block sums, then the block's own running sum). It
needs no noise per vocab entry and no sort, and because the order is the token ids, a
seeded row's token depends only on its own logits and generator, never on which requests
share the batch.

Rows without top-k (plain temperature, top-p, min-p) are drawn from their whole row by the
row kernels (`row_kernels`: native C++ on CPU, else compiled at start-up by
`Sampler.compile` or eager torch), top-p by rejection rounds instead of a sort
(`Sampler._draw_nucleus`). Top-k rows draw among their k best tokens (`_filter_head`,
`_race_head`), selected by the native kernels where they read the logits, else by `topk`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagemill.kernels import sampler_cpu
from pagemill.runtime.sample.row_kernels import RowKernels
from pagemill.runtime.sample.sampling_metadata import (
    SamplingMetadata,
    TokenHistory,
    make_generator,
)

__all__ = [
    "Sampler",
    "SamplerOutput",
    "apply_penalties",
    "apply_token_bitmask",
    "apply_top_k_top_p_min_p",
    "make_generator",
]

_TINY = torch.finfo(torch.float32).tiny
_CUT_MARGIN = 1e-4


@dataclass
class SamplerOutput:
    sampled_token_ids: list[int]
    """One per row."""
    logprob_token_ids: list[list[int]] | None
    """Per row: [sampled, top-1, ..., top-n], n = max_num_logprobs; None when no row asked."""
    logprobs: list[list[float]] | None
    """Same shape: the raw model logprobs of those ids."""


class _Scratch:
    """Per-device [rows, vocab] fp32 buffers, reused from step to step.

    A fresh [256, 49152] fp32 tensor is 50 MB, which glibc serves with a new mmap every time:
    on a 2-core CPU its page faults cost ~12 ms, more than the arithmetic done in it. Buffers
    only grow; each name is used for one thing at a time.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.device], torch.Tensor] = {}

    def get(self, name: str, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        buf = self._buffers.get((name, device))
        if buf is None or buf.numel() < rows * cols:
            buf = torch.empty(rows * cols, dtype=torch.float32, device=device)
            self._buffers[(name, device)] = buf
        return buf[: rows * cols].view(rows, cols)


class Sampler:
    """Stateless apart from the shared generator that unseeded random rows draw from."""

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}
        self._scratch = _Scratch()
        self._kernels = RowKernels()

    def compile(
        self,
        vocab: int,
        device: torch.device | str = "cpu",
        dtypes: tuple[torch.dtype, ...] = (torch.float32,),
    ) -> float:
        """Compile the whole-row kernels for logits of `vocab` columns and these dtypes;
        returns seconds. Logits of other dtypes (fp32 copies of rows with penalties or
        bans, when the model's are bf16), and all logits until then or if compiling
        fails, run the same kernels eagerly."""
        return self._kernels.compile(vocab, torch.device(device), dtypes)

    @property
    def compiled(self) -> bool:
        return self._kernels.compiled

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        gen = self._shared.get(device)
        if gen is None:
            gen = make_generator(self._seed, device)
            self._shared[device] = gen
        return gen

    # Always in inference mode: the reused buffers are then always inference tensors, which
    # may only be updated in place inside it, whether or not the caller's step is.
    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != metadata.num_rows:
            raise ValueError(
                f"Sampler expects logits [num_rows, vocab] with one row per metadata row, got "
                f"shape {tuple(logits.shape)} for {metadata.num_rows} rows"
            )
        num_rows, vocab = logits.shape
        if num_rows == 0:
            return SamplerOutput(sampled_token_ids=[], logprob_token_ids=None, logprobs=None)
        raw = logits
        kernels = self._kernels
        if logits.dtype != torch.float32 and (
            _needs_fp32(metadata, kernels.native_reads(logits)) or not kernels.serves(logits)
        ):
            # Converted once into a reused buffer: on CPU, torch's argmax, topk and division
            # are several times slower on bf16 than on fp32 (the conversion is exact). The
            # native and compiled row kernels read their dtype as it is, so batches only
            # they serve skip it.
            raw = self._scratch.get("raw", num_rows, vocab, logits.device).copy_(logits)
        # A converted copy is the sampler's own: bans and penalties may go into it unless
        # the logprobs still need the raw values.
        x = self._apply_min_tokens_and_penalties(
            raw, metadata, in_place=raw is not logits and metadata.max_num_logprobs is None
        )
        tokens = kernels.argmax(x) if metadata.all_greedy else self._sample(x, metadata)
        sampled = tokens.tolist()
        if metadata.max_num_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled, logprob_token_ids=None, logprobs=None)
        aux = self._scratch.get("aux", num_rows, vocab, logits.device)
        ids, values = _logprobs(raw, tokens, metadata.max_num_logprobs, aux)
        return SamplerOutput(sampled_token_ids=sampled, logprob_token_ids=ids, logprobs=values)

    def _apply_min_tokens_and_penalties(
        self, logits: torch.Tensor, md: SamplingMetadata, *, in_place: bool
    ) -> torch.Tensor:
        """The logits to sample from: `logits` itself, or with bans and penalties applied.

        Into a copy unless `in_place`: the raw logits stay the model's distribution for the
        logprobs, and the caller's logits must not change. The copy goes into a reused buffer.
        """
        num_rows, vocab = logits.shape
        rows, cols = _min_tokens_bans(md, vocab)
        if md.bad_words_token_ids:
            _bad_words_bans(md, vocab, rows, cols)
        bias, bitmask, allowed = md.logit_bias, md.token_bitmask, md.allowed_token_ids
        if md.no_penalties and not rows and bias is None and bitmask is None and allowed is None:
            return logits
        native = (bias is not None or not md.no_penalties) and self._kernels.native_reads(logits)
        x = logits
        if native:
            # One native pass: the copy (converted from bf16) with bias and penalties
            # applied while each row is in cache. Before the bans below, unlike the torch
            # order: a ban writes -inf, which no bias or penalty moves, and the allowed
            # ids keep their (penalised) values either way, so the result is the same.
            if not (in_place and logits.dtype == torch.float32):
                x = self._scratch.get("rules", num_rows, vocab, logits.device)
            _penalize_native(logits, x, md)
        elif not in_place:
            x = self._scratch.get("rules", num_rows, vocab, logits.device).copy_(logits)
        if bias is not None and not native:
            x.index_put_((bias.rows, bias.token_ids), bias.values, accumulate=True)
        if allowed is not None:
            # The allowed entries are saved, their rows masked whole, the entries put back:
            # O(rows with a list x vocab), and nothing for the other rows.
            keep = x[allowed.pair_rows, allowed.pair_ids]
            x.index_fill_(0, allowed.rows, float("-inf"))
            x[allowed.pair_rows, allowed.pair_ids] = keep
        if rows:
            device = logits.device
            x[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = float("-inf")
        if not native:
            apply_penalties(x, md)
        if bitmask is not None:
            apply_token_bitmask(x, bitmask)
        return x

    def _sample(self, x: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Tokens of a batch with random rows: top-k rows race in their head (`topk`), the
        other random rows are drawn from their whole row by the row kernels (with rejection
        rounds for top-p), greedy rows argmax."""
        num_rows, vocab = x.shape
        random = None if md.all_random else ~_required(md.greedy, "greedy")
        with_k = None if md.top_k is None else (md.top_k > 0) & (md.top_k < vocab)
        if with_k is not None and not bool(with_k.any()):
            with_k = None
        # An argmax over every row reads the logits once and copies nothing; picking the
        # greedy rows out first would copy them. Random rows' results are overwritten.
        tokens = self._kernels.argmax(x) if random is not None else None
        groups: list[tuple[torch.Tensor | None, bool]]
        if with_k is None:
            groups = [(random, False)]
        elif random is None:
            groups = [(with_k, True), (~with_k, False)]
        else:
            groups = [(with_k & random, True), (~with_k & random, False)]
        for mask, is_top_k in groups:
            rows = None if mask is None else mask.nonzero().squeeze(1)
            if rows is not None and rows.numel() == 0:
                continue
            if rows is not None and rows.numel() == num_rows:
                rows = None
            if is_top_k:
                drawn = self._sample_rows(x, md, rows)
            else:
                drawn = self._draw_nucleus(x, rows, md)
            if rows is None:
                tokens = drawn
            else:
                if tokens is None:
                    tokens = torch.empty(num_rows, dtype=torch.long, device=x.device)
                tokens[rows] = drawn
        assert tokens is not None
        return tokens

    def _sample_rows(
        self, x: torch.Tensor, md: SamplingMetadata, rows: torch.Tensor | None
    ) -> torch.Tensor:
        """Random tokens for top-k `rows` of `x` (every row when None), in that order."""

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return t if rows is None or t is None else t.index_select(0, rows)

        vocab = x.shape[1]
        count = x.shape[0] if rows is None else rows.numel()
        gens = _generators_of(md.generators, rows)
        top_k = _required(pick(md.top_k), "top_k")
        # Every row here has a top-k, so the head is the k best whatever top-p and min-p
        # do after it (see `_filter_head`): selected natively from the logits, no scaled
        # copy of the rows and no topk over it.
        width = md.max_top_k if 0 < md.max_top_k < vocab else int(top_k.max())
        if width <= vocab // 4 and self._kernels.native_reads(x):
            t_rows = _required(pick(md.temperature), "temperature")
            best = self._kernels.topk(x, rows, t_rows, width)
            head, _ = _filter_head(
                x, top_k, pick(md.top_p), pick(md.min_p), md.max_top_k, None, presorted=best
            )
            return self._race_head(head, gens, vocab)
        z = self._scratch.get("scaled", count, vocab, x.device)
        temperature = md.temperature.unsqueeze(1)
        if rows is None:
            torch.div(x, temperature, out=z)
        else:
            torch.div(_take_rows(x, rows), temperature.index_select(0, rows), out=z)
        return self._race_filtered(z, top_k, pick(md.top_p), pick(md.min_p), md.max_top_k, gens)

    def _race_filtered(
        self,
        z: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor | None,
        min_p: torch.Tensor | None,
        max_top_k: int,
        gens: dict[int, torch.Generator],
    ) -> torch.Tensor:
        """Tokens of top-k rows (with their top-p and min-p); `z` is theirs to modify."""
        vocab = z.shape[1]
        head, _ = _filter_head(z, top_k, top_p, min_p, max_top_k, None)
        if head.order.shape[1] < vocab:
            return self._race_head(head, gens, vocab)
        # A head as wide as the vocabulary (it was sorted): mask the rows in place and
        # race over them like unfiltered rows, rather than in sorted order with
        # [rows, vocab] index and weight tensors on the side.
        z.masked_fill_(_head_mask(head, None, vocab), float("-inf"))
        return self._race_full(z, gens)

    def _draw_nucleus(
        self, x: torch.Tensor, rows: torch.Tensor | None, md: SamplingMetadata
    ) -> torch.Tensor:
        """Tokens of random `rows` of `x` (all when None) without top-k, drawn from their
        whole rows after top-p and min-p: rejection sampling, as FlashInfer's top-p
        sampling does, with no sort and no [rows, vocab] result.

        A round draws a token s among the candidates (at first the whole row) by inverse
        CDF: block sums from the row kernels, then a running sum inside the chosen block.
        Both filters keep a prefix of the ranking (larger logits first, equal ones by
        smaller token id: a sort's order): min-p keeps s iff its probability reaches
        min_p of the largest, top-p iff the mass ranked above s is below top_p of the
        row's mass (HF's order: top-p measures the whole row, min-p applies after it).
        That mass is what the next round's candidates weigh, the tokens ranked above s,
        so one `block_sums` per round both tests a draw and prepares the next. A rejected
        s cannot be kept, nor anything ranked below it; accepted draws follow the filtered
        distribution exactly (the conditional of a draw on its acceptance). Rounds, draws
        and uniforms (a seeded row's from its own generator) depend only on the row
        itself, never on its batch.
        """
        vocab = x.shape[1]
        count = x.shape[0] if rows is None else rows.numel()

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return t if rows is None or t is None else t.index_select(0, rows)

        device = x.device
        temperature = _required(pick(md.temperature), "temperature")
        top_p, min_p = pick(md.top_p), pick(md.min_p)
        gens = _generators_of(md.generators, rows)
        kernels = self._kernels
        peak, sums = kernels.first_round(x, rows, temperature)
        thr_z = torch.full((count,), float("-inf"), device=device)
        thr_id = torch.full((count,), vocab, dtype=torch.long, device=device)
        limit = None
        if top_p is not None:
            limit = sums.double().sum(dim=-1) * top_p.double()
            limit = torch.where(top_p < 1.0, limit, float("inf"))
        tokens = torch.empty(count, dtype=torch.long, device=device)
        active = torch.arange(count, device=device)  # positions still drawing
        act_rows = rows  # their rows in x (None: all rows, in order)
        while True:
            a_gens = gens if active.numel() == count else _generators_of(gens, active)
            u = self._uniforms(active.numel(), a_gens, device)
            t_a, peak_a = temperature[active], peak[active]
            s = kernels.pick(x, act_rows, sums, u, t_a, peak_a, thr_z[active], thr_id[active])
            if limit is None and min_p is None:
                tokens[active] = s
                break
            x_rows = x if act_rows is None else x[act_rows]
            zs = x_rows.gather(1, s.unsqueeze(1)).squeeze(1).float() / t_a
            ok = torch.ones_like(s, dtype=torch.bool)
            if min_p is not None:
                ok &= torch.exp(zs - peak_a) >= min_p[active]
            above = None
            if limit is not None:
                above = kernels.block_sums(x, act_rows, t_a, peak_a, zs, s)
                ok &= above.double().sum(dim=-1) < limit[active]
            tokens[active[ok]] = s[ok]
            rejected = ~ok
            if not bool(rejected.any()):
                break
            if above is None:
                r_rows = active[rejected] if rows is None else rows[active[rejected]]
                sums = kernels.block_sums(
                    x, r_rows, t_a[rejected], peak_a[rejected], zs[rejected], s[rejected]
                )
            else:
                sums = above[rejected]
            # Nothing ranked above a rejected s: s is its row's best token, which both
            # filters keep whatever their values (a top_p that is 0.0 in fp32, a min_p of
            # 1.0 an ulp off the peak). Without this such a row would draw forever.
            best = sums.sum(dim=-1) == 0
            if bool(best.any()):
                tokens[active[rejected][best]] = s[rejected][best]
                rejected[rejected.clone()] = ~best
                sums = sums[~best]
                if not bool(rejected.any()):
                    break
            active = active[rejected]
            thr_z[active], thr_id[active] = zs[rejected], s[rejected]
            act_rows = active if rows is None else rows[active]
        return tokens

    def _uniforms(
        self, rows: int, gens: dict[int, torch.Generator], device: torch.device
    ) -> torch.Tensor:
        """[rows] float64 uniforms in [0, 1): one per row, a seeded row's from its own
        generator (so its token depends on its own logits and stream only)."""
        u = torch.empty(rows, dtype=torch.float64, device=device)
        if len(gens) < rows:
            gen = self._shared_generator(device)
            u.copy_(torch.rand(rows, dtype=torch.float64, generator=gen, device=gen.device))
        for pos, gen in gens.items():
            u[pos] = torch.rand(1, dtype=torch.float64, generator=gen, device=gen.device)[0]
        return u

    def _race_full(self, z: torch.Tensor, gens: dict[int, torch.Generator]) -> torch.Tensor:
        """A draw from softmax over whole rows of `z` (scaled, maybe masked logits), in place."""
        # Unnormalised probabilities are enough; masked tokens get exactly 0.
        weights = z.sub_(z.amax(dim=-1, keepdim=True)).exp_()
        return _inverse_cdf(weights, self._uniforms(z.shape[0], gens, z.device))

    def _race_head(self, head: _Head, gens: dict[int, torch.Generator], vocab: int) -> torch.Tensor:
        weights = head.rel_probs.masked_fill_(head.drop, 0.0)
        # In token-id order, as a whole-row draw orders them: a seeded row then draws the
        # same token from a head of any width (its batch decides the width) or from a row.
        order, perm = head.order.sort(dim=-1)
        weights = weights.gather(1, perm)
        u = self._uniforms(weights.shape[0], gens, weights.device)
        return order.gather(1, _inverse_cdf(weights, u).unsqueeze(1)).squeeze(1)


_BLOCK = 256


def _take_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` of a [rows, vocab] tensor: `t` itself when that is all of them in order.

    Advanced indexing, not index_select: on this CPU build index_select copies a [64, 49152]
    fp32 tensor ~5x slower (measured 100 vs 20 ms on 2 busy cores).
    """
    if rows.numel() == t.shape[0] and bool(
        (rows == torch.arange(t.shape[0], device=rows.device)).all()
    ):
        return t
    return t[rows]


def _needs_fp32(md: SamplingMetadata, native: bool) -> bool:
    """Whether low-precision logits are converted before sampling: greedy rows and top-k
    rows (torch's argmax and topk, unless the native kernels read the logits) and logprobs
    are faster on fp32; the row kernels read any dtype."""
    torch_ops = not native and (not md.all_random or md.top_k is not None)
    return torch_ops or md.max_num_logprobs is not None


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[rows] column drawn from each row of `weights` (>= 0, unnormalised, at least one > 0)
    with probability weight / row sum: the first column whose running sum exceeds u x sum.

    One uniform per row instead of one noise value per column (generating and dividing by
    those was most of a random row's cost). Sums are float64: the row is cut into blocks of
    `_BLOCK` columns, the block sums' running sum finds the block, the block's own running
    sum the column; a column of weight 0 is never chosen.
    """
    rows, cols = weights.shape
    nb = -(-cols // _BLOCK)
    if nb * _BLOCK != cols:
        padded = weights.new_zeros(rows, nb * _BLOCK)
        padded[:, :cols] = weights
        weights = padded
    blocks = weights.view(rows, nb, _BLOCK)
    cum = blocks.sum(dim=-1).double().cumsum_(dim=-1)  # [rows, nb]
    target = (u * cum[:, -1]).unsqueeze(1)
    b = torch.searchsorted(cum, target, right=True)
    # Rounding may put the target at the very end: the last block with any weight.
    idx = torch.arange(nb, device=weights.device)
    last_b = torch.where(
        cum > torch.cat([cum.new_zeros(rows, 1), cum[:, :-1]], dim=1), idx, 0
    ).amax(dim=-1, keepdim=True)
    b = torch.minimum(b, last_b)
    before = torch.where(b > 0, cum.gather(1, (b - 1).clamp_min(0)), 0.0)
    inner = blocks.gather(1, b.unsqueeze(2).expand(rows, 1, _BLOCK)).squeeze(1)
    icum = inner.to(torch.float64).cumsum(dim=-1)
    j = torch.searchsorted(icum, target - before, right=True)
    cols_in = torch.arange(_BLOCK, device=weights.device)
    last_j = torch.where(inner > 0, cols_in, 0).amax(dim=-1, keepdim=True)
    j = torch.minimum(j, last_j)
    return (b * _BLOCK + j).squeeze(1)


def apply_token_bitmask(x: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, every logit whose bit in the packed `bitmask` is clear.

    `bitmask` is [rows, >= ceil(vocab/32)] int32, bit t % 32 of word t // 32 = token t
    allowed (xgrammar's layout). A grammar's mask is mostly whole words: all clear (32
    banned tokens) or all set; only the few mixed words are unpacked bit by bit. That costs
    ~9 ms at 64 x 49152 on one CPU core against ~75 ms for unpacking every word, and is
    plain torch, so it runs wherever the logits are. (xgrammar's own CPU kernel is not
    used: on this build it wrote past the logits of vocabularies that are not a multiple
    of 32 and corrupted the heap.)
    """
    rows, vocab = x.shape
    if bitmask.device != x.device:
        bitmask = bitmask.to(x.device, non_blocking=True)
    shifts = _bit_shifts(x.device)
    full = vocab // 32
    if full:
        body = x[:, : full * 32].view(rows, full, 32)
        words = bitmask[:, :full]
        body.masked_fill_((words == 0).unsqueeze(-1), float("-inf"))
        r, w = ((words != 0) & (words != -1)).nonzero(as_tuple=True)
        if r.numel():
            banned = ((words[r, w].unsqueeze(1) >> shifts) & 1) == 0
            body[r, w] = body[r, w].masked_fill_(banned, float("-inf"))
    tail = vocab - full * 32
    if tail:
        banned = ((bitmask[:, full : full + 1] >> shifts[:tail]) & 1) == 0
        x[:, full * 32 :].masked_fill_(banned, float("-inf"))


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _bit_shifts(device: torch.device) -> torch.Tensor:
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return shifts


def _required(t: torch.Tensor | None, name: str) -> torch.Tensor:
    if t is None:
        raise ValueError(f"SamplingMetadata.{name} is required when the batch is mixed")
    return t


def _generators_of(
    generators: dict[int, torch.Generator], rows: torch.Tensor | None
) -> dict[int, torch.Generator]:
    """The seeded rows among `rows` (ascending), keyed by position in `rows`.

    Looks up each seeded row rather than indexing every row: only seeded rows cost Python.
    """
    if rows is None or not generators:
        return generators
    ids = rows.tolist()
    found: dict[int, torch.Generator] = {}
    for row, gen in generators.items():
        pos = bisect_left(ids, row)
        if pos < len(ids) and ids[pos] == row:
            found[pos] = gen
    return found


def _fill_exponential(out: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Fills `out` with Exp(1) noise from `gen` (drawn where the generator lives)."""
    draw = out if out.device == gen.device else torch.empty(out.shape, device=gen.device)
    # -log(1 - U), U uniform in [0, 1): 1 - U is exact in fp32, and log is ~3x faster than
    # log1p on CPU (and uniform_ + log ~6x faster than exponential_).
    draw.uniform_(generator=gen).neg_().add_(1.0).log_().neg_()
    # A draw of exactly 0 (u = 0 happens: millions of draws per step) would turn p / q into
    # inf, or NaN for a masked p = 0, and argmax would pick it; the clamp keeps masked
    # tokens at 0 and changes nothing else measurable.
    draw.clamp_min_(_TINY)
    if draw is not out:
        out.copy_(draw)
    return out


def _min_tokens_bans(md: SamplingMetadata, vocab: int) -> tuple[list[int], list[int]]:
    """(rows, cols) that cannot be sampled yet: until min_tokens are out, the stop tokens
    (and EOS unless ignored) are masked.

    The scheduler would not stop on them anyway, but they would still be appended to the
    output; masking them here is what makes min_tokens mean "at least n real tokens".
    """
    rows: list[int] = []
    cols: list[int] = []
    for row, (min_tokens, banned) in md.min_tokens.items():
        if len(md.output_token_ids[row]) >= min_tokens:
            continue
        for t in banned:
            if 0 <= t < vocab:
                rows.append(row)
                cols.append(t)
    return rows, cols


def _bad_words_bans(md: SamplingMetadata, vocab: int, rows: list[int], cols: list[int]) -> None:
    """Adds to (rows, cols) the last token of each bad word whose prefix the row has just
    generated (vLLM's bad-words rule: a one-token word is banned at every step).

    Only the output counts, not the prompt: a word the prompt ends with can still be
    completed, as in vLLM.
    """
    for row, words in md.bad_words_token_ids.items():
        out = md.output_token_ids[row]
        n = len(out)
        for word in words:
            k = len(word) - 1
            if k > n or word[-1] >= vocab:
                continue
            if k == 0 or list(out[n - k : n]) == word[:-1]:
                rows.append(row)
                cols.append(word[-1])


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> None:
    """Repetition (prompt + output), presence and frequency (output) penalties, in place.

    A row has seen a few hundred tokens of a vocabulary of tens of thousands, so penalties
    are computed at those (row, token) positions only, never over [rows, vocab]. The ids
    come from the rows' `TokenHistory`s (see `_synced_histories`).
    """
    if md.no_penalties:
        return
    vocab = logits.shape[1]
    histories, use_rep, use_out = _synced_histories(md)
    rep = md.repetition_penalties
    rep_rows = [r for r, on in enumerate(use_rep) if on]
    if rep_rows:
        # HF semantics: every token seen in prompt or output is pushed towards zero
        # probability mass: positive logits divided, negative multiplied.
        seen = [_seen_ids(histories[r]) for r in rep_rows]
        rows, cols, _ = _occurrences(rep_rows, seen, vocab, logits.device)
        values = logits[rows, cols]
        penalty = rep[rows]
        logits[rows, cols] = torch.where(values > 0, values / penalty, values * penalty)
    freq, pres = md.frequency_penalties, md.presence_penalties
    out_rows = [r for r, on in enumerate(use_out) if on]
    if out_rows:
        # OpenAI semantics, on generated tokens only.
        outputs = [_history(histories, r).output_ids for r in out_rows]
        rows, cols, counts = _occurrences(out_rows, outputs, vocab, logits.device)
        logits[rows, cols] = logits[rows, cols] - (freq[rows] * counts + pres[rows])


def _history(histories: list[TokenHistory | None], row: int) -> TokenHistory:
    h = histories[row]
    assert h is not None, "every penalised row has a history"
    return h


def _seen_ids(h: TokenHistory | None) -> np.ndarray:
    assert h is not None, "every penalised row has a history"
    return np.concatenate((h.prompt_ids, h.output_ids))


def _penalize_native(logits: torch.Tensor, out: torch.Tensor, md: SamplingMetadata) -> None:
    """`out` = `logits` with logit_bias and the penalties applied, by the native pass
    (`logits` may be `out`): `apply_penalties`' semantics, bit for bit (see the C++)."""
    lib = sampler_cpu.load()
    assert lib is not None, "only called where the native kernels read the logits"
    num_rows = logits.shape[0]
    keep: list[TokenHistory] = []
    table = None if md.no_penalties else _history_table(md, keep)
    bias = md.logit_bias
    sparse = None if bias is None else bias.by_row(num_rows)
    sampler_cpu.penalize(
        lib,
        logits,
        out,
        md.repetition_penalties,
        md.frequency_penalties,
        md.presence_penalties,
        table,
        sparse,
    )
    del keep  # the histories' arrays stay alive until the pass has read them


def _synced_histories(
    md: SamplingMetadata,
) -> tuple[list[TokenHistory | None], list[bool], list[bool]]:
    """(histories, repetition rows, frequency / presence rows): per penalised row its
    `TokenHistory`, the metadata's own brought up to date by appending new tokens, else a
    new one (kept in the metadata for the next step when the row had none); None in rows
    without a penalty."""
    num_rows = md.num_rows
    kept = md.token_histories
    if kept is None or len(kept) != num_rows:
        kept = md.token_histories = [None] * num_rows
    use_rep: list[bool] = (md.repetition_penalties != 1.0).tolist()
    use_out: list[bool] = (
        (md.frequency_penalties != 0.0) | (md.presence_penalties != 0.0)
    ).tolist()
    prompts = md.prompt_token_ids
    outputs = md.output_token_ids
    histories: list[TokenHistory | None] = [None] * num_rows
    for row in range(num_rows):
        rep = use_rep[row]
        if not (rep or use_out[row]):
            continue
        prompt = _required_list(prompts)[row] if rep else None
        output = outputs[row]
        h = kept[row]
        if h is None or not h.matches(prompt, output):
            fresh = TokenHistory(prompt, output)
            if h is None:
                kept[row] = fresh
            h = fresh
        h.sync()
        histories[row] = h
    return histories, use_rep, use_out


def _history_table(md: SamplingMetadata, keep: list[TokenHistory]) -> torch.Tensor:
    """[rows, 4] int64: per penalised row the address and length of its distinct prompt
    ids (rows with a repetition penalty) and of its output ids (see `_synced_histories`);
    `keep` receives the histories, whose arrays must outlive the native pass."""
    histories, use_rep, _ = _synced_histories(md)
    table = [0] * (4 * md.num_rows)  # a list: item by item, ~10x cheaper than an array
    for row, h in enumerate(histories):
        if h is None:
            continue
        keep.append(h)
        i = 4 * row
        if use_rep[row]:
            table[i] = h.prompt_ptr
            table[i + 1] = h.prompt_ids.size
        table[i + 2] = h.output_ptr
        table[i + 3] = h.num_output
    return torch.tensor(table, dtype=torch.int64).view(md.num_rows, 4)


def _required_list(seqs: list[Sequence[int]] | None) -> list[Sequence[int]]:
    if seqs is None:
        raise ValueError("SamplingMetadata.prompt_token_ids is required by a repetition_penalty")
    return seqs


def _occurrences(
    rows: list[int], seqs: list[np.ndarray], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, token, count) of every distinct token of each row's ids (int64 arrays, one
    per row), counted on the host where the histories live and moved to `device` once."""
    ids = np.concatenate(seqs)
    row_of = np.repeat(np.asarray(rows, dtype=np.int64), [len(s) for s in seqs])
    # Ids the logits have no column for (a tokenizer's added tokens beyond the model's
    # vocab) cannot be penalised; they are dropped rather than failing the whole batch.
    ok = (ids >= 0) & (ids < vocab)
    flat, counts = np.unique(row_of[ok] * vocab + ids[ok], return_counts=True)
    flat_t = torch.from_numpy(flat)
    return (
        (flat_t // vocab).to(device),
        (flat_t % vocab).to(device),
        torch.from_numpy(counts).float().to(device),
    )


@dataclass
class _Head:
    """The best tokens of each row, best first, and which of them the filters drop."""

    order: torch.Tensor
    """[rows, width] token ids."""
    drop: torch.Tensor
    """[rows, width] bool."""
    rel_probs: torch.Tensor
    """[rows, width] fp32: each token's probability divided by its row's largest."""


def _filter_flags(
    top_k: torch.Tensor | None, top_p: torch.Tensor | None, min_p: torch.Tensor | None, vocab: int
) -> torch.Tensor | None:
    """[rows] bool: rows that top-k, top-p or min-p can filter; None when none can."""
    flags = None
    for f in (
        None if top_k is None else (top_k > 0) & (top_k < vocab),
        None if top_p is None else top_p < 1.0,
        None if min_p is None else min_p > 0.0,
    ):
        if f is not None:
            flags = f if flags is None else flags | f
    return flags


def _filter_head(
    z: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    max_top_k: int,
    scratch: torch.Tensor | None,
    width_cap: int | None = None,
    presorted: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[_Head, torch.Tensor | None]:
    """What top-k, then top-p, then min-p keep of each row of `z` (logits / temperature).

    HF's order. Top-k and top-p need the tokens in descending order, but a full sort of the
    vocabulary is by far the slowest op of a step on CPU, and only the head of the order
    matters:
    - a top-k row needs its k best tokens;
    - a top-p row (without top-k) can only keep tokens with p_i >= (1 - top_p) / vocab:
      all tokens below that bound hold less than 1 - top_p of the mass together, so the
      ones above it already reach top_p and the cut falls among them;
    - a min-p row (without top-k) keeps exactly the tokens with p_i >= min_p * max_j p_j.
    So one `topk` over the largest head any row needs replaces the sort (a sort is used
    when that head is a sizeable part of the vocabulary anyway). Top-p acts on what top-k
    kept, renormalised. min-p compares each probability with the row's largest; that
    ratio is unchanged by masking others, so it needs no order at all. The top token
    always survives all three. `scratch` ([rows, vocab] fp32 or None) holds the
    probabilities needed to size the head of rows without top-k.

    Those bounds are loose (a top-p 0.9 nucleus of ~10 tokens can have thousands above
    its bound), and one row's bound sizes every row's head. With `width_cap`, the head
    of rows without top-k is capped, and rows whose filters provably cut inside the capped
    head are done: a top-p row whose head holds top_p of the mass, a min-p row whose last
    head token is below min_p. The rows left over are returned as a mask (None when there
    are none) for a second, uncapped head of their own.

    `presorted` (values, ids): the head of rows that all have a top-k, already selected
    (the `width` best z of each row, best first); `z` is then only read for its shape.
    """
    vocab = z.shape[1]
    use_k: torch.Tensor | None = None
    k: torch.Tensor | None = None
    if top_k is not None:
        use_k = (top_k > 0) & (top_k < vocab)
        k = torch.where(use_k, top_k, vocab)  # vocab: no cut
    use_p = None if top_p is None else top_p < 1.0
    use_m = None if min_p is None else min_p > 0.0
    # Rows whose head is found by counting: filtered by top-p or min-p but not top-k.
    counted = None
    for f in (use_p, use_m):
        if f is not None:
            counted = f if counted is None else counted | f
    if counted is not None and use_k is not None:
        counted = counted & ~use_k
    total = None  # the sum of rel_probs over the whole row, for top-p rows without top-k
    num_candidates = None
    if counted is not None and bool(counted.any()):
        rel = torch.sub(z, z.amax(dim=-1, keepdim=True), out=scratch).exp_()
        total = rel.sum(dim=-1, keepdim=True)
        # Thresholds on rel_probs, halved: a margin against rounding in the sums below
        # (the head only has to contain what the filters keep).
        bound = torch.zeros_like(total)
        if top_p is not None and use_p is not None:
            p_bound = total * (1.0 - top_p.unsqueeze(1)) / (2 * vocab)
            bound = torch.where(use_p.unsqueeze(1), p_bound, bound)
        if min_p is not None:
            bound = torch.maximum(bound, min_p.unsqueeze(1) / 2)
        num_candidates = rel.ge_(bound).sum(dim=-1).long()
        need = torch.where(counted, num_candidates, 1)
        if width_cap is not None:
            need = need.clamp_max(width_cap)
        if use_k is not None and k is not None:
            need = torch.where(use_k, k, need)
        width = int(need.max())
    elif 0 < max_top_k < vocab:
        width = max_top_k
    else:
        width = 1 if use_k is None or k is None else int(torch.where(use_k, k, 1).max())
    if presorted is not None:
        values, order = presorted
        width = values.shape[1]
    elif width <= vocab // 4:
        values, order = z.topk(width, dim=-1)
    else:
        width = vocab
        values, order = z.sort(dim=-1, descending=True)
    rel_probs = (values - values[:, :1]).exp_()
    ranks = torch.arange(width, device=z.device).unsqueeze(0)
    if k is not None:
        drop = ranks >= k.unsqueeze(1)
    else:
        drop = torch.zeros_like(rel_probs, dtype=torch.bool)
    if top_p is not None and use_p is not None:
        kept = rel_probs.masked_fill(drop, 0.0)
        # Renormalise over the top-k set (the head holds it); rows without top-k over the
        # whole vocabulary, i.e. by the sum of the full row.
        head_total = kept.sum(dim=-1, keepdim=True)
        if total is None:
            row_total = head_total
        elif use_k is None:
            row_total = total
        else:
            row_total = torch.where(use_k.unsqueeze(1), head_total, total)
        mass_before = (kept.cumsum(dim=-1) - kept) / row_total
        # Keep the smallest prefix whose mass reaches p: drop a token once the mass of
        # those ranked above it already reaches p.
        # (Only in top-p rows: with top_p = 1 the rounded sum may still reach 1.0.)
        drop |= (mass_before >= top_p.unsqueeze(1)) & use_p.unsqueeze(1)
    drop[:, 0] = False
    if min_p is not None:
        drop |= rel_probs < min_p.unsqueeze(1)
    head = _Head(order=order, drop=drop, rel_probs=rel_probs)
    if num_candidates is None or counted is None or width == vocab:
        return head, None
    wider = counted & (num_candidates > width)
    if not bool(wider.any()):
        return head, None
    # The cut is inside the head if the tokens after it are dropped whatever they are: in
    # a top-p row once the head's mass reaches top_p, in a min-p row once the head's last
    # token is below min_p. With a margin far above the rounding (fp32 sums of a head in
    # different orders differ by ~width x 6e-8), so the capped and the uncapped heads agree.
    cut_inside = torch.zeros_like(wider)
    if total is not None and top_p is not None and use_p is not None:
        head_mass = rel_probs.sum(dim=-1) / total.squeeze(1)
        cut_inside |= use_p & (head_mass >= top_p + _CUT_MARGIN)
    if min_p is not None and use_m is not None:
        cut_inside |= use_m & (rel_probs[:, -1] < min_p * (1.0 - _CUT_MARGIN))
    wider &= ~cut_inside
    return head, wider if bool(wider.any()) else None


def _head_mask(head: _Head, filtered: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """[rows, vocab] bool, True where a filter drops the token.

    Outside the head everything is dropped in filtered rows (every row when `filtered` is
    None) and kept in the others.
    """
    num_rows = head.order.shape[0]
    if filtered is None:
        mask = torch.ones(num_rows, vocab, dtype=torch.bool, device=head.order.device)
    else:
        mask = filtered.unsqueeze(1).expand(-1, vocab).clone()
    return mask.scatter_(1, head.order, head.drop)


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    max_top_k: int,
) -> torch.Tensor:
    """`logits` (already divided by the temperature) with what the filters drop set to -inf.

    The sampler's filters as one mask over the vocabulary (the sampler itself races within
    the head when it can); the arguments are `SamplingMetadata`'s fields for these rows.
    """
    vocab = logits.shape[1]
    filtered = _filter_flags(top_k, top_p, min_p, vocab)
    if filtered is None:
        return logits
    z = logits.float()
    head, _ = _filter_head(z, top_k, top_p, min_p, max_top_k, None)
    return z.masked_fill(_head_mask(head, filtered, vocab), float("-inf"))


def _logprobs(
    raw: torch.Tensor, tokens: torch.Tensor, n: int, scratch: torch.Tensor
) -> tuple[list[list[int]], list[list[float]]]:
    """[sampled, top-1, ..., top-n] ids per row and their logprobs in the model's own
    distribution: log_softmax of the raw (fp32) logits.

    Taken before penalties, temperature and masks (vLLM's default "raw_logprobs"), so a
    logprob means the same thing whatever sampling options produced the token, and greedy
    and sampled requests report comparable numbers. Only the row's log-normaliser needs the
    whole row (into `scratch`, no [rows, vocab] result); the wanted entries are gathered.
    """
    peak = raw.amax(dim=-1, keepdim=True)
    log_total = torch.sub(raw, peak, out=scratch).exp_().sum(dim=-1, keepdim=True).log_()
    ids = tokens.unsqueeze(1)
    if n > 0:
        ids = torch.cat([ids, raw.topk(n, dim=-1).indices], dim=1)
    values = (raw.gather(1, ids) - peak) - log_total
    return ids.tolist(), values.tolist()
