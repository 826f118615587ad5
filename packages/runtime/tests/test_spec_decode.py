"""Speculative decoding: the config, the n-gram proposer, the rejection sampler's
distribution, and the engine's greedy output against transformers with speculation on
(batched, chunked, prefix-cached, preempted)."""

from __future__ import annotations

import math

import pytest
import torch

from pagemill.runtime import LLM, SamplingParams
from pagemill.runtime.config import EngineConfig
from pagemill.runtime.sample.rejection_sampler import RejectionSampler
from pagemill.runtime.sample.sampler import Sampler
from pagemill.runtime.sample.sampling_metadata import SamplingMetadata
from pagemill.runtime.spec_decode import SpeculativeConfig
from pagemill.runtime.spec_decode.ngram_proposer import NgramProposer
from pagemill.runtime.spec_decode.proposer import speculates
from pagemill.scheduler import Request

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip
GREEDY = dict(temperature=0.0, ignore_eos=True)


# ---- config -------------------------------------------------------------------------------


def test_config_ngram_defaults_follow_vllm() -> None:
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    )
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    c = SpeculativeConfig.from_dict({"model": "/some/draft", "num_speculative_tokens": 2})
    assert c.method == "draft_model"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"method": "medusa", "model": "x", "num_speculative_tokens": 3}, "not supported yet"),
        ({"method": "eagle3", "num_speculative_tokens": 3}, "must name the EAGLE head"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
             "prompt_lookup_max": 2},
            "prompt_lookup_min",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "'typo'"),
        ({"method": "beam", "num_speculative_tokens": 2}, "method must be one of"),
    ],
)  # fmt: skip
def test_config_refusals_name_the_field(raw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(raw)
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(speculative_config=raw)


# ---- proposer -----------------------------------------------------------------------------


def test_ngram_takes_the_longest_match_and_its_latest_occurrence() -> None:
    p = NgramProposer(3, 1, 3)
    # Suffix [1, 2, 3] occurs at 0 (then 7) and at 8 (then 9, 9); [2, 3] alone also at 5.
    ctx = [1, 2, 3, 7, 0, 2, 3, 4, 1, 2, 3, 9, 9, 5, 1, 2, 3]
    assert p.propose(ctx) == [9, 9, 5]
    assert NgramProposer(3, 1, 1).propose(ctx) == [9, 9, 5]  # latest 1-gram [3] is at 10
    assert NgramProposer(2, 4, 5).propose(ctx) == []  # no earlier 4-gram
    assert NgramProposer(5, 1, 2).propose([4, 8, 4]) == [8, 4]  # fewer than k left
    assert NgramProposer(3, 1, 3).propose([1, 2, 3]) == []


def test_every_sampled_request_speculates() -> None:
    def req(**kw) -> Request:
        return Request("r", [1, 2], sampling_params=SamplingParams(**kw))

    for kw in (
        {"temperature": 0.7, "top_p": 0.9, "seed": 3},
        {"repetition_penalty": 1.2},
        {"presence_penalty": 0.5},
        {"min_tokens": 3},
        {"logprobs": 2},
        {"bad_words_token_ids": [[5, 6]]},
    ):
        assert speculates(req(**kw)), kw


# ---- rejection sampler --------------------------------------------------------------------


def _chi2_critical(df: int, z: float = 3.29) -> float:
    """Upper chi-square quantile by Wilson-Hilferty (z = 3.29: p = 0.0005)."""
    a = 2.0 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def _draws(logits: torch.Tensor, drafts: list[int], n: int, **params) -> list[list[int]]:
    """n independent verifications of `drafts` against per-position `logits` [k + 1, V]
    (the last row is the bonus row, drawn by the plain sampler)."""
    k = len(drafts)
    sampler = Sampler(seed=1)
    rejection = RejectionSampler(sampler, seed=2)
    sp = SamplingParams(**params)
    bonus_md = SamplingMetadata.from_params(
        [sp] * n, output_token_ids=[[]] * n, prompt_token_ids=None
    )
    bonus = sampler(logits[k:].expand(n, -1).contiguous(), bonus_md).sampled_token_ids
    md = SamplingMetadata.from_params(
        [sp] * (n * k), output_token_ids=[[]] * (n * k), prompt_token_ids=None
    )
    rows = logits[:k].repeat(n, 1)
    return rejection(rows, md, [drafts] * n, bonus)


def _target_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0) -> torch.Tensor:
    z = logits.double() / temperature
    if top_k:  # k best tokens only: the reference masks them with a plain topk
        keep = z.topk(top_k).indices
        z = torch.full_like(z, float("-inf")).scatter(0, keep, z[keep])
    return torch.softmax(z, dim=-1)


