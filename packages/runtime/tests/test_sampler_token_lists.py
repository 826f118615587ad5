"""allowed_token_ids and bad_words in the sampler, against plain-torch masks built here."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from pagemill.runtime.sample.sampler import Sampler
from pagemill.runtime.sample.sampling_metadata import SamplingMetadata
from pagemill.runtime.sampling_params import SamplingParams

VOCAB = 64


def _metadata(
    params: Sequence[SamplingParams], outputs: Sequence[Sequence[int]]
) -> SamplingMetadata:
    return SamplingMetadata.from_params(
        params, output_token_ids=outputs, prompt_token_ids=[[] for _ in params]
    )


def _reference_mask(
    rows: int, params: Sequence[SamplingParams], outputs: Sequence[Sequence[int]]
) -> torch.Tensor:
    """[rows, VOCAB] bool, True = may not be sampled: the rules written out per token."""
    mask = torch.zeros(rows, VOCAB, dtype=torch.bool)
    for r, (p, out) in enumerate(zip(params, outputs)):
        if p.allowed_token_ids is not None:
            mask[r] = True
            for t in p.allowed_token_ids:
                mask[r, t] = False
        for word in p.bad_words_token_ids or []:
            *prefix, last = word
            if not prefix or (len(out) >= len(prefix) and list(out[-len(prefix) :]) == prefix):
                mask[r, last] = True
    return mask


def _logits(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * 4


def _cases() -> tuple[list[SamplingParams], list[list[int]]]:
    g = torch.Generator().manual_seed(7)
    params: list[SamplingParams] = []
    outputs: list[list[int]] = []
    for r in range(24):
        out = torch.randint(0, VOCAB, (r % 5,), generator=g).tolist()
        kind = r % 4
        if kind == 0:  # plain row beside the others: untouched
            params.append(SamplingParams(temperature=0.0))
        elif kind == 1:
            allowed = torch.randperm(VOCAB, generator=g)[: 1 + r % 6].tolist()
            params.append(SamplingParams(temperature=0.0, allowed_token_ids=allowed))
        else:
            # One word banned always, one whose prefix is the output's tail (banned now),
            # one whose prefix is not (free).
            tail = out[-2:] if len(out) >= 2 else []
            words = [[int(torch.randint(0, VOCAB, (1,), generator=g))]]
            if tail:
                words.append([*tail, int(torch.randint(0, VOCAB, (1,), generator=g))])
            words.append([(out[-1] + 1) % VOCAB if out else 5, 3, 9])
            params.append(SamplingParams(temperature=0.0, bad_words_token_ids=words))
        outputs.append(out)
    return params, outputs


def test_greedy_matches_reference_mask() -> None:
    params, outputs = _cases()
    for seed in range(5):
        logits = _logits(len(params), seed)
        # Put each row's argmax on a token the rules forbid, where there is one.
        mask = _reference_mask(len(params), params, outputs)
        for r in range(len(params)):
            banned = mask[r].nonzero().flatten()
            if banned.numel():
                logits[r, banned[0]] = 100.0
        expected = logits.masked_fill(mask, float("-inf")).argmax(dim=-1).tolist()
        got = Sampler()(logits.clone(), _metadata(params, outputs)).sampled_token_ids
        assert got == expected


def test_random_rows_draw_only_allowed_tokens() -> None:
    allowed = [3, 17, 40]
    params = [
        SamplingParams(temperature=1.5, allowed_token_ids=allowed, seed=s) for s in range(200)
    ]
    outputs: list[list[int]] = [[] for _ in params]
    got = Sampler()(_logits(len(params), 1), _metadata(params, outputs)).sampled_token_ids
    assert set(got) <= set(allowed)
    assert len(set(got)) > 1  # still sampled, not collapsed onto one token


def test_bad_word_prefix_from_output_only() -> None:
    word = [5, 6, 7]
    params = [SamplingParams(temperature=0.0, bad_words_token_ids=[word])] * 3
    outputs = [[1, 5, 6], [5, 6, 1], [6]]
    logits = torch.zeros(3, VOCAB)
    logits[:, 7] = 10.0
    got = Sampler()(logits, _metadata(params, outputs)).sampled_token_ids
    assert got[0] != 7 and got[1] == 7 and got[2] == 7


def test_logprobs_stay_raw() -> None:
    params = [SamplingParams(temperature=0.0, logprobs=2, allowed_token_ids=[4])]
    logits = _logits(1, 3)
    out = Sampler()(logits, _metadata(params, [[]]))
    assert out.sampled_token_ids == [4]
    assert out.logprobs is not None
    expected = torch.log_softmax(logits, dim=-1)[0, 4].item()
    assert out.logprobs[0][0] == pytest.approx(expected, abs=1e-5)


def test_plain_batch_has_no_token_list_metadata() -> None:
    md = _metadata([SamplingParams()] * 4, [[]] * 4)
    assert md.allowed_token_ids is None and md.bad_words_token_ids == {}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("allowed_token_ids", []),
        ("allowed_token_ids", [-1]),
        ("allowed_token_ids", [True]),
        ("bad_words", ["  "]),
        ("bad_words", "word"),
        ("truncate_prompt_tokens", 0),
        ("truncate_prompt_tokens", -2),
    ],
)
def test_params_refuse_bad_values(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]
