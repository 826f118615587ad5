"""Penalties and logit_bias in the native CPU pass: against a float64 reference of their
semantics, bit for bit against the torch path, and the same seeded tokens either way.

The semantics (vLLM's and HF's): logit_bias is added first; a repetition penalty divides
the positive logits and multiplies the others of every id seen in the prompt or the
output; frequency x (count in the output) + presence is subtracted from every id of the
output. Ids outside the vocabulary are ignored.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch

from pagemill.kernels import sampler_cpu
from pagemill.runtime.sample.row_kernels import RowKernels
from pagemill.runtime.sample.sampler import Sampler
from pagemill.runtime.sample.sampling_metadata import SamplingMetadata
from pagemill.runtime.sampling_params import SamplingParams

VOCAB = 3000
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def _native() -> None:
    if sampler_cpu.load() is None:
        pytest.skip("the sampler's native CPU kernels could not be built here")


def _torch_sampler(seed: int = 0) -> Sampler:
    s = Sampler(seed=seed)
    s._kernels = RowKernels(native=False)
    return s


def _all_combinations(**extra: object) -> list[SamplingParams]:
    """One row per combination of the three penalties (off, positive, negative-ish) and
    a bias map or none."""
    bias = {5: 3.5, 17: -2.25, VOCAB - 1: 1.0, 400: -100.0}
    return [
        SamplingParams(
            repetition_penalty=rep,
            frequency_penalty=freq,
            presence_penalty=pres,
            logit_bias=b,
            **extra,  # type: ignore[arg-type]
        )
        for rep, freq, pres, b in itertools.product(
            (1.0, 1.3, 0.6), (0.0, 0.7, -0.4), (0.0, 0.5, -1.2), (None, bias)
        )
    ]


def _histories(rows: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts with repeats and ids past the vocabulary; outputs drawn from a small set of
    ids (so counts exceed 1) that overlaps the prompts and the biased ids."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(VOCAB + 8, (int(n),), generator=g).tolist() for n in
               torch.randint(1, 90, (rows,), generator=g)]  # fmt: skip
    outputs = [torch.randint(0, 64, (int(n),), generator=g).tolist() for n in
               torch.randint(0, 40, (rows,), generator=g)]  # fmt: skip
    for p, o in zip(prompts, outputs):
        p += [5, 17, 5]
        o += [VOCAB + 2, 17]
    return prompts, outputs


def _logits(rows: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, VOCAB, generator=g) * 4
    x[:, :64] += 3  # the output ids: positive and negative logits both penalised
    x[0, 3] = float("-inf")
    return x.to(dtype)


def _reference(
    x: torch.Tensor,
    params: Sequence[SamplingParams],
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
) -> torch.Tensor:
    """The penalised logits in float64, token by token."""
    ref = x.double().clone()
    for r, p in enumerate(params):
        for t, b in (p.logit_bias or {}).items():
            ref[r, t] += b
        counts: dict[int, int] = {}
        for t in outputs[r]:
            if 0 <= t < VOCAB:
                counts[t] = counts.get(t, 0) + 1
        if p.repetition_penalty != 1.0:
            for t in {t for t in prompts[r] if 0 <= t < VOCAB} | counts.keys():
                v = ref[r, t]
                ref[r, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for t, c in counts.items():
            ref[r, t] -= p.frequency_penalty * c + p.presence_penalty
    return ref


def _metadata(params, prompts, outputs, **kw) -> SamplingMetadata:  # type: ignore[no-untyped-def]
    return SamplingMetadata.from_params(
        params, output_token_ids=outputs, prompt_token_ids=prompts, **kw
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_combination_matches_float64_and_the_torch_path(dtype: torch.dtype) -> None:
    params = _all_combinations(temperature=0.8)
    prompts, outputs = _histories(len(params), seed=1)
    x = _logits(len(params), dtype, seed=2)
    before = x.clone()
    md = _metadata(params, prompts, outputs)
    with torch.inference_mode():
        native = Sampler()._apply_min_tokens_and_penalties(x, md, in_place=False).clone()
        torch_path = _torch_sampler()._apply_min_tokens_and_penalties(x, md, in_place=False)
    assert torch.equal(x, before), "the caller's logits changed"
    assert native.dtype == torch.float32
    ref = _reference(x, params, prompts, outputs)
    # Rows without any rule are the logits themselves; the others moved where expected.
    assert torch.equal(native.isinf(), ref.isinf())
    finite = ref.isfinite()
    torch.testing.assert_close(native.double()[finite], ref[finite], rtol=2e-6, atol=1e-5)
    assert int((native != x.float()).sum()) > 1000
    # The same fp32 operations in the same order as the torch path: identical bits.
    assert torch.equal(native, torch_path)


@pytest.mark.parametrize("dtype", DTYPES)
def test_in_place_on_the_samplers_own_fp32_copy(dtype: torch.dtype) -> None:
    params = _all_combinations()
    prompts, outputs = _histories(len(params), seed=3)
    x = _logits(len(params), dtype, seed=4)
    md = _metadata(params, prompts, outputs)
    with torch.inference_mode():
        want = _torch_sampler()._apply_min_tokens_and_penalties(x, md, in_place=False).clone()
        own = x.float()
        got = Sampler()._apply_min_tokens_and_penalties(own, md, in_place=True)
    assert got.data_ptr() == own.data_ptr()
    assert torch.equal(got, want)


def _sampling_params(rows: int) -> list[SamplingParams]:
    g = torch.Generator().manual_seed(rows)
    combos = _all_combinations()

    def pick(options: Sequence[object]) -> object:
        return options[int(torch.randint(len(options), (1,), generator=g))]

    return [
        replace(
            combos[r % len(combos)],
            temperature=pick([0.0, 0.7, 1.3]),
            top_k=pick([0, 0, 20]),
            top_p=pick([1.0, 0.9]),
            min_p=pick([0.0, 0.05]),
            seed=r,
            logprobs=pick([None, None, 2]),
        )
        for r in range(rows)
    ]


@pytest.mark.parametrize("dtype", DTYPES)
def test_seeded_tokens_and_logprobs_are_the_torch_paths(dtype: torch.dtype) -> None:
    """Steps of a decode: each appends the sampled token to its row's output; the native
    pass (histories synced incrementally) and the torch path draw the same tokens and
    report the same raw logprobs."""
    params = _sampling_params(40)
    prompts, outputs = _histories(len(params), seed=5)
    outs = {"native": [list(o) for o in outputs], "torch": [list(o) for o in outputs]}
    samplers = {"native": Sampler(seed=1), "torch": _torch_sampler(seed=1)}
    mds = {k: _metadata(params, prompts, outs[k]) for k in samplers}
    for step in range(4):
        x = _logits(len(params), dtype, seed=10 + step)
        got = {k: s(x, mds[k]) for k, s in samplers.items()}
        assert got["native"].sampled_token_ids == got["torch"].sampled_token_ids, step
        assert got["native"].logprob_token_ids == got["torch"].logprob_token_ids
        assert got["native"].logprobs == got["torch"].logprobs
        # Logprobs are the model's raw distribution, before bias and penalties.
        raw = torch.log_softmax(x.float(), dim=-1)
        lp = got["native"].logprobs
        ids = got["native"].logprob_token_ids
        assert lp is not None and ids is not None
        for r in range(len(params)):
            want = raw[r, ids[r]].tolist()
            assert lp[r] == pytest.approx(want, abs=1e-5)
        for k in samplers:
            for o, t in zip(outs[k], got[k].sampled_token_ids):
                o.append(t)


def test_reused_metadata_follows_the_outputs_and_replaced_ones() -> None:
    """The metadata's histories append new tokens only; a row whose output is another
    sequence (as speculative decoding's verified positions are) is read afresh."""
    params = _all_combinations()
    prompts, outputs = _histories(len(params), seed=6)
    md = _metadata(params, prompts, outputs)
    sampler = Sampler()
    g = torch.Generator().manual_seed(7)
    for step in range(5):
        for o in outputs:
            o += torch.randint(0, 64, (step % 3,), generator=g).tolist()
        x = _logits(len(params), torch.bfloat16, seed=step)
        fresh = _metadata(params, prompts, [list(o) for o in outputs])
        with torch.inference_mode():
            got = sampler._apply_min_tokens_and_penalties(x, md, in_place=False).clone()
            want = _torch_sampler()._apply_min_tokens_and_penalties(x, fresh, in_place=False)
        assert torch.equal(got, want), step
    penalised = [
        bool(p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty) for p in params
    ]
    assert md.token_histories is not None
    assert [h is not None for h in md.token_histories] == penalised
    drafted = [[*o, 1, 2, 3] for o in outputs]
    spec = replace(md, output_token_ids=drafted)
    x = _logits(len(params), torch.float32, seed=9)
    with torch.inference_mode():
        got = sampler._apply_min_tokens_and_penalties(x, spec, in_place=False).clone()
        fresh = _metadata(params, prompts, drafted)
        want = _torch_sampler()._apply_min_tokens_and_penalties(x, fresh, in_place=False)
        assert torch.equal(got, want)
        # ... and the original metadata is still right afterwards.
        got = sampler._apply_min_tokens_and_penalties(x, md, in_place=False).clone()
        fresh = _metadata(params, prompts, [list(o) for o in outputs])
        want = _torch_sampler()._apply_min_tokens_and_penalties(x, fresh, in_place=False)
    assert torch.equal(got, want)


def test_a_rows_result_does_not_depend_on_its_batch() -> None:
    params = _all_combinations(temperature=0.9)
    prompts, outputs = _histories(len(params), seed=8)
    x = _logits(len(params), torch.bfloat16, seed=11)
    md = _metadata(params, prompts, outputs)
    with torch.inference_mode():
        whole = Sampler()._apply_min_tokens_and_penalties(x, md, in_place=False).clone()
        for rows in ([7], [40, 3, 22], list(range(0, len(params), 5))):
            sub = _metadata(
                [params[r] for r in rows], [prompts[r] for r in rows], [outputs[r] for r in rows]
            )
            part = Sampler()._apply_min_tokens_and_penalties(x[rows], sub, in_place=False)
            assert torch.equal(part, whole[rows])


def test_bias_and_bans_compose_as_in_the_torch_path() -> None:
    """Allowed ids, min_tokens bans and a penalty on the same ids: the native pass runs
    before the bans, the torch path after the bias; the results agree."""
    params = [
        SamplingParams(
            repetition_penalty=1.5,
            frequency_penalty=0.3,
            logit_bias={5: 2.0, 9: -1.0},
            allowed_token_ids=[5, 9, 17, 30],
        ),
        SamplingParams(presence_penalty=1.0, min_tokens=5, stop_token_ids=[17], logit_bias={17: 9}),
    ]
    prompts = [[5, 9, 9], [17, 17]]
    outputs = [[17, 30, 30], [17, 2]]
    x = _logits(2, torch.bfloat16, seed=12)
    md = _metadata(params, prompts, outputs, banned_until_min=[frozenset({0})] * 2)
    with torch.inference_mode():
        got = Sampler()._apply_min_tokens_and_penalties(x, md, in_place=False).clone()
        want = _torch_sampler()._apply_min_tokens_and_penalties(x, md, in_place=False)
    assert torch.equal(got, want)
    assert got[0].isfinite().sum() == 4 and got[1, 17] == float("-inf")


def test_a_bias_id_outside_the_vocabulary_is_an_error() -> None:
    md = _metadata([SamplingParams(logit_bias={VOCAB: 1.0})], [[1]], [[]])
    with torch.inference_mode(), pytest.raises(ValueError, match="logit_bias"):
        Sampler()._apply_min_tokens_and_penalties(
            _logits(1, torch.float32, seed=0), md, in_place=False
        )


def test_without_native_kernels_the_torch_path_serves() -> None:
    """PAGEMILL_NATIVE_CPU_KERNELS=0: no library, and penalties still apply (torch)."""
    code = (
        "import torch\n"
        "from pagemill.kernels import sampler_cpu\n"
        "from pagemill.runtime.sample.sampler import Sampler\n"
        "from pagemill.runtime.sample.sampling_metadata import SamplingMetadata\n"
        "from pagemill.runtime.sampling_params import SamplingParams\n"
        "assert sampler_cpu.load() is None\n"
        "p = SamplingParams(temperature=0.0, repetition_penalty=1e6, logit_bias={3: 0.5})\n"
        "md = SamplingMetadata.from_params([p], output_token_ids=[[]], prompt_token_ids=[[7]])\n"
        "x = torch.zeros(1, 16, dtype=torch.bfloat16); x[0, 7] = 5.0; x[0, 3] = 4.0\n"
        "assert Sampler()(x, md).sampled_token_ids == [3]\n"
    )
    env = {**os.environ, "PAGEMILL_NATIVE_CPU_KERNELS": "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_input_batch_keeps_each_requests_history_across_rebuilds() -> None:
    """The runner's metadata is rebuilt whenever its batch changes; each penalised row's
    history is its request's, synced by appending, and the logits are the torch path's."""
    from pagemill.runtime.worker.input_batch import CachedRequestState, InputBatch
    from pagemill.scheduler import Request

    params = _all_combinations(temperature=0.8)[:12]
    prompts, outputs = _histories(len(params), seed=13)
    batch = InputBatch(len(params), 4, torch.device("cpu"))
    states = []
    for r, p in enumerate(params):
        req = Request(f"r{r}", prompts[r], sampling_params=p)
        for t in outputs[r]:
            req.append_output_token(t)
        states.append(CachedRequestState.create(req, torch.device("cpu")))
        batch.add(states[-1], [r])
    sampler = Sampler()
    for step in range(3):
        md = batch.sampling_metadata()
        assert md.token_histories is not None
        live = [s for s in states if s.request.request_id in batch.row_of]
        assert [h for h in md.token_histories] == [s.history for s in live]
        x = _logits(len(live), torch.bfloat16, seed=20 + step)
        fresh = _metadata(
            [s.params for s in live],
            [list(s.request.prompt_token_ids) for s in live],
            [list(s.request.output_token_ids) for s in live],
        )
        with torch.inference_mode():
            got = sampler._apply_min_tokens_and_penalties(x, md, in_place=False).clone()
            want = _torch_sampler()._apply_min_tokens_and_penalties(x, fresh, in_place=False)
        assert torch.equal(got, want), step
        for s in live:
            s.request.append_output_token(step * 7 % 64)
        batch.remove(live[step * 3].request.request_id)


def test_engine_repetition_penalty_matches_transformers(tiny_llama, random_prompts) -> None:
    """Through the engine (rows admitted and finished between steps, so the batch's
    metadata is rebuilt while histories carry on): greedy with a repetition penalty
    equals transformers' `generate(repetition_penalty=...)` token for token, and rows
    without a penalty in the same batch stay plain greedy."""
    from pagemill.runtime import LLM

    folder, model = tiny_llama
    prompts = random_prompts([5, 30, 12, 2, 41, 9], model.config.vocab_size, seed=21)
    max_tokens = [14, 6, 20, 9, 11, 17]
    penalties = [1.8, 1.0, 1.3, 2.5, 1.0, 0.7]
    llm = LLM(
        str(folder),
        dtype="float32",
        max_num_seqs=3,
        max_num_batched_tokens=64,
        kv_cache_memory_bytes=4 << 20,
    )
    params = [
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m, repetition_penalty=p)
        for m, p in zip(max_tokens, penalties)
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)

    def hf(prompt: list[int], m: int, p: float) -> list[int]:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=m,
                do_sample=False,
                repetition_penalty=p,
                eos_token_id=[],
                pad_token_id=0,
            )
        return out[0, len(prompt) :].tolist()

    changed = 0
    for prompt, m, p, out in zip(prompts, max_tokens, penalties, outs):
        want = hf(prompt, m, p)
        assert out.outputs[0].token_ids == want, f"penalty {p}, prompt of {len(prompt)}"
        changed += p != 1.0 and want != hf(prompt, m, 1.0)
    assert changed >= 2, "the penalties should change some continuations"
