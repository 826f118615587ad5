"""Sampler randomness: seeded rows ignore their batch; draws follow softmax(logits / T)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from pagemill.runtime.sample.sampler import Sampler
from pagemill.runtime.sample.sampling_metadata import SamplingMetadata, make_generator
from pagemill.runtime.sampling_params import SamplingParams

# Chi-square critical values at p = 0.001 (so a correct sampler fails 1 time in 1000 seeds;
# the seeds here are fixed, so the outcome is deterministic).
CHI2_CRIT_001 = {2: 13.82, 4: 18.47, 7: 24.32}


def _metadata(
    params: Sequence[SamplingParams],
    outputs: Sequence[Sequence[int]] | None = None,
    generators: dict[int, torch.Generator] | None = None,
) -> SamplingMetadata:
    return SamplingMetadata.from_params(
        params,
        output_token_ids=outputs if outputs is not None else [[] for _ in params],
        prompt_token_ids=None,
        generators=generators,
    )


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs * n
    keep = expected > 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


def _seeded_run(
    target: SamplingParams, others: list[SamplingParams], position: int, steps: int
) -> list[int]:
    """Tokens drawn for `target` over several steps, with `others` around it in the batch."""
    vocab = 64
    g = torch.Generator().manual_seed(100)
    step_logits = [torch.randn(vocab, generator=g) for _ in range(steps)]
    params = list(others)
    params.insert(position, target)
    # The metadata lives across steps, as the runner's does: generators continue their streams.
    md = _metadata(params, generators={position: make_generator(target.seed or 0)})
    sampler = Sampler(seed=len(others) * 7 + position)
    noise = torch.Generator().manual_seed(len(others))
    tokens = []
    for logits in step_logits:
        batch = torch.randn(len(params), vocab, generator=noise)
        batch[position] = logits
        out = sampler(batch, md)
        tokens.append(out.sampled_token_ids[position])
    return tokens


def test_seeded_row_is_independent_of_its_batch() -> None:
    target = SamplingParams(temperature=1.3, top_p=0.95, seed=1234)
    alone = _seeded_run(target, [], 0, steps=12)
    crowds = [
        ([SamplingParams(temperature=0.8)] * 5, 2),
        ([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=9)], 1),
        ([SamplingParams(temperature=0.7, seed=s, top_k=5) for s in range(9)], 9),
        ([SamplingParams(temperature=2.0, min_p=0.1)] * 3, 0),
    ]
    for others, pos in crowds:
        assert _seeded_run(target, others, pos, steps=12) == alone
    # the draws are random at all: 12 steps over 64 tokens do not all agree with argmax
    assert len(set(alone)) > 1


def test_seed_creates_its_generator_when_the_engine_did_not() -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, seed=77)
    a = _metadata([p])
    b = _metadata([p], generators={0: make_generator(77)})
    sampler = Sampler()
    seq_a = [sampler(logits, a).sampled_token_ids[0] for _ in range(10)]
    seq_b = [sampler(logits, b).sampled_token_ids[0] for _ in range(10)]
    assert a.generators.get(0) is not None
    assert seq_a == seq_b


def test_unseeded_rows_follow_the_sampler_seed() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    md = _metadata([SamplingParams(temperature=1.0) for _ in range(8)])
    assert (
        Sampler(seed=5)(logits, md).sampled_token_ids
        == Sampler(seed=5)(logits, md).sampled_token_ids
    )


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_unseeded_draws_follow_softmax_over_temperature(temperature: float) -> None:
    logits = torch.tensor([1.0, 0.3, -0.5, 2.0, 0.0, -1.5, 0.8, 1.2])
    n = 20000
    md = _metadata([SamplingParams(temperature=temperature) for _ in range(n)])
    out = Sampler(seed=42)(logits.repeat(n, 1), md)
    counts = torch.bincount(torch.tensor(out.sampled_token_ids), minlength=8).float()
    probs = torch.softmax(logits / temperature, dim=-1)
    assert _chi_square(counts, probs) < CHI2_CRIT_001[7]


def test_seeded_draws_follow_softmax_with_top_k() -> None:
    # every row has its own seed: the per-row generator path, and top-k renormalisation
    logits = torch.tensor([1.0, 0.3, -0.5, 2.0, 0.0, -1.5, 0.8, 1.2])
    n = 3000
    params = [SamplingParams(temperature=0.8, top_k=3, seed=s) for s in range(n)]
    md = _metadata(params, generators={s: make_generator(s) for s in range(n)})
    out = Sampler()(logits.repeat(n, 1), md)
    counts = torch.bincount(torch.tensor(out.sampled_token_ids), minlength=8).float()
    probs = torch.zeros(8)
    top = logits.topk(3).indices
    probs[top] = torch.softmax(logits[top] / 0.8, dim=-1)
    assert counts[probs == 0].sum() == 0
    assert _chi_square(counts, probs) < CHI2_CRIT_001[2]


def test_penalised_draws_follow_the_penalised_distribution() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 0.2])
    params = SamplingParams(temperature=1.0, presence_penalty=1.0, frequency_penalty=0.5)
    n = 10000
    md = _metadata([params] * n, outputs=[[0, 0, 4]] * n)
    out = Sampler(seed=8)(logits.repeat(n, 1), md)
    counts = torch.bincount(torch.tensor(out.sampled_token_ids), minlength=5).float()
    penalised = logits - torch.tensor([1.0 + 2 * 0.5, 0, 0, 0, 1.0 + 0.5])
    assert _chi_square(counts, torch.softmax(penalised, dim=-1)) < CHI2_CRIT_001[4]
