"""Verifies draft tokens against the target model's own distribution (speculative decoding).

A request that proposed drafts d_1..d_k gets k + 1 logit rows in one step: row j (the output
at the token before d_j) is the target's distribution p_j for d_j's position, and the last row
(the "bonus" row, after d_k) is what an ordinary step would sample from. Every proposer here
drafts deterministically (prompt lookup, a draft model's argmax), so the draft distribution
q_j is one-hot on d_j, and standard speculative rejection sampling (Leviathan et al., Chen et
al.) becomes:

- greedy rows: accept d_j while it is the target's argmax; the first mismatch is replaced by
  the argmax (the "correction" token); with all k accepted, the bonus row's argmax follows.
- random rows: accept d_j with probability min(1, p_j(d_j) / q_j(d_j)) = p_j(d_j); on the
  first rejection draw from the normalised residual max(p_j - q_j, 0), i.e. p_j without d_j,
  and stop; with all k accepted, the bonus token is a plain draw from the last row.

Each emitted token then follows the target's distribution exactly, given the tokens before
it. p_j is the sampler's own: logit bias and allowed ids, temperature, then top-k, top-p and
min-p (`apply_top_k_top_p_min_p`), and a grammar's token bitmask: the engine fills one
mask per draft row from the grammar's state after the drafts before it
(`StructuredOutputManager.grammar_bitmasks`), so a draft the grammar forbids has p_j = 0
and is always replaced. Rules that depend on the tokens generated so far (penalties, bad
words, min_tokens) see each row's own history, the drafts before it included
(`with_draft_history`).

Randomness: a seeded request draws its 2k uniforms (k acceptance tests, k residual draws) in
one call on its own generator, in that fixed order, whatever the batch; the others share this
sampler's generator. With the same seed and the same drafts a request's tokens repeat.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from pagemill.runtime.sample.sampler import Sampler, _logprobs, apply_top_k_top_p_min_p
from pagemill.runtime.sample.sampling_metadata import SamplingMetadata, make_generator


def with_draft_history(
    metadata: SamplingMetadata,
    draft_metadata: SamplingMetadata,
    indices: Sequence[int],
    draft_token_ids: Sequence[Sequence[int]],
) -> tuple[SamplingMetadata, SamplingMetadata]:
    """The step's metadata with each verified position's own history: draft row j of a
    request has its output plus drafts 0..j-1, its bonus row its output plus every draft.

    Penalties, bad words and min_tokens read a row's output (`output_token_ids`), so with
    these histories each position is masked and penalised exactly as a one-token step
    that had emitted the drafts before it would be. Unchanged (the same objects) when no
    row has such a rule."""
    md = draft_metadata
    if md.no_penalties and not md.min_tokens and not md.bad_words_token_ids:
        return metadata, draft_metadata
    outputs = list(metadata.output_token_ids)
    draft_outputs: list[Sequence[int]] = []
    for i, drafts in zip(indices, draft_token_ids):
        seen = list(outputs[i])
        draft_outputs += [seen + list(drafts[:j]) for j in range(len(drafts))]
        outputs[i] = seen + list(drafts)
    return (
        replace(metadata, output_token_ids=outputs),
        replace(draft_metadata, output_token_ids=draft_outputs),
    )


class RejectionSampler:
    def __init__(self, sampler: Sampler, seed: int = 0) -> None:
        self.sampler = sampler
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        gen = self._shared.get(device)
        if gen is None:
            # Not the sampler's stream: the tokens of unseeded rows need no tie to it.
            gen = self._shared[device] = make_generator(self._seed + 1, device)
        return gen

    @torch.inference_mode()
    def __call__(
        self,
        draft_logits: torch.Tensor,
        metadata: SamplingMetadata,
        draft_token_ids: Sequence[Sequence[int]],
        bonus_token_ids: Sequence[int],
    ) -> list[list[int]]:
        """Per request (with at least one draft): its accepted drafts plus one token.

        `draft_logits` [sum(k_i), vocab] are the rows verifying the drafts, request after
        request in order, and `metadata` has one row per draft row (each request's own
        sampling parameters repeated k_i times, its generator shared by its rows).
        `bonus_token_ids` are the tokens the plain sampler drew from each request's last row.
        """
        counts = [len(d) for d in draft_token_ids]
        total = sum(counts)
        if draft_logits.dim() != 2 or draft_logits.shape[0] != total or metadata.num_rows != total:
            raise ValueError(
                f"RejectionSampler: {tuple(draft_logits.shape)} logits and "
                f"{metadata.num_rows} metadata rows for {total} draft tokens"
            )
        if len(bonus_token_ids) != len(counts):
            raise ValueError("RejectionSampler: one bonus token per request is needed")
        if total == 0:
            return [[b] for b in bonus_token_ids]
        device = draft_logits.device
        raw = draft_logits.float()
        # Bias and allowed ids; the engine keeps history-dependent rules off these rows.
        x = self.sampler._apply_min_tokens_and_penalties(raw, metadata, in_place=False)
        drafts = torch.tensor([t for d in draft_token_ids for t in d], device=device)
        target = x.argmax(dim=-1)
        # Per draft row: accepted? and the token that replaces it if not.
        accepted = target == drafts
        replacement = target
        if not metadata.all_greedy:
            random_rows = (
                torch.arange(total, device=device)
                if metadata.greedy is None
                else (~metadata.greedy).nonzero().squeeze(1)
            )
            ok, residual = self._verify_random(x, metadata, drafts, random_rows, counts)
            accepted = accepted.clone()
            replacement = replacement.clone()
            accepted[random_rows] = ok
            replacement[random_rows] = residual
        accepted_l = accepted.tolist()
        replacement_l = replacement.tolist()
        out: list[list[int]] = []
        row = 0
        for drafts_i, bonus in zip(draft_token_ids, bonus_token_ids):
            tokens: list[int] = []
            for j, d in enumerate(drafts_i):
                if not accepted_l[row + j]:
                    tokens.append(replacement_l[row + j])
                    break
                tokens.append(d)
            else:
                tokens.append(bonus)
            out.append(tokens)
            row += len(drafts_i)
        return out

    @torch.inference_mode()
    def logprobs(
        self,
        draft_logits: torch.Tensor,
        metadata: SamplingMetadata,
        draft_token_ids: Sequence[Sequence[int]],
        results: Sequence[Sequence[int]],
    ) -> list[list[tuple[list[int], list[float]]]]:
        """Per request, the logprob rows of its emitted tokens that came from draft rows
        (accepted drafts and a correction; a bonus token's row is the plain sampler's):
        [emitted id, top-1 id, ...] and their logprobs in the target's raw distribution at
        that position, as the sampler reports them for a one-token step."""
        n = metadata.max_num_logprobs
        assert n is not None
        emitted: list[int] = []
        for drafts, result in zip(draft_token_ids, results):
            # Rows past the first rejection are never reported; their draft stands in.
            emitted += [result[j] if j < len(result) else d for j, d in enumerate(drafts)]
        if not emitted:
            return [[] for _ in results]
        raw = draft_logits.float()
        tokens = torch.tensor(emitted, device=raw.device)
        ids, values = _logprobs(raw, tokens, n, torch.empty_like(raw))
        out: list[list[tuple[list[int], list[float]]]] = []
        row = 0
        for drafts, result in zip(draft_token_ids, results):
            m = min(len(result), len(drafts))
            out.append(list(zip(ids[row : row + m], values[row : row + m])))
            row += len(drafts)
        return out

    def _verify_random(
        self,
        x: torch.Tensor,
        md: SamplingMetadata,
        drafts: torch.Tensor,
        rows: torch.Tensor,
        counts: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For the random rows `rows` of `x`: whether each draft is accepted, and a draw
        from its residual distribution (used only at the first rejection)."""
        z = x.index_select(0, rows) / md.temperature.index_select(0, rows).unsqueeze(1)

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.index_select(0, rows)

        z = apply_top_k_top_p_min_p(z, pick(md.top_k), pick(md.top_p), pick(md.min_p), md.max_top_k)
        probs = torch.softmax(z, dim=-1, dtype=torch.float64)
        d = drafts.index_select(0, rows)
        p_draft = probs.gather(1, d.unsqueeze(1)).squeeze(1)
        u_accept, u_residual = self._uniforms(md, rows, counts, x.device)
        ok = u_accept < p_draft
        residual = probs.scatter(1, d.unsqueeze(1), 0.0)
        # A draft holding all the mass is always accepted, so its empty residual is unused.
        empty = residual.sum(dim=-1) <= 0
        residual[empty, 0] = 1.0
        cdf = residual.cumsum(dim=-1)
        target = (u_residual * cdf[:, -1]).unsqueeze(1)
        token = torch.searchsorted(cdf, target, right=True).squeeze(1)
        # Never a zero-probability id (rounding at the top end of the cdf).
        token = torch.minimum(token, (residual > 0).cumsum(dim=-1).argmax(dim=-1))
        return ok, token

    def _uniforms(
        self, md: SamplingMetadata, rows: torch.Tensor, counts: list[int], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Two float64 uniforms per random draft row: a seeded request's 2k in one draw on
        its own generator (acceptance tests first), the others from the shared stream."""
        n = rows.numel()
        ids = rows.tolist()
        accept = torch.empty(n, dtype=torch.float64, device=device)
        resid = torch.empty(n, dtype=torch.float64, device=device)
        # The request of each draft row (a request's rows are consecutive), then the
        # positions in `rows` of each request's random rows.
        owner = [req for req, c in enumerate(counts) for _ in range(c)]
        by_req: dict[int, list[int]] = {}
        for pos, r in enumerate(ids):
            by_req.setdefault(owner[r], []).append(pos)
        shared = self._shared_generator(device)
        for positions in by_req.values():
            gen = md.generators.get(ids[positions[0]], shared)
            k = len(positions)
            u = torch.rand(2 * k, dtype=torch.float64, generator=gen, device=gen.device)
            idx = torch.tensor(positions, device=device)
            accept[idx] = u[:k].to(device)
            resid[idx] = u[k:].to(device)
        return accept, resid