def _assert_follows(samples: list[int], probs: torch.Tensor) -> None:
    counts = torch.bincount(torch.tensor(samples), minlength=probs.numel()).double()
    n = counts.sum()
    expected = probs * n
    assert counts[expected == 0].sum() == 0, "a token of probability 0 was drawn"
    keep = expected > 0
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    assert stat < _chi2_critical(int(keep.sum()) - 1), stat


@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, 0), (0.8, 5)])
def test_rejection_sampling_keeps_the_target_distribution(temperature: float, top_k: int) -> None:
    g = torch.Generator().manual_seed(0)
    vocab = 10
    logits = torch.randn(3, vocab, generator=g) * 1.5
    p = [_target_probs(row, temperature, top_k) for row in logits]
    # Drafts: a likely token, then an unlikely one (both accepts and rejections happen).
    d0 = int(p[0].argsort(descending=True)[1])
    d1 = int(p[1].argsort(descending=True)[2])
    out = _draws(logits, [d0, d1], 20000, temperature=temperature, top_k=top_k)
    # First token ~ p0; second token, given the first draft was accepted, ~ p1.
    _assert_follows([t[0] for t in out], p[0])
    _assert_follows([t[1] for t in out if t[0] == d0], p[1])
    third = [t[2] for t in out if t[:2] == [d0, d1]]
    assert third, "no draw accepted both drafts"
    assert all(len(t) == 3 for t in out if t[:2] == [d0, d1])
    # Draws after an accepted first draft that rejected the second: the residual of p1.
    rejected = [t[1] for t in out if t[0] == d0 and t[1] != d1]
    assert all(len(t) == 2 for t in out if t[0] == d0 and t[1] != d1)
    assert rejected


def test_rejection_sampling_greedy_is_argmax() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 16, generator=g)
    best = logits.argmax(dim=-1).tolist()
    out = _draws(logits, best[:3], 2, temperature=0.0)
    assert out == [best, best]  # all accepted, then the bonus row's argmax
    wrong = [best[0], (best[1] + 1) % 16, best[2]]
    assert _draws(logits, wrong, 1, temperature=0.0) == [[best[0], best[1]]]


def test_seeded_verification_repeats() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 32, generator=g)

    def run() -> list[list[int]]:
        return _draws(logits, [3, 4, 5], 8, temperature=1.0, seed=11)

    assert run() == run()


# ---- the engine against transformers ------------------------------------------------------


def _repetitive(random_prompts, vocab: int) -> list[list[int]]:
    """Prompts that repeat themselves (so n-gram drafts exist), of several lengths. A random
    model seldom copies, so most drafts are rejected: on tiny_qwen2 these prompts see a few
    accepted (its greedy runs repeat a token now and then), which is what the tests need."""
    segs = random_prompts([10, 7, 13, 5], vocab, seed=21)
    return [segs[0] * 3, (segs[1] + segs[0]) * 2, segs[2] * 4, segs[3] * 5 + segs[0]]


def _check(llm, model, prompts, max_tokens, hf_greedy) -> None:
    outs = llm.generate(
        prompts, [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens], use_tqdm=False
    )
    for prompt, m, out in zip(prompts, max_tokens, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, m)
    stats = llm.llm_engine.get_stats()
    assert stats.spec_num_draft_tokens > 0
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert stats.kv_cache_usage == 0.0


def test_greedy_with_ngram_matches_hf_batched_chunked_cached(
    tiny_qwen2, hf_greedy, random_prompts
) -> None:
    folder, model = tiny_qwen2
    prompts = _repetitive(random_prompts, model.config.vocab_size)
    llm = LLM(
        str(folder),
        dtype="float32",
        max_num_batched_tokens=16,  # prompts chunked; drafts trimmed by the budget at times
        max_num_seqs=4,
        kv_cache_memory_bytes=4 << 20,
        enable_prefix_caching=True,
        speculative_config=NGRAM,
    )
    _check(llm, model, prompts, [40, 36, 40, 40], hf_greedy)
    # Again: the prompts' blocks are prefix hits now.
    before = llm.llm_engine.get_stats().prefix_cache_hits
    _check(llm, model, prompts, [40, 36, 40, 40], hf_greedy)
    assert llm.llm_engine.get_stats().prefix_cache_hits > before


