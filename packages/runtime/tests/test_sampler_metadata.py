"""SamplingMetadata: what from_params builds, and sampling that ignores where tensors came from."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from pagemill.runtime.sample.row_kernels import RowKernels
from pagemill.runtime.sample.sampler import Sampler
from pagemill.runtime.sample.sampling_metadata import SamplingMetadata, make_generator
from pagemill.runtime.sampling_params import SamplingParams

VOCAB = 512


def test_from_params_fields() -> None:
    params = [
        SamplingParams(temperature=0.0, top_k=7, seed=3),  # greedy: filters and seed unused
        SamplingParams(temperature=0.7, top_p=0.9, seed=11, logprobs=2),
        SamplingParams(temperature=1.2, top_k=40, min_tokens=3, stop_token_ids=[5]),
        SamplingParams(temperature=0.9, presence_penalty=0.5, logprobs=4),
    ]
    own = make_generator(99)
    md = SamplingMetadata.from_params(
        params,
        output_token_ids=[[1], [2, 3], [], [4]],
        prompt_token_ids=[[9], [9], [9], [9]],
        generators={2: own},
        banned_until_min=[frozenset({0})] * 4,
    )
    assert md.num_rows == 4
    assert md.temperature.dtype == torch.float32
    # a greedy row's temperature is never read: 1.0 keeps it finite
    assert md.temperature.tolist() == pytest.approx([1.0, 0.7, 1.2, 0.9])
    assert md.greedy is not None and md.greedy.tolist() == [True, False, False, False]
    assert not md.all_greedy and not md.all_random
    assert md.top_p is not None and md.top_p.tolist() == pytest.approx([1.0, 0.9, 1.0, 1.0])
    assert md.top_k is not None and md.top_k.dtype == torch.int64
    assert md.top_k.tolist() == [7, 0, 40, 0]
    assert md.max_top_k == 40
    assert md.min_p is None
    # the seeded random row gets its generator; the greedy one does not; given ones are kept
    assert set(md.generators) == {1, 2} and md.generators[2] is own
    assert not md.no_penalties
    assert md.presence_penalties.tolist() == [0.0, 0.0, 0.0, 0.5]
    assert md.prompt_token_ids is None  # no repetition penalty: prompts are not needed
    assert md.output_token_ids == [[1], [2, 3], [], [4]]
    assert md.min_tokens == {2: (3, frozenset({0, 5}))}
    assert md.max_num_logprobs == 4


def test_from_params_all_greedy_and_all_random() -> None:
    greedy = SamplingMetadata.from_params(
        [SamplingParams(temperature=0.0)] * 2, output_token_ids=[[], []], prompt_token_ids=None
    )
    assert greedy.all_greedy and not greedy.all_random and greedy.greedy is None
    assert greedy.top_p is None and greedy.top_k is None and greedy.max_top_k == 0
    assert greedy.no_penalties and greedy.max_num_logprobs is None
    rand = SamplingMetadata.from_params(
        [SamplingParams(repetition_penalty=1.2)] * 2,
        output_token_ids=[[], []],
        prompt_token_ids=[[1, 2], [3]],
    )
    assert rand.all_random and not rand.all_greedy and rand.greedy is None
    assert rand.prompt_token_ids == [[1, 2], [3]]


def test_from_params_rejects_inconsistent_rows() -> None:
    with pytest.raises(ValueError, match="output_token_ids has 1 rows for 2 params"):
        SamplingMetadata.from_params(
            [SamplingParams()] * 2, output_token_ids=[[]], prompt_token_ids=None
        )
    with pytest.raises(ValueError, match="prompt_token_ids are required"):
        SamplingMetadata.from_params(
            [SamplingParams(repetition_penalty=1.1)], output_token_ids=[[]], prompt_token_ids=None
        )


def _params() -> list[SamplingParams]:
    """Every kind of row: greedy, seeded with each filter, penalties, min_tokens, logprobs."""
    return [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.8, top_k=20, seed=1),
        SamplingParams(temperature=1.1, top_p=0.8, seed=2),
        SamplingParams(temperature=0.0, repetition_penalty=1.4, frequency_penalty=0.3),
        SamplingParams(temperature=1.0, min_p=0.05, seed=3),
        SamplingParams(temperature=0.9, seed=4, presence_penalty=0.8),
        SamplingParams(temperature=1.3, top_k=60, top_p=0.95, min_p=0.01, seed=5),
        SamplingParams(temperature=0.6, seed=6, min_tokens=4, stop_token_ids=[7, 8]),
        SamplingParams(temperature=0.0, min_tokens=2),
        SamplingParams(temperature=1.0, top_k=300, seed=7),  # wide head: the sorted path
        SamplingParams(temperature=0.7, top_p=0.9, seed=8, repetition_penalty=0.8),
    ]


def _tokens(rows: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(n),), generator=g).tolist() for n in range(rows)]


def _fresh(params: Sequence[SamplingParams], rows: Sequence[int]) -> SamplingMetadata:
    """from_params over `rows` of `params`, with new generators (streams from the start)."""
    chosen = [params[r] for r in rows]
    return SamplingMetadata.from_params(
        chosen,
        output_token_ids=[_OUTPUTS[r] for r in rows],
        prompt_token_ids=[_PROMPTS[r] for r in rows],
        banned_until_min=[frozenset({0})] * len(rows),
    )


_PROMPTS = _tokens(11, 1)
_OUTPUTS = [t[:3] for t in _tokens(11, 2)]


def _take(md: SamplingMetadata, rows: Sequence[int]) -> SamplingMetadata:
    """The metadata of `rows` (in that order) cut out of a larger one, as a runner does."""
    idx = torch.tensor(rows)
    pos = {r: i for i, r in enumerate(rows)}
    greedy = md.greedy if md.greedy is not None else torch.full((md.num_rows,), md.all_greedy)
    sub_greedy = greedy.index_select(0, idx)
    all_greedy, all_random = bool(sub_greedy.all()), not bool(sub_greedy.any())

    def sel(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.index_select(0, idx)

    return SamplingMetadata(
        temperature=md.temperature.index_select(0, idx),
        greedy=None if all_greedy or all_random else sub_greedy,
        all_greedy=all_greedy,
        all_random=all_random,
        top_p=sel(md.top_p),
        top_k=sel(md.top_k),
        min_p=sel(md.min_p),
        max_top_k=md.max_top_k,  # the larger batch's: an upper bound is enough
        generators={pos[r]: g for r, g in md.generators.items() if r in pos},
        no_penalties=md.no_penalties,
        presence_penalties=md.presence_penalties.index_select(0, idx),
        frequency_penalties=md.frequency_penalties.index_select(0, idx),
        repetition_penalties=md.repetition_penalties.index_select(0, idx),
        prompt_token_ids=None
        if md.prompt_token_ids is None
        else [md.prompt_token_ids[r] for r in rows],
        output_token_ids=[md.output_token_ids[r] for r in rows],
        min_tokens={pos[r]: v for r, v in md.min_tokens.items() if r in pos},
        max_num_logprobs=md.max_num_logprobs,
    )


def _run(
    md: SamplingMetadata, logits: list[torch.Tensor], kernels: RowKernels | None = None
) -> list[list[int]]:
    sampler = Sampler(seed=0)
    if kernels is not None:  # compiled once, shared; the generator restarts from the seed
        sampler._kernels = kernels
    return [sampler(x, md).sampled_token_ids for x in logits]


def _step_logits(rows: int, steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    # Peaked rows (most top-p / min-p heads are narrow) with a few flat ones.
    scale = torch.where(torch.arange(rows) % 4 == 0, 0.5, 4.0).unsqueeze(1)
    return [torch.randn(rows, VOCAB, generator=g) * scale for _ in range(steps)]


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_sliced_metadata_samples_like_fresh_metadata(compiled: bool) -> None:
    """A row's head is as wide as its batch's largest top_k, its rejection rounds are its
    own: neither changes its tokens. Compiled, the row kernels serve any row count."""
    kernels = None
    if compiled:
        kernels = RowKernels(native=False)  # else the native kernels serve first
        assert kernels.compile(VOCAB, torch.device("cpu"), (torch.float32,)) and kernels.compiled
    params = _params()
    everything = list(range(len(params)))
    logits = _step_logits(len(params), steps=4)
    whole = _run(_fresh(params, everything), logits, kernels)
    for rows in ([4, 2, 6, 0], [9, 10, 3, 7, 1], [5, 8], [2]):
        sub_logits = [x[rows] for x in logits]
        sliced = _run(_take(_fresh(params, everything), rows), sub_logits, kernels)
        alone = _run(_fresh(params, rows), sub_logits, kernels)
        assert sliced == alone
        # and a row's token does not depend on which rows share its batch, nor where it sits
        assert sliced == [[step[r] for r in rows] for step in whole]
    # the draws are random at all
    assert len({step[2] for step in whole}) > 1


def _in_larger_buffer(t: torch.Tensor, capacity: int) -> torch.Tensor:
    """`t` as the prefix view of a larger persistent tensor with stale data behind it."""
    buf = torch.full((capacity,), 3, dtype=t.dtype)
    buf[: t.shape[0]] = t
    return buf[: t.shape[0]]


def test_prefix_views_of_persistent_tensors_sample_like_fresh_ones() -> None:
    params = _params()
    rows = list(range(len(params)))
    logits = _step_logits(len(params), steps=3)
    md = _fresh(params, rows)
    for name in (
        "temperature",
        "greedy",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalties",
        "frequency_penalties",
        "repetition_penalties",
    ):
        value = getattr(md, name)
        if value is not None:
            setattr(md, name, _in_larger_buffer(value, 64))
    assert _run(md, logits) == _run(_fresh(params, rows), logits)


# ---- the model runner's input batch builds its metadata with the same one builder --------


def _batch_rows(params: Sequence[SamplingParams]):
    """An InputBatch holding one request per param (prompt and outputs from the tables
    above), with rows 3 and 0 added then removed again (the gap is closed up)."""
    from pagemill.runtime.worker.input_batch import CachedRequestState, InputBatch
    from pagemill.scheduler import Request

    batch = InputBatch(len(params) + 2, 4, torch.device("cpu"))
    states = {}
    for r, p in enumerate(params):
        record = Request(
            f"r{r}",
            _PROMPTS[r] or [1],
            eos_token_id=0,
            min_tokens=p.min_tokens,
            stop_token_ids=p.stop_token_ids,
            sampling_params=p,
        )
        for t in _OUTPUTS[r]:
            record.append_output_token(t)
        states[r] = CachedRequestState.create(record, torch.device("cpu"))
        batch.add(states[r], [r])
    batch.remove("r3")
    batch.remove("r0")
    batch.add(states[3], [3])
    return batch, states, [r for r in range(len(params)) if r not in (0, 3)] + [3]


def _assert_same_metadata(a: SamplingMetadata, b: SamplingMetadata) -> None:
    from dataclasses import fields

    for f in fields(SamplingMetadata):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            assert x is not None and y is not None, f.name
            assert x.dtype == y.dtype and torch.equal(x, y), f.name
        elif f.name == "generators":
            assert x.keys() == y.keys()
        elif f.name == "logit_bias":
            assert (x is None) == (y is None)
            if x is not None:
                for name in ("rows", "token_ids", "values"):
                    assert torch.equal(getattr(x, name), getattr(y, name))
        elif f.name == "token_histories":
            # Caches of the rows' tokens (the runner's persist across rebuilds): only
            # whether the metadata has penalised rows must agree.
            assert (x is None) == (y is None) and (x is None or len(x) == len(y))
        elif f.name in ("prompt_token_ids", "output_token_ids"):
            assert (x is None) == (y is None), f.name
            if x is not None:
                assert [list(t) for t in x] == [list(t) for t in y], f.name
        else:
            assert x == y, f.name


@pytest.mark.parametrize("subset", [None, [4, 0, 7], [2], [8, 3, 1, 9, 5]])
def test_input_batch_metadata_is_from_params_metadata(subset: list[int] | None) -> None:
    """Every row kind, rows removed and re-added, all rows or a subset: the runner's
    metadata equals what from_params builds for the same requests, and samples the same."""
    import numpy as np

    params = [*_params()]
    params[5] = SamplingParams(
        temperature=0.9, seed=4, presence_penalty=0.8, logit_bias={3: 5.0, 9: -2.0}
    )
    params[8] = SamplingParams(temperature=0.0, min_tokens=2, seed=9)  # greedy: no generator
    batch, states, kept = _batch_rows(params)
    assert batch.req_ids == [f"r{r}" for r in kept]
    rows = kept if subset is None else [kept[i] for i in subset]
    got = batch.sampling_metadata(None if subset is None else np.array(subset))
    want = SamplingMetadata.from_params(
        [params[r] for r in rows],
        output_token_ids=[_OUTPUTS[r] for r in rows],
        prompt_token_ids=[_PROMPTS[r] or [1] for r in rows],
        banned_until_min=[states[r].banned_until_min for r in rows],
    )
    _assert_same_metadata(got, want)
    logits = [x[: len(rows)] for x in _step_logits(len(params), steps=3)]
    assert _run(got, logits) == _run(want, logits)


def test_input_batch_reuses_its_metadata_until_the_batch_changes() -> None:
    batch, _, _ = _batch_rows(_params())
    md = batch.sampling_metadata()
    assert batch.sampling_metadata() is md
    batch.remove("r5")
    assert batch.sampling_metadata() is not md
