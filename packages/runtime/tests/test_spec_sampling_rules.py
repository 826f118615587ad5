"""Sampling rules that read the history, with speculative decoding: every verified position
sees the drafts before it. Logprobs (every emitted token reports the target's own logprobs
at its position) are checked against transformers' log-softmax over the same sequence;
repetition penalty and min_tokens against transformers' generate with its own logits
processors; presence/frequency penalties and bad words against the same engine without
speculation."""

from __future__ import annotations

import pytest
import torch

from pagemill.runtime import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip


def test_logprobs_with_ngram_are_the_targets_per_token(tiny_llama, random_prompts) -> None:
    folder, model = tiny_llama
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=4 << 20,
              speculative_config=NGRAM)  # fmt: skip
    # Repeating prompts: the n-gram proposer has matches from the first step on.
    prompts = [p * 4 for p in random_prompts([3, 5], model.config.vocab_size, seed=11)]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24, logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats.spec_num_accepted_tokens > 0
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids) == 24
        seq = torch.tensor([prompt + list(c.token_ids)])
        with torch.no_grad():
            ref = torch.log_softmax(model(seq).logits[0].double(), dim=-1)
        total = 0.0
        for j, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            row = ref[len(prompt) - 1 + j]
            assert tok == int(row.argmax())
            assert set(entry) == {tok, *row.topk(3).indices.tolist()}
            for t, lp in entry.items():
                assert lp == pytest.approx(float(row[t]), abs=1e-4)
            total += entry[tok]
        assert c.cumulative_logprob == pytest.approx(total)


def _hf_generate(model, prompt: list[int], n: int, **kw) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, **kw)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def pair(tiny_llama) -> tuple[LLM, LLM]:
    folder, _ = tiny_llama
    kw = dict(dtype="float32", kv_cache_memory_bytes=4 << 20)
    return LLM(str(folder), **kw), LLM(str(folder), speculative_config=NGRAM, **kw)


def test_repetition_penalty_and_min_tokens_with_ngram_match_transformers(
    tiny_llama, pair, random_prompts
) -> None:
    _, model = tiny_llama
    _, spec_llm = pair
    prompts = [p * 4 for p in random_prompts([3, 4], model.config.vocab_size, seed=12)]
    eos = model.config.eos_token_id
    before = spec_llm.llm_engine.get_stats().spec_num_accepted_tokens
    rep = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=40, repetition_penalty=1.05)
    outs = spec_llm.generate(prompts, rep, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        want = _hf_generate(model, prompt, 40, repetition_penalty=1.05, eos_token_id=None)
        assert list(out.outputs[0].token_ids) == want
    # min_tokens: EOS, pushed up by a bias, is banned for the first 30 tokens (HF's
    # min_new_tokens) and taken as soon as it is allowed: drafts crossing that boundary
    # must see their own output length.
    mt = SamplingParams(temperature=0.0, max_tokens=40, min_tokens=30, logit_bias={eos: 30.0})
    outs = spec_llm.generate(prompts, mt, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        want = _hf_generate(
            model, prompt, 40, min_new_tokens=30, eos_token_id=eos, sequence_bias={(eos,): 30.0}
        )
        assert want[-1] == eos and len(want) == 31
        assert list(out.outputs[0].token_ids) == want
    assert spec_llm.llm_engine.get_stats().spec_num_accepted_tokens > before


@pytest.mark.slow  # six decodes; the position-by-position test below is the exact one
def test_presence_frequency_and_bad_words_with_ngram_equal_no_speculation(
    tiny_llama, pair, random_prompts
) -> None:
    plain_llm, spec_llm = pair
    vocab = tiny_llama[1].config.vocab_size
    prompts = [p * 4 for p in random_prompts([3, 5], vocab, seed=13)]
    (first,) = plain_llm.generate(
        [prompts[0]], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12),
        use_tqdm=False,
    )  # fmt: skip
    ref = list(first.outputs[0].token_ids)
    params = [
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24, presence_penalty=0.7),
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24, frequency_penalty=0.4),
        # A two-token word the plain output holds, and a one-token word it uses later.
        SamplingParams(
            temperature=0.0,
            ignore_eos=True,
            max_tokens=24,
            bad_words_token_ids=[ref[2:4], [ref[6]]],
        ),
    ]
    before = spec_llm.llm_engine.get_stats().spec_num_accepted_tokens
    for p in params:
        want = plain_llm.generate(prompts, p, use_tqdm=False)
        got = spec_llm.generate(prompts, p, use_tqdm=False)
        for w, g in zip(want, got):
            assert list(g.outputs[0].token_ids) == list(w.outputs[0].token_ids), p
    assert spec_llm.llm_engine.get_stats().spec_num_accepted_tokens > before


# ---- the verify step against one-token steps, position by position -------------------


def _md(params: SamplingParams, outputs: list[list[int]], prompt: list[int]):
    from pagemill.runtime.sample.sampling_metadata import SamplingMetadata

    n = len(outputs)
    return SamplingMetadata.from_params(
        [params] * n, output_token_ids=outputs, prompt_token_ids=[prompt] * n
    )


