"""Rows without top-k (plain temperature, top-p, min-p) are drawn from whole rows by the row
kernels and rejection rounds: their tokens follow the filtered softmax of a plain-torch
reference (a full sort in float64, written here), ties included, and a seeded row's tokens
never depend on its batch."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from pagemill.runtime.sample.row_kernels import RowKernels
from pagemill.runtime.sample.sampler import Sampler
from pagemill.runtime.sample.sampling_metadata import SamplingMetadata, make_generator
from pagemill.runtime.sampling_params import SamplingParams

# chi-square critical values at p = 0.001 by degrees of freedom
CHI2_CRIT_001 = {
    1: 10.83,
    2: 13.82,
    3: 16.27,
    4: 18.47,
    5: 20.52,
    6: 22.46,
    7: 24.32,
    8: 26.12,
    9: 27.88,
}


def _metadata(params: Sequence[SamplingParams], generators=None) -> SamplingMetadata:
    return SamplingMetadata.from_params(
        params, output_token_ids=[[] for _ in params], prompt_token_ids=None, generators=generators
    )


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The filtered distribution by definition: logits / temperature sorted (descending,
    equal logits by token id), top-k, then top-p over what top-k kept (keep a token while
    the mass ranked above it is below top_p), then min-p against the largest probability,
    then renormalised. Float64 throughout."""
    z = logits.double() / p.temperature
    vocab = z.shape[0]
    order = torch.sort(-z, stable=True).indices  # a stable sort keeps equal ones by id
    probs = torch.softmax(z, dim=0)
    keep = torch.zeros(vocab, dtype=torch.bool)
    k = p.top_k if 0 < p.top_k < vocab else vocab
    head = probs[order[:k]]
    head = head / head.sum()
    before = torch.cumsum(head, dim=0) - head
    kept = before < p.top_p if p.top_p < 1.0 else torch.ones(k, dtype=torch.bool)
    kept[0] = True
    keep[order[:k][kept]] = True
    keep &= probs >= p.min_p * probs.max()
    out = torch.where(keep, probs, 0.0)
    return out / out.sum()


def _binned_chi2(counts: torch.Tensor, probs: torch.Tensor, n: int) -> tuple[float, int]:
    """(chi-square, degrees of freedom) of the counts against n x probs, kept tokens grouped
    by rank into bins of about equal expected mass (so every expectation is large)."""
    kept = probs.argsort(descending=True)[: int((probs > 0).sum())]
    before = torch.cumsum(probs[kept], dim=0) - probs[kept]
    bin_of = (before * 10).long().clamp_max(9)
    observed, expected = [], []
    for b in bin_of.unique():
        group = kept[bin_of == b]
        observed.append(counts[group].sum())
        expected.append(probs[group].sum() * n)
    o, e = torch.stack(observed), torch.stack(expected)
    assert float(e.min()) > 20
    return float(((o - e) ** 2 / e).sum()), len(observed) - 1


def _rows(seed: int, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    peaked = torch.randn(vocab, generator=g) * 3.0
    flat = torch.randn(vocab, generator=g) * 0.3
    return {"peaked": peaked, "flat": flat}


CASES = [
    {"temperature": 0.8},
    {"temperature": 0.8, "top_p": 0.95},
    {"temperature": 1.2, "top_p": 0.5},
    {"temperature": 0.8, "min_p": 0.05},
    {"temperature": 0.7, "top_p": 0.7, "min_p": 0.02},
]


@pytest.mark.parametrize("kwargs", CASES)
@pytest.mark.parametrize("shape", ["peaked", "flat"])
def test_draws_follow_the_reference_distribution(kwargs: dict, shape: str) -> None:
    vocab, n = 700, 20000  # 700: not a multiple of the kernels' block
    row = _rows(1, vocab)[shape]
    p = SamplingParams(**kwargs)
    probs = reference_probs(row, p)
    tokens = Sampler(seed=2)(row.repeat(n, 1), _metadata([p] * n)).sampled_token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
    assert counts[probs == 0].sum() == 0  # nothing outside the filters, ever
    chi2, dof = _binned_chi2(counts, probs, n)
    assert dof >= 1
    assert chi2 < CHI2_CRIT_001[dof]
    # and the whole distribution is close: total variation within sampling noise
    tv = 0.5 * float((counts / n - probs).abs().sum())
    assert tv < 0.05 if shape == "peaked" else tv < 0.12


def test_ties_rank_by_token_id() -> None:
    """Ten equal logits (ids 3, 9, 40, ...) and a long tail far below: top_p 0.35 keeps the
    four smallest ids of the ten, uniformly (a sort's order among equal logits)."""
    vocab, n = 300, 8000
    row = torch.full((vocab,), -40.0)
    ids = torch.tensor([3, 9, 40, 41, 77, 100, 150, 200, 250, 299])
    row[ids] = 5.0
    p = SamplingParams(temperature=1.0, top_p=0.35)
    probs = reference_probs(row, p)
    assert set(probs.nonzero().squeeze(1).tolist()) == {3, 9, 40, 41}
    tokens = Sampler(seed=0)(row.repeat(n, 1), _metadata([p] * n)).sampled_token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
    assert set(counts.nonzero().squeeze(1).tolist()) == {3, 9, 40, 41}
    chi2 = float(((counts[[3, 9, 40, 41]] - n / 4) ** 2 / (n / 4)).sum())
    assert chi2 < 16.27  # 3 degrees of freedom, p = 0.001


@pytest.mark.parametrize(
    "off", [{"top_p": 1.0}, {"top_k": -1}, {"top_k": 0}, {"min_p": 0.0}, {"top_k": 10_000}]
)
def test_filters_that_are_off_draw_as_plain_temperature(off: dict) -> None:
    """The same seed draws the same tokens with a filter switched off as without it."""
    vocab = 500
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(4)) * 2
    plain = [SamplingParams(temperature=0.9, seed=i) for i in range(6)]
    with_off = [SamplingParams(temperature=0.9, seed=i, **off) for i in range(6)]
    for _ in range(3):
        a = Sampler(seed=0)(logits, _metadata(plain)).sampled_token_ids
        b = Sampler(seed=0)(logits, _metadata(with_off)).sampled_token_ids
        assert a == b


