"""Sampler: greedy, masks, penalties, min_tokens and logprobs against direct computations."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from pagemill.runtime.sample.sampler import Sampler, apply_penalties, apply_top_k_top_p_min_p
from pagemill.runtime.sample.sampling_metadata import SamplingMetadata
from pagemill.runtime.sampling_params import SamplingParams

NEG_INF = float("-inf")


def _metadata(
    params: Sequence[SamplingParams],
    prompts: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
    banned_until_min: Sequence[frozenset[int]] | None = None,
) -> SamplingMetadata:
    return SamplingMetadata.from_params(
        params,
        output_token_ids=outputs if outputs is not None else [[] for _ in params],
        prompt_token_ids=prompts if prompts is not None else [[] for _ in params],
        banned_until_min=banned_until_min,
    )


def _masks(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    md = _metadata(params)
    return apply_top_k_top_p_min_p(x, md.top_k, md.top_p, md.min_p, md.max_top_k)


def _logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3


def test_greedy_is_argmax() -> None:
    logits = _logits(7, 100)
    out = Sampler()(logits, _metadata([SamplingParams(temperature=0.0) for _ in range(7)]))
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None
    assert out.logprob_token_ids is None


def test_greedy_accepts_low_precision_logits() -> None:
    logits = _logits(3, 64).to(torch.bfloat16)
    out = Sampler()(logits, _metadata([SamplingParams(temperature=0.0) for _ in range(3)]))
    assert out.sampled_token_ids == logits.float().argmax(dim=-1).tolist()


def test_top_k_one_is_greedy_at_any_temperature() -> None:
    logits = _logits(16, 200, seed=1)
    params = [SamplingParams(temperature=t, top_k=1) for t in [0.5, 1.0, 2.0, 5.0] * 4]
    out = Sampler(seed=3)(logits, _metadata(params))
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()


def test_mixed_greedy_and_random_rows_keep_their_order() -> None:
    logits = _logits(6, 50, seed=2)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, top_k=1, seed=5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0, min_p=1.0),
    ]
    out = Sampler()(logits, _metadata(params))
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()


# probabilities 0.5, 0.2, 0.15, 0.1, 0.05 placed in a shuffled order over 5 tokens
PROBS = {3: 0.5, 0: 0.2, 4: 0.15, 1: 0.1, 2: 0.05}


def _hand_logits() -> torch.Tensor:
    row = torch.tensor([math.log(PROBS[i]) for i in range(5)])
    return row.unsqueeze(0)


@pytest.mark.parametrize(
    ("kwargs", "kept"),
    [
        ({}, {0, 1, 2, 3, 4}),
        ({"top_k": 2}, {3, 0}),
        ({"top_k": 4}, {3, 0, 4, 1}),
        ({"top_k": 10}, {0, 1, 2, 3, 4}),
        # cumulative mass before each token: 0, .5, .7, .85, .95
        ({"top_p": 0.45}, {3}),
        ({"top_p": 0.6}, {3, 0}),
        ({"top_p": 0.75}, {3, 0, 4}),
        ({"top_p": 0.9}, {3, 0, 4, 1}),
        ({"top_p": 0.99}, {0, 1, 2, 3, 4}),
        # top-p acts on what top-k kept, renormalised: 0.5/0.7 = .714 >= .7 -> one token
        ({"top_k": 2, "top_p": 0.7}, {3}),
        # min-p keeps p >= min_p * 0.5
        ({"min_p": 0.25}, {3, 0, 4}),
        ({"min_p": 0.35}, {3, 0}),
        ({"min_p": 1.0}, {3}),
        ({"min_p": 0.15, "top_k": 3}, {3, 0, 4}),
    ],
)
def test_masks_match_hand_computation(kwargs: dict, kept: set[int]) -> None:
    x = _masks(_hand_logits(), [SamplingParams(**kwargs)])
    got = {i for i in range(5) if x[0, i] != NEG_INF}
    assert got == kept
    # surviving logits are unchanged
    for i in got:
        assert x[0, i] == _hand_logits()[0, i]


def test_masks_are_per_row() -> None:
    x = _hand_logits().repeat(3, 1)
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.75), SamplingParams(min_p=1.0)]
    x = _masks(x, params)
    kept = [{i for i in range(5) if x[r, i] != NEG_INF} for r in range(3)]
    assert kept == [{3, 0}, {3, 0, 4}, {3}]


def _direct_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
) -> torch.Tensor:
    out = logits.clone()
    for r, p in enumerate(params):
        for t in range(logits.shape[1]):
            v = float(out[r, t])
            if t in prompts[r] or t in outputs[r]:
                v = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
            count = list(outputs[r]).count(t)
            v -= p.frequency_penalty * count
            if count:
                v -= p.presence_penalty
            out[r, t] = v
    return out


def test_penalties_match_direct_recomputation() -> None:
    vocab = 40
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(5, vocab, generator=g) * 2
    rnd = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(presence_penalty=0.7),
        SamplingParams(frequency_penalty=-0.4),
        SamplingParams(repetition_penalty=0.8, presence_penalty=-1.2, frequency_penalty=1.5),
        SamplingParams(),  # no penalty: untouched
    ]
    prompts = [rnd(6), rnd(3), rnd(2), rnd(10), rnd(8)]
    outputs = [rnd(9), rnd(12), rnd(15), rnd(20), rnd(8)]
    x = logits.clone()
    apply_penalties(x, _metadata(params, prompts, outputs))
    torch.testing.assert_close(x, _direct_penalties(logits, params, prompts, outputs))
    assert torch.equal(x[4], logits[4])


def test_penalties_with_empty_outputs_only_touch_prompt_tokens() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0]])
    x = logits.clone()
    params = [SamplingParams(repetition_penalty=2.0, presence_penalty=1.0)]
    apply_penalties(x, _metadata(params, prompts=[[0, 1]]))
    assert x.tolist() == [[1.0, -4.0, 1.0, -1.0]]


def test_repetition_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    md = _metadata([SamplingParams(temperature=0.0, repetition_penalty=1.5)], [[0]], [[]])
    assert Sampler()(logits, md).sampled_token_ids == [1]


def test_min_tokens_masks_eos_and_stop_tokens() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]] * 4)
    params = [
        SamplingParams(temperature=0.0, min_tokens=2),
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1]),
        SamplingParams(temperature=0.0, min_tokens=2),
        SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True),
    ]
    # EOS is token 0; the runner leaves it out of what an ignore_eos request has banned.
    banned = [frozenset({0})] * 3 + [frozenset()]
    md = _metadata(params, outputs=[[9], [], [9, 9], []], banned_until_min=banned)
    assert Sampler()(logits, md).sampled_token_ids == [1, 2, 0, 0]


def test_logprobs_are_of_the_raw_distribution() -> None:
    logits = _logits(4, 30, seed=11)
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.5, repetition_penalty=2.0, logprobs=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, top_k=2, logprobs=5),
    ]
    out = Sampler(seed=1)(logits, _metadata(params, prompts=[[1, 2, 3]] * 4))
    ref = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None and out.logprob_token_ids is not None
    # Every row gets the sampled token and the top-n of the largest n asked (5); callers
    # keep what each request asked for.
    for r, t in enumerate(out.sampled_token_ids):
        ids, lps = out.logprob_token_ids[r], out.logprobs[r]
        assert ids[0] == t
        assert lps[0] == pytest.approx(float(ref[r, t]), abs=1e-6)
        assert len(ids) == len(lps) == 6
        values, indices = ref[r].topk(5)
        assert ids[1:] == indices.tolist()
        assert lps[1:] == pytest.approx(values.tolist(), abs=1e-6)


def test_shape_mismatch_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="one row per metadata row"):
        Sampler()(torch.zeros(2, 5), _metadata([SamplingParams()]))


def test_empty_batch() -> None:
    out = Sampler()(torch.zeros(0, 5), _metadata([]))
    assert out.sampled_token_ids == []


def _reference_masks(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The plain definition, row by row with a full sort: kept = True."""
    kept = torch.zeros_like(x, dtype=torch.bool)
    for r, p in enumerate(params):
        order = x[r].argsort(descending=True)
        k = p.top_k if p.top_k > 0 else x.shape[1]
        probs = torch.softmax(x[r][order[:k]].double(), dim=0)
        mass = 0.0
        for j in range(min(k, x.shape[1])):
            if j > 0 and p.top_p < 1.0 and mass >= p.top_p:
                break
            kept[r, order[j]] = True
            mass += float(probs[j])
        full = torch.softmax(x[r].double(), dim=0)
        kept[r] &= full >= p.min_p * full.max()
    return kept


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])  # flat (sort path) to peaked (topk path)
def test_masks_match_reference_on_random_rows(scale: float) -> None:
    vocab = 400
    g = torch.Generator().manual_seed(int(scale * 10))
    params = [
        SamplingParams(top_p=0.9),
        SamplingParams(top_p=0.5, top_k=30),
        SamplingParams(top_k=7),
        SamplingParams(),
        SamplingParams(min_p=0.05),
        SamplingParams(top_p=0.3, min_p=0.2),
        SamplingParams(top_p=0.97, top_k=120),
        SamplingParams(top_p=0.999),
    ]
    x = torch.randn(len(params), vocab, generator=g) * scale
    got = _masks(x, params) != NEG_INF
    assert torch.equal(got, _reference_masks(x, params))
