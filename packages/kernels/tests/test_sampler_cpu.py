"""The sampler's native CPU passes against plain-torch float64 references.

Built on first use with the host compiler; where none exists the tests skip (the sampler's
torch kernels then serve, and the runtime's sampler tests cover them).
"""

from __future__ import annotations

import pytest
import torch

from pagemill.kernels import sampler_cpu

BLOCK = 256
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def lib():
    built = sampler_cpu.load()
    if built is None:
        pytest.skip("the sampler's native CPU kernels could not be built here")
    return built


def _logits(rows: int, vocab: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 3
    x[:, torch.randint(vocab, (8,), generator=g)] += 9  # a few likely tokens per row
    return x.to(dtype)


def _weights64(
    x: torch.Tensor, t: torch.Tensor, thr_z: torch.Tensor | None, thr_id: torch.Tensor | None
) -> torch.Tensor:
    """Float64 exp(z - peak) of the candidates, z = x / t rounded to fp32 as the sampler's."""
    z = x.float() / t.unsqueeze(1)
    peak = z.amax(dim=-1, keepdim=True)
    w = (z.double() - peak.double()).exp()
    if thr_z is not None and thr_id is not None:
        ids = torch.arange(x.shape[1]).unsqueeze(0)
        tz = thr_z.unsqueeze(1)
        keep = (z > tz) | ((z == tz) & (ids < thr_id.unsqueeze(1)))
        w = torch.where(keep, w, 0.0)
    return w


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_is_torch_argmax(lib, dtype: torch.dtype) -> None:
    x = _logits(9, 1000, dtype)
    x[1, 7] = x[1, 500] = 1e4  # ties: the first
    x[2] = float("-inf")
    x[3, 40] = x[3, 900] = float("nan")  # torch: the first NaN
    x[4, 999] = 1e4  # the last column
    assert torch.equal(sampler_cpu.argmax(lib, x), x.argmax(dim=-1))
    rows = torch.tensor([8, 1, 3])
    assert torch.equal(sampler_cpu.argmax(lib, x, rows), x[rows].argmax(dim=-1))
    wide = _logits(5, 1500, dtype)
    view = wide[:, 100:1300]  # rows of a larger tensor: a row stride that is not the vocab
    assert torch.equal(sampler_cpu.argmax(lib, view), view.argmax(dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
# a last block that is partial, or whole, or ends in fewer columns than a vector holds
@pytest.mark.parametrize("vocab", [1000, 1024, 1003])
def test_block_sums_match_float64(lib, dtype: torch.dtype, vocab: int) -> None:
    x = _logits(6, vocab, dtype)
    x[0, 100:300] = float("-inf")  # masked tokens weigh exactly 0
    t = torch.tensor([0.8, 1.0, 0.3, 2.0, 1.3, 0.05])
    peak, sums = sampler_cpu.block_sums(lib, x, None, t, None, None, None, BLOCK)
    assert torch.equal(peak, (x.float() / t.unsqueeze(1)).amax(dim=-1))  # bit for bit
    w = _weights64(x, t, None, None)
    pad = (-vocab) % BLOCK
    ref = torch.nn.functional.pad(w, (0, pad)).view(6, -1, BLOCK).sum(dim=-1)
    torch.testing.assert_close(sums.double(), ref, rtol=2e-6, atol=1e-30)
    assert sums[0, 0] > 0 and (sums[0, 1] == 0) == (ref[0, 1] == 0)

    # Candidates above a threshold token, with ties at the threshold broken by id.
    rows = torch.tensor([5, 2, 0, 3])
    s = torch.tensor([10, 20, 30, 40])
    thr_z = x[rows, s].float() / t[rows]
    xr = x[rows].clone()
    xr[:, 5] = x[rows, s]  # a tie with a smaller id: ranked above
    xr[:, vocab - 1] = x[rows, s]  # a tie with a larger id: ranked below
    pr, got = sampler_cpu.block_sums(lib, xr, None, t[rows], peak[rows], thr_z, s, BLOCK)
    assert torch.equal(pr, peak[rows])
    ref = _weights64(xr, t[rows], thr_z, s)
    # The reference's peak is its own rows' (the same: the tie columns are not above it).
    ref = torch.nn.functional.pad(ref, (0, pad)).view(4, -1, BLOCK).sum(dim=-1)
    torch.testing.assert_close(got.double(), ref, rtol=2e-6, atol=1e-30)
    # Exactly 0 where nothing ranks above the threshold (weights below exp(-87), ~1e-38
    # of the peak's, are flushed to 0 as well).
    assert bool((((got == 0) == (ref == 0)) | (ref < 1e-37)).all())
    # The same rows read through `rows` from the full tensor.
    x2 = x.clone()
    x2[rows] = xr
    _, via_rows = sampler_cpu.block_sums(lib, x2, rows, t[rows], peak[rows], thr_z, s, BLOCK)
    assert torch.equal(via_rows, got)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1000, 1003])
def test_pick_is_the_inverse_cdf(lib, dtype: torch.dtype, vocab: int) -> None:
    """The token whose float64 running weight first exceeds u x the candidates' total."""
    rows = 64
    x = _logits(rows, vocab, dtype, seed=3)
    t = torch.full((rows,), 0.9)
    g = torch.Generator().manual_seed(4)
    u = torch.rand(rows, dtype=torch.float64, generator=g)
    u[0], u[1] = 0.0, 1.0 - 2**-53  # the ends: the first and the last candidate
    thr_id = torch.randint(vocab, (rows,), generator=g)
    thr_z = x[torch.arange(rows), thr_id].float() / t
    thr_z[:32], thr_id[:32] = float("-inf"), vocab  # first rounds: every token
    peak, sums = sampler_cpu.block_sums(lib, x, None, t, None, thr_z, thr_id, BLOCK)
    got = sampler_cpu.pick(lib, x, None, sums, u, t, peak, thr_z, thr_id, BLOCK)
    w = _weights64(x, t, thr_z, thr_id)
    cum = w.cumsum(dim=-1)
    want = torch.searchsorted(cum, (u * cum[:, -1]).unsqueeze(1), right=True).squeeze(1)
    last = torch.where(w > 0, torch.arange(vocab), 0).amax(dim=-1)
    want = torch.minimum(want, last)
    # fp32 block sums move the target by ~1e-7 of the total: a different token only for a
    # u that close to a boundary, which these seeds do not draw.
    assert torch.equal(got, want)
    assert bool((w[torch.arange(rows), got] > 0).all())  # never a token of weight 0
    assert got[0] == (w[0] > 0).nonzero()[0, 0]
    assert got[1] == last[1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("k", "vocab"), [(1, 999), (7, 999), (50, 999), (999, 999), (50, 5000)])
def test_topk_is_a_stable_sort_head(lib, dtype: torch.dtype, k: int, vocab: int) -> None:
    """The first k of a stable descending sort of z = x / t (equal z: smaller id first),
    with k below and above the kernel's count of 64-column chunks."""
    x = _logits(12, vocab, dtype, seed=k)
    x[2, 100:140] = x[2, 3]  # many ties, some at the cut
    x[3, 500:] = float("-inf")
    t = torch.linspace(0.2, 2.0, 12)
    rows = torch.tensor([11, 2, 3, 0, 5])
    values, ids = sampler_cpu.topk(lib, x, rows, t[rows], k)
    z = x[rows].float() / t[rows].unsqueeze(1)
    ref_values, ref_ids = z.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(ids, ref_ids[:, :k])
    assert torch.equal(values, ref_values[:, :k])


@pytest.mark.parametrize("dtype", DTYPES)
def test_penalize_is_a_float64_reference(lib, dtype: torch.dtype) -> None:
    """Bias, then repetition (prompt + output ids), then frequency x count + presence
    (output ids), at the seen ids only; ids outside the vocabulary ignored; fp32 in place
    or converted from bf16 into another tensor."""
    import numpy as np

    rows, vocab = 6, 700
    x = _logits(rows, vocab, dtype, seed=3)
    g = torch.Generator().manual_seed(4)
    rep = torch.tensor([1.0, 1.4, 0.7, 1.0, 2.0, 1.0])
    freq = torch.tensor([0.0, 0.5, -0.3, 1.0, 0.0, 0.0])
    pres = torch.tensor([0.0, 0.25, 0.0, -1.5, 0.0, 0.0])
    prompts = [np.unique(torch.randint(vocab + 5, (40,), generator=g).numpy()) for _ in range(rows)]
    outputs = [torch.randint(30, (int(n),), generator=g).numpy() for n in (0, 9, 25, 3, 12, 4)]
    outputs[2] = np.append(outputs[2], [vocab + 1, -1])
    bias = {0: {3: 1.5, 699: -2.0}, 2: {10: 0.25}, 5: {11: -7.0}}
    table = torch.tensor(
        [[p.ctypes.data, p.size, o.ctypes.data, o.size] for p, o in zip(prompts, outputs)]
    )
    offsets = torch.tensor([0, 2, 2, 3, 3, 3, 4])
    ids = torch.tensor([3, 699, 10, 11])
    values = torch.tensor([1.5, -2.0, 0.25, -7.0])
    ref = x.double().clone()
    for r in range(rows):
        for t, b in bias.get(r, {}).items():
            ref[r, t] += b
        out = [int(t) for t in outputs[r] if 0 <= t < vocab]
        if rep[r] != 1:
            for t in {int(t) for t in prompts[r] if t < vocab} | set(out):
                v = ref[r, t]
                ref[r, t] = v / rep[r].item() if v > 0 else v * rep[r].item()
        if freq[r] != 0 or pres[r] != 0:
            for t in set(out):
                ref[r, t] -= freq[r].item() * out.count(t) + pres[r].item()
    dst = x.clone() if dtype == torch.float32 else torch.empty(rows, vocab)
    sampler_cpu.penalize(lib, dst if dtype == torch.float32 else x, dst, rep, freq, pres, table,
                         (offsets, ids, values))  # fmt: skip
    torch.testing.assert_close(dst.double(), ref, rtol=2e-6, atol=1e-5)
    assert int((dst != x.float()).sum()) > 50
    with pytest.raises(ValueError, match="logit_bias"):
        sampler_cpu.penalize(lib, x, torch.empty(rows, vocab), rep, freq, pres, None,
                             (offsets, torch.tensor([3, vocab, 10, 11]), values))  # fmt: skip