def test_min_p_one_and_tiny_top_p_keep_the_top_token() -> None:
    vocab = 400
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=1.5, min_p=1.0), SamplingParams(top_p=1e-6)] * 2
    for _ in range(5):
        out = Sampler()(logits, _metadata(params)).sampled_token_ids
        assert out == logits.argmax(dim=-1).tolist()


def _seeded_runs(dtype: torch.dtype, kernels: RowKernels | None) -> list[list[int]]:
    """The tokens of two seeded rows (top-p; plain) over 5 steps, in different batches."""
    vocab = 1000
    g = torch.Generator().manual_seed(6)
    rows = [torch.randn(vocab, generator=g) * s for s in (2.5, 0.4)]
    targets = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=11),
        SamplingParams(temperature=1.1, seed=12),
    ]
    others_by_run = [
        [],
        [SamplingParams(temperature=0.0)],
        [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.0, top_p=0.3)],
        [SamplingParams(temperature=1.0, min_p=0.1)] * 5,
    ]
    runs = []
    for i, others in enumerate(others_by_run):
        params = [*others, *targets]  # the targets sit at different positions
        gens = {len(others): make_generator(11), len(others) + 1: make_generator(12)}
        md = _metadata(params, gens)
        sampler = Sampler(seed=i)  # unseeded rows differ from run to run
        if kernels is not None:
            sampler._kernels = kernels
        tokens = []
        for _ in range(5):
            logits = torch.randn(len(params), vocab, generator=g) * 3
            logits[-2], logits[-1] = rows
            with torch.inference_mode():
                x = logits.to(dtype)
            out = sampler(x, md).sampled_token_ids
            tokens += out[-2:]
        runs.append(tokens)
    return runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_seeded_rows_draw_the_same_tokens_in_any_batch(dtype: torch.dtype) -> None:
    runs = _seeded_runs(dtype, None)
    assert all(r == runs[0] for r in runs)
    assert len(set(runs[0][0::2])) > 1 and len(set(runs[0][1::2])) > 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_kernels_draw_like_native_ones(dtype: torch.dtype) -> None:
    """The eager torch row kernels (where no compiler builds the native ones, and off CPU)
    and the native CPU ones: the same tokens for the same seeds, batch-independent."""
    eager = _seeded_runs(dtype, RowKernels(native=False))
    assert all(r == eager[0] for r in eager)
    assert eager == _seeded_runs(dtype, None)


@pytest.mark.slow
def test_compiled_kernels_draw_like_eager_ones() -> None:
    """Compiled (inductor) and eager kernels: the same tokens for the same seeds, and seeded
    rows still independent of their batch (the compiled graphs serve any row count)."""
    kernels = RowKernels(native=False)  # the native kernels would serve before the graphs
    kernels.compile(1000, torch.device("cpu"), (torch.float32, torch.bfloat16))
    assert kernels.compiled
    for dtype in (torch.float32, torch.bfloat16):
        compiled = _seeded_runs(dtype, kernels)
        assert all(r == compiled[0] for r in compiled)
        assert compiled == _seeded_runs(dtype, RowKernels(native=False))


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("scale", [1 - 2e-7, 1 + 2e-7])
def test_the_ends_of_u_draw_the_first_and_last_candidates_whatever_the_block_sums_rounding(
    native: bool, scale: float
) -> None:
    """A block's sum is an fp32 sum, ~1e-7 of itself away from the float64 sum of its
    weights; a candidate lighter than that rounding must still be the one a u next to 1
    draws (it was skipped when the fp32 sum came out low), and the first one u = 0 draws."""
    from pagemill.runtime.sample.row_kernels import BLOCK

    kernels = RowKernels(native=native)
    vocab = 3 * BLOCK + 5  # the last block is partial
    x = torch.zeros(1, vocab)
    x[0, -1] = -20.0  # weight ~2e-9: below the rounding of its block's sum
    x[0, :40] = float("-inf")  # the first candidates are not at column 0
    t = torch.ones(1)
    thr_z = torch.full((1,), float("-inf"))
    thr_id = torch.full((1,), vocab, dtype=torch.long)
    peak = kernels.scaled_max(x, None, t)
    sums = kernels.block_sums(x, None, t, peak, thr_z, thr_id).clone()
    sums[0, -1] *= scale  # as an fp32 sum may round it, either way
    ends = torch.tensor([1.0 - 2**-53])
    got = kernels.pick(x, None, sums, ends, t, peak, thr_z, thr_id)
    assert got.tolist() == [vocab - 1]
    got = kernels.pick(x, None, sums, torch.zeros(1, dtype=torch.float64), t, peak, thr_z, thr_id)
    assert got.tolist() == [40]