def test_greedy_with_ngram_survives_preemption(tiny_qwen2, hf_greedy, random_prompts) -> None:
    folder, model = tiny_qwen2
    prompts = _repetitive(random_prompts, model.config.vocab_size)
    llm = LLM(
        str(folder),
        dtype="float32",
        max_model_len=128,
        kv_cache_memory_bytes=8 * 12288,  # 8 blocks of 16 tokens for four requests
        max_num_batched_tokens=64,
        speculative_config={**NGRAM, "num_speculative_tokens": 5},
    )
    _check(llm, model, prompts, [40, 36, 40, 40], hf_greedy)
    assert llm.llm_engine.num_blocks == 8
    assert llm.llm_engine.get_stats().num_preemptions > 0


def test_seeded_sampling_with_ngram_repeats(tiny_llama, random_prompts) -> None:
    folder, model = tiny_llama
    prompts = _repetitive(random_prompts, model.config.vocab_size)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=4 << 20,
              speculative_config=NGRAM)  # fmt: skip
    params = SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=5, ignore_eos=True)

    def run() -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    assert run() == run()
    assert llm.llm_engine.get_stats().spec_num_draft_tokens > 0


@pytest.mark.slow
def test_compiled_step_verifies_drafts(tiny_qwen2, hf_greedy, random_prompts) -> None:
    """The compiled forward (dynamic token counts) runs the verify steps too."""
    from pagemill.runtime.worker.compilation import ENFORCE_EAGER_ENV, compile_unavailable_reason

    reason = compile_unavailable_reason(torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)
    folder, model = tiny_qwen2
    prompts = _repetitive(random_prompts, model.config.vocab_size)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(ENFORCE_EAGER_ENV, raising=False)
        llm = LLM(
            str(folder),
            dtype="float32",
            max_num_batched_tokens=64,
            kv_cache_memory_bytes=4 << 20,
            speculative_config=NGRAM,
        )
    assert llm.llm_engine.engine_core.model_runner.compiled
    _check(llm, model, prompts, [40, 36, 40, 40], hf_greedy)


# ---- draft model --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def truncated_draft(tiny_qwen2, tmp_path_factory) -> str:
    """The target without its last layer (transformers' own copy, tokenizer alongside): a
    draft that agrees with the target often, not always."""
    import shutil

    import transformers

    folder, _ = tiny_qwen2
    draft = tmp_path_factory.mktemp("draft-2-layers")
    m = transformers.AutoModelForCausalLM.from_pretrained(folder)
    m.model.layers = m.model.layers[:2]
    m.config.num_hidden_layers = 2
    if getattr(m.config, "layer_types", None):
        m.config.layer_types = m.config.layer_types[:2]
    m.save_pretrained(draft)
    for f in folder.iterdir():
        if "token" in f.name:
            shutil.copy(f, draft / f.name)
    return str(draft)


def _draft_llm(target, draft: str, **kw) -> LLM:
    kw.setdefault("kv_cache_memory_bytes", 4 << 20)
    return LLM(
        str(target),
        dtype="float32",
        max_num_batched_tokens=32,
        speculative_config={"model": draft, "num_speculative_tokens": 3},
        **kw,
    )


def _greedy_equal(llm, model, prompts, max_tokens, hf_greedy) -> None:
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, **GREEDY), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, max_tokens)


def test_draft_equal_to_target_accepts_everything(tiny_qwen2, hf_greedy, random_prompts) -> None:
    folder, model = tiny_qwen2
    prompts = random_prompts([10, 30, 7, 50], model.config.vocab_size, seed=3)
    llm = _draft_llm(folder, str(folder))
    _greedy_equal(llm, model, prompts, 20, hf_greedy)
    stats = llm.llm_engine.get_stats()
    assert stats.spec_num_draft_tokens > 0
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens


