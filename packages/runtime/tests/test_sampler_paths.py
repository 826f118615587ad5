"""Sampler code paths: the head race, reused buffers, low-precision logits, untouched inputs."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from pagemill.runtime.sample.sampler import Sampler, apply_top_k_top_p_min_p
from pagemill.runtime.sample.sampling_metadata import SamplingMetadata
from pagemill.runtime.sampling_params import SamplingParams

CHI2_CRIT_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}


def _metadata(
    params: Sequence[SamplingParams], outputs: Sequence[Sequence[int]] | None = None
) -> SamplingMetadata:
    return SamplingMetadata.from_params(
        params,
        output_token_ids=outputs if outputs is not None else [[] for _ in params],
        prompt_token_ids=[[1, 2, 3]] * len(params),
        banned_until_min=[frozenset({0})] * len(params),
    )


def _count_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Counts the calls of Sampler.`name` (to know which code path a batch took)."""
    calls: list[int] = []
    method = getattr(Sampler, name)

    def spy(self: Sampler, *args: object) -> torch.Tensor:
        calls.append(1)
        return method(self, *args)

    monkeypatch.setattr(Sampler, name, spy)
    return calls


def test_sampled_tokens_are_always_kept_by_the_filters(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mixed batches: top-k rows race in their head, the others take the rejection rounds."""
    head_races = _count_calls(monkeypatch, "_race_head")
    nucleus_draws = _count_calls(monkeypatch, "_draw_nucleus")
    vocab, rows = 1024, 96
    g = torch.Generator().manual_seed(3)
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=g))]  # noqa: E731
    params = [
        SamplingParams(
            temperature=pick([0.3, 0.8, 1.5]),
            top_k=pick([0, 3, 40]),
            top_p=pick([1.0, 0.5, 0.9]),
            min_p=pick([0.0, 0.02, 0.3]),
            seed=pick([None, r]),
        )
        for r in range(rows)
    ]
    params = [p if p.top_k or p.top_p < 1 or p.min_p else SamplingParams(top_k=5) for p in params]
    md = _metadata(params)
    temperature = md.temperature.unsqueeze(1)
    sampler = Sampler(seed=1)
    for scale in (8, 8, 1, 1, 0.2):  # peaked to flat
        logits = torch.randn(rows, vocab, generator=g) * scale
        kept = apply_top_k_top_p_min_p(
            logits / temperature, md.top_k, md.top_p, md.min_p, md.max_top_k
        ) != float("-inf")
        tokens = torch.tensor(sampler(logits, md).sampled_token_ids)
        assert kept[torch.arange(rows), tokens].all()
    assert len(head_races) >= 5
    assert len(nucleus_draws) == 5


# A narrow head (6 tokens that matter in a vocabulary of 1000): the head race, where
# unseeded rows draw noise for the head only and seeded rows keep their head's share of a
# whole-vocabulary draw.
HEAD = torch.tensor([2.0, 1.4, 1.0, 0.3, -0.2, -1.0])


@pytest.mark.parametrize(
    ("kwargs", "races"),
    [
        ({"top_p": 0.8}, 0),  # no top-k: the rejection rounds (`_draw_nucleus`)
        ({"min_p": 0.3}, 0),
        ({"top_k": 3}, 1),
        ({"top_k": 4, "top_p": 0.9, "min_p": 0.2}, 1),
    ],
)
@pytest.mark.parametrize("seeded", [False, True])
def test_head_race_follows_the_filtered_distribution(
    kwargs: dict,
    races: int,
    seeded: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    head_races = _count_calls(monkeypatch, "_race_head")
    vocab, temperature = 1000, 0.9
    row = torch.full((vocab,), -30.0)
    positions = torch.tensor([17, 900, 3, 512, 256, 64])
    row[positions] = HEAD
    n = 2000 if seeded else 20000
    params = [
        SamplingParams(temperature=temperature, seed=i if seeded else None, **kwargs)
        for i in range(n)
    ]
    md = _metadata(params)
    out = Sampler(seed=4)(row.repeat(n, 1), md)
    counts = torch.bincount(torch.tensor(out.sampled_token_ids), minlength=vocab).float()
    first = [None if t is None else t[:1] for t in (md.top_k, md.top_p, md.min_p)]
    masked = apply_top_k_top_p_min_p((row / temperature).unsqueeze(0), *first, md.max_top_k)
    probs = torch.softmax(masked[0], dim=-1)
    kept = int((probs > 0).sum())
    assert 1 < kept < len(HEAD)
    assert counts[probs == 0].sum() == 0
    chi2 = float((((counts - probs * n) ** 2)[probs > 0] / (probs * n)[probs > 0]).sum())
    assert chi2 < CHI2_CRIT_001[kept - 1]
    assert head_races == [1] * races


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_caller_logits_are_not_modified(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 300, generator=g) * 3).to(dtype)
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=2),
        SamplingParams(temperature=0.8, top_k=10, min_tokens=3, presence_penalty=1.0),
        SamplingParams(temperature=1.0, top_p=0.7, frequency_penalty=0.5, seed=1),
        SamplingParams(temperature=1.0, min_p=0.1),
    ]
    Sampler()(logits, _metadata(params, outputs=[[0, 1, 2]] * 4))
    assert torch.equal(logits, before)


def _deterministic_params(rows: int) -> list[SamplingParams]:
    kinds = [
        lambda i: SamplingParams(temperature=0.0, frequency_penalty=0.7),
        lambda i: SamplingParams(temperature=0.9, top_k=8, seed=i),
        lambda i: SamplingParams(temperature=1.0, seed=i, repetition_penalty=1.3),
        lambda i: SamplingParams(temperature=0.7, top_p=0.9, min_tokens=5, seed=i),
    ]
    return [kinds[i % len(kinds)](i) for i in range(rows)]


def test_reused_buffers_follow_the_batch_size() -> None:
    vocab = 400
    g = torch.Generator().manual_seed(1)
    sizes = [12, 5, 9, 1]
    logits = {n: torch.randn(n, vocab, generator=g) * 3 for n in sizes}
    outputs = [[i % vocab, (7 * i) % vocab] for i in range(max(sizes))]
    reused = Sampler()
    for n in sizes:
        params = _deterministic_params(n)
        got = reused(logits[n], _metadata(params, outputs[:n]))
        want = Sampler()(logits[n], _metadata(params, outputs[:n]))
        assert got.sampled_token_ids == want.sampled_token_ids


def test_low_precision_logits_sample_like_their_fp32_values() -> None:
    vocab = 400
    g = torch.Generator().manual_seed(2)
    low = (torch.randn(16, vocab, generator=g) * 3).to(torch.bfloat16)
    params = _deterministic_params(16)
    params[0] = SamplingParams(temperature=0.0, logprobs=3)
    outputs = [[3, 4]] * 16
    got = Sampler()(low, _metadata(params, outputs))
    want = Sampler()(low.float(), _metadata(params, outputs))
    assert got.sampled_token_ids == want.sampled_token_ids
    assert got.logprob_token_ids == want.logprob_token_ids
    assert got.logprobs is not None and want.logprobs is not None
    for a, b in zip(got.logprobs, want.logprobs):
        assert a == pytest.approx(b, abs=1e-5)


def test_works_inside_and_outside_inference_mode() -> None:
    """The reused buffers are made on the first call; the next may be in the other mode."""
    md = _metadata([SamplingParams(temperature=0.0, presence_penalty=1.0)] * 2, [[1], [2]])
    sampler = Sampler()
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(0))
    outside = Sampler()(logits, md).sampled_token_ids
    with torch.inference_mode():
        assert sampler(logits.clone(), md).sampled_token_ids == outside
    assert sampler(logits, md).sampled_token_ids == outside


def test_bf16_rows_read_in_place_draw_like_their_fp32_values() -> None:
    """Without logprobs, bf16 logits are not converted (the native CPU passes read them):
    greedy, top-k, top-p, min-p and plain rows still draw what their fp32 values draw."""
    vocab = 3000
    g = torch.Generator().manual_seed(8)
    low = (torch.randn(10, vocab, generator=g) * 3).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=20, seed=1),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.8, seed=2),
        SamplingParams(temperature=0.9, top_p=0.9, seed=3),
        SamplingParams(temperature=1.2, min_p=0.05, seed=4),
        SamplingParams(temperature=0.8, seed=5),
    ] * 2
    params = params[:10]
    for _ in range(3):
        got = Sampler()(low, _metadata(params, [[1]] * 10)).sampled_token_ids
        want = Sampler()(low.float(), _metadata(params, [[1]] * 10)).sampled_token_ids
        assert got == want
        assert got[0] == int(low[0].float().argmax())
        low = low.roll(7, dims=1)
