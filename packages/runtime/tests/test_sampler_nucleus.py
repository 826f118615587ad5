"""Flat rows (a top-p / min-p nucleus wider than a quarter of the vocabulary) are drawn by
rejection (`Sampler._draw_nucleus`), never sorted: same distribution as the sort-based
reference filter, seeded rows reproducible whatever their batch."""

from __future__ import annotations

import pytest
import torch

from pagemill.runtime.sample.sampler import Sampler, apply_top_k_top_p_min_p
from pagemill.runtime.sample.sampling_metadata import SamplingMetadata, make_generator
from pagemill.runtime.sampling_params import SamplingParams

CHI2_CRIT_001_9DOF = 27.88


def _metadata(params: list[SamplingParams], generators=None) -> SamplingMetadata:
    return SamplingMetadata.from_params(
        params, output_token_ids=[[] for _ in params], prompt_token_ids=None, generators=generators
    )


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    method = Sampler._draw_nucleus

    def spy(self, z, *args):
        calls.append(z.shape[0])
        return method(self, z, *args)

    monkeypatch.setattr(Sampler, "_draw_nucleus", spy)
    return calls


@pytest.mark.parametrize("kwargs", [{"top_p": 0.9}, {"top_p": 0.6, "min_p": 0.1}, {"min_p": 0.1}])
def test_flat_rows_follow_the_filtered_distribution(kwargs, monkeypatch) -> None:
    calls = _spy(monkeypatch)
    vocab, temperature, n = 1000, 0.7, 40000
    g = torch.Generator().manual_seed(0)
    row = torch.randn(vocab, generator=g) * 0.25  # flat: hundreds of tokens in the nucleus
    params = [SamplingParams(temperature=temperature, **kwargs)] * n
    md = _metadata(params)
    tokens = torch.tensor(Sampler(seed=1)(row.repeat(n, 1), md).sampled_token_ids)
    assert sum(calls) == n  # every row took the rejection path
    first = [None if t is None else t[:1] for t in (md.top_k, md.top_p, md.min_p)]
    masked = apply_top_k_top_p_min_p((row / temperature).unsqueeze(0), *first, md.max_top_k)[0]
    probs = torch.softmax(masked, dim=-1)
    kept = probs > 0
    assert 100 < int(kept.sum()) < vocab
    counts = torch.bincount(tokens, minlength=vocab).float()
    assert counts[~kept].sum() == 0
    # Ten bins of kept tokens by rank (equal numbers of tokens), counts against expectation.
    order = probs.argsort(descending=True)[: int(kept.sum())]
    bins = order.tensor_split(10)
    observed = torch.stack([counts[b].sum() for b in bins])
    expected = torch.stack([probs[b].sum() * n for b in bins])
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_CRIT_001_9DOF


def test_seeded_flat_rows_ignore_their_batch() -> None:
    vocab = 2000
    g = torch.Generator().manual_seed(3)
    flat = torch.randn(vocab, generator=g) * 0.3
    target = SamplingParams(temperature=0.9, top_p=0.8, seed=7)
    runs = []
    for others in (
        [],
        [SamplingParams(temperature=0.9, top_k=600)] * 3,
        [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.5)],
    ):
        params = [*others, target]
        md = _metadata(params, generators={len(others): make_generator(7)})
        sampler = Sampler(seed=len(others))
        logits = torch.randn(len(params), vocab, generator=g) * 4
        logits[-1] = flat
        runs.append([sampler(logits, md).sampled_token_ids[-1] for _ in range(6)])
    assert runs[0] == runs[1] == runs[2]
    assert len(set(runs[0])) > 1


def test_greedy_is_argmax_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(32, 4096, generator=g) * 3).to(torch.bfloat16)
    md = _metadata([SamplingParams(temperature=0.0)] * 32)
    out = Sampler()(logits, md).sampled_token_ids
    assert out == logits.float().argmax(dim=-1).tolist()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_p": 2.757720689665547e-115},  # 0.0 once stored as fp32 (found by schemathesis)
        {"min_p": 1.0},
        {"top_p": 1e-30, "min_p": 1.0},
    ],
)
def test_a_filter_that_keeps_only_the_best_token_ends(kwargs) -> None:
    """Both filters always keep a row's best token; a draw that can only end there must
    end (it once looped forever and wedged the engine)."""
    import threading

    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 500, generator=g)
    x[2, 7] = x[2, 9] = x[2].max() + 1.0  # a tie at the top: the smaller id ranks first
    x_bf16 = x.to(torch.bfloat16)  # the model's dtype: the peak and z may differ by an ulp
    params = [SamplingParams(temperature=0.9, **kwargs)] * x.shape[0]
    result: dict[str, list[int]] = {}

    def draw() -> None:
        sampler = Sampler(seed=1)
        result["fp32"] = sampler._draw_nucleus(x, None, _metadata(params)).tolist()
        result["bf16"] = sampler(x_bf16, _metadata(params)).sampled_token_ids

    thread = threading.Thread(target=draw, daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "the draw did not end"
    best = x.argmax(dim=-1).tolist()
    assert result["fp32"] == best and best[2] == 7
    assert result["bf16"] == x_bf16.argmax(dim=-1).tolist()