def test_truncated_draft_accepts_some_and_output_is_unchanged(
    tiny_qwen2, truncated_draft, hf_greedy, random_prompts
) -> None:
    folder, model = tiny_qwen2
    prompts = random_prompts([10, 30, 7, 50], model.config.vocab_size, seed=3)
    llm = _draft_llm(folder, truncated_draft)
    _greedy_equal(llm, model, prompts, 20, hf_greedy)
    stats = llm.llm_engine.get_stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


def test_draft_model_survives_preemption(
    tiny_qwen2, truncated_draft, hf_greedy, random_prompts
) -> None:
    folder, model = tiny_qwen2
    prompts = random_prompts([30, 34, 52, 30], model.config.vocab_size, seed=4)
    # 8 blocks of 16 tokens: the target's 768 B/token and the 2-layer draft's own 512.
    llm = _draft_llm(
        folder, truncated_draft, max_model_len=128, kv_cache_memory_bytes=8 * 16 * (768 + 512)
    )
    assert llm.llm_engine.num_blocks == 8
    _greedy_equal(llm, model, prompts, 40, hf_greedy)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.spec_num_accepted_tokens > 0


def test_draft_with_another_vocabulary_is_refused(tiny_qwen2, build_tiny_model, tmp_path) -> None:
    folder, _ = tiny_qwen2
    build_tiny_model(tmp_path / "other", "qwen2", vocab_size=400)
    with pytest.raises(ValueError, match=r"speculative_config\.model: the draft's vocabulary"):
        _draft_llm(folder, str(tmp_path / "other"))


@pytest.mark.slow  # the grammar worker's start-up dominates (minutes on a loaded 2-core box)
def test_structured_output_requests_draft_beside_speculating_ones(tiny_llama) -> None:
    """A constrained request next to a speculating one drafts too (its drafts cut and
    masked by its grammar): its output matches the grammar exactly, and the free request's
    tokens are its own alone."""
    import re

    from pagemill.runtime.sample.structured_output.params import StructuredOutputsParams

    folder, _ = tiny_llama
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=4 << 20,
              speculative_config=NGRAM)  # fmt: skip
    prompt = "hello world hello world hello world hello"
    regex = r"( world hello){2,5} (fox|dog) [0-9]{2}"
    constrained_params = SamplingParams(
        temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=regex)
    )
    free_params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    (alone,) = llm.generate([prompt], [free_params], use_tqdm=False)
    before = llm.llm_engine.get_stats().spec_num_drafts
    constrained, free = llm.generate(
        [prompt, prompt], [constrained_params, free_params], use_tqdm=False
    )
    assert re.fullmatch(regex, constrained.outputs[0].text), constrained.outputs[0].text
    assert list(free.outputs[0].token_ids) == list(alone.outputs[0].token_ids)
    (again,) = llm.generate([prompt], [constrained_params], use_tqdm=False)
    assert list(again.outputs[0].token_ids) == list(constrained.outputs[0].token_ids)
    # The constrained request drafted as well: more drafts than the free one's own run.
    mixed_drafts = llm.llm_engine.get_stats().spec_num_drafts - before
    assert mixed_drafts > before > 0


def test_draft_pool_is_prefaulted_once_the_engine_is_ready(tiny_qwen2, monkeypatch) -> None:
    """The draft model's CPU pool, like the target's, maps its pages after start-up, not
    beside it (a warm start's graph loading would wait behind the populate)."""
    from pagemill.blockpool.kv_storage import KVStorage
    from pagemill.runtime.spec_decode.engine import SpecDecoding

    events: list[str] = []
    create, prefault = SpecDecoding.create.__func__, KVStorage.prefault

    def recording_create(cls, *args, **kwargs):
        spec = create(cls, *args, **kwargs)
        events.append("spec ready")
        return spec

    def recording_prefault(self, *args, **kwargs):
        events.append("prefault")
        return prefault(self, *args, **kwargs)

    monkeypatch.setenv("PAGEMILL_CPU_KV_PREFAULT", "1")
    monkeypatch.setattr(SpecDecoding, "create", classmethod(recording_create))
    monkeypatch.setattr(KVStorage, "prefault", recording_prefault)
    folder, _ = tiny_qwen2
    llm = _draft_llm(folder, str(folder))
    assert events == ["spec ready", "prefault", "prefault"]  # the target's, then the draft's
    spec = llm.llm_engine.engine_core.spec
    assert spec is not None and spec.draft_runner is not None