def _verify(sampler, params, logits, prompt, history, drafts, fix: bool) -> list[int]:
    """One greedy verify step of `drafts` (rows logits[:k], bonus row logits[k])."""
    from pagemill.runtime.sample.rejection_sampler import RejectionSampler, with_draft_history

    k = len(drafts)
    main = _md(params, [list(history)], prompt)
    rows = _md(params, [list(history)] * k, prompt)
    if fix:
        main, rows = with_draft_history(main, rows, [0], [drafts])
    bonus = sampler(logits[k:], main).sampled_token_ids
    return RejectionSampler(sampler)(logits[:k], rows, [drafts], bonus)[0]


@pytest.mark.parametrize(
    "rule",
    [
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"repetition_penalty": 2.0},
        {"min_tokens": 3, "stop_token_ids": [3]},
        {"bad_words_token_ids": [[4, 5], [6, 4, 7]]},
    ],
)
def test_verified_positions_see_the_drafts_before_them(rule: dict) -> None:
    """Greedy verification with `with_draft_history` emits exactly what one-token steps
    with the plain sampler emit, each seeing the tokens emitted before it; without the
    drafts in the history it would not (checked: some case must differ)."""
    from pagemill.runtime.sample.sampler import Sampler

    vocab, k = 12, 4
    sampler = Sampler(seed=0)
    params = SamplingParams(temperature=0.0, **rule)
    g = torch.Generator().manual_seed(0)
    differs = 0
    for case in range(60):
        prompt = torch.randint(0, vocab, (3,), generator=g).tolist()
        history = torch.randint(0, vocab, (case % 3,), generator=g).tolist()
        # Rows that favour a few tokens, so the rules decide between close candidates.
        logits = torch.randn(k + 1, vocab, generator=g)
        logits[:, [3, 4, 5, 6, 7]] += 4.0
        # The reference: one-token steps, each with the tokens before it in its history.
        ref: list[int] = []
        for j in range(k + 1):
            md = _md(params, [history + ref], prompt)
            ref += sampler(logits[j : j + 1], md).sampled_token_ids
        # Drafts: the reference's tokens, one of them swapped in every other case.
        drafts = list(ref[:k])
        if case % 2:
            drafts[case % k] = (drafts[case % k] + 1) % vocab
        want: list[int] = []
        for j, d in enumerate(drafts):
            want.append(ref[j])
            if d != ref[j]:
                break
        else:
            want.append(ref[k])
        got = _verify(sampler, params, logits, prompt, history, drafts, fix=True)
        assert got == want, case
        differs += _verify(sampler, params, logits, prompt, history, drafts, fix=False) != want
    assert differs > 0


def _bitmask(allowed: list[int], vocab: int) -> torch.Tensor:
    words = torch.zeros((vocab + 31) // 32, dtype=torch.int64)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return words.to(torch.int32)


def test_masked_rejection_sampling_keeps_the_masked_distribution() -> None:
    """At temperature 1 with a grammar mask per verified position, each emitted token
    follows the target's masked distribution there (chi-square, 20000 seeded draws); a
    draft the mask bans is never emitted from its own row."""
    import math

    from pagemill.runtime.sample.rejection_sampler import RejectionSampler
    from pagemill.runtime.sample.sampler import Sampler
    from pagemill.runtime.sample.sampling_metadata import SamplingMetadata

    g = torch.Generator().manual_seed(3)
    vocab, n = 10, 20000
    logits = torch.randn(3, vocab, generator=g) * 1.5
    allowed = [[0, 2, 3, 5, 7], [1, 2, 4, 8], [0, 1, 9]]
    masks = [_bitmask(a, vocab) for a in allowed]

    def masked_probs(j: int) -> torch.Tensor:
        z = torch.full((vocab,), float("-inf"), dtype=torch.float64)
        z[allowed[j]] = logits[j, allowed[j]].double()
        return torch.softmax(z, dim=-1)

    p = [masked_probs(j) for j in range(3)]
    d0 = max(allowed[0], key=lambda t: float(p[0][t]))  # likely, allowed
    d1 = 3  # banned by row 1's mask
    sampler = Sampler(seed=1)
    sp = SamplingParams(temperature=1.0)

    def md(rows: int, mask: torch.Tensor) -> SamplingMetadata:
        return SamplingMetadata.from_params(
            [sp] * rows,
            output_token_ids=[[]] * rows,
            prompt_token_ids=None,
            token_bitmask=mask,
        )

    bonus = sampler(logits[2:].expand(n, -1).contiguous(), md(n, masks[2].expand(n, -1)))
    draft_mask = torch.stack([masks[0], masks[1]]).repeat(n, 1)
    out = RejectionSampler(sampler, seed=2)(
        logits[:2].repeat(n, 1), md(2 * n, draft_mask), [[d0, d1]] * n, bonus.sampled_token_ids
    )

    def follows(samples: list[int], probs: torch.Tensor) -> None:
        counts = torch.bincount(torch.tensor(samples), minlength=vocab).double()
        expected = probs * counts.sum()
        assert counts[expected == 0].sum() == 0, "a masked-out token was emitted"
        keep = expected > 0
        stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
        df = int(keep.sum()) - 1
        a = 2.0 / (9 * df)
        assert stat < df * (1 - a + 3.29 * math.sqrt(a)) ** 3, stat  # p = 0.0005

    follows([t[0] for t in out], p[0])
    second = [t[1] for t in out if t[0] == d0]
    assert second and d1 not in second and all(len(t) == 2 for t in out if t[0] == d0)
    follows(second, p[1])
