"""`LLM.generate` takes vLLM's prompt forms and returns vLLM-shaped outputs: token ids as the
tokenizer encodes them (transformers is the reference), `Logprob` objects whose values and
ranks match transformers' log-softmax on the same weights."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoTokenizer

from pagemill.runtime import LLM, Logprob, SamplingParams, TextPrompt, TokensPrompt

GREEDY = dict(temperature=0.0, ignore_eos=True)
TEXT = "the quick brown fox jumps"


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    folder, _ = tiny_llama
    return LLM(
        str(folder),
        dtype="float32",
        device="cpu",
        max_model_len=128,
        kv_cache_memory_bytes=2 << 20,
        max_num_batched_tokens=64,
        enforce_eager=True,
    )


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_llama):
    folder, _ = tiny_llama
    return AutoTokenizer.from_pretrained(str(folder))


def test_every_prompt_form_gives_the_same_completion(llm: LLM, hf_tokenizer) -> None:
    ids = hf_tokenizer(TEXT).input_ids
    params = SamplingParams(max_tokens=6, **GREEDY)
    forms = [
        TEXT,
        TextPrompt(prompt=TEXT),
        TokensPrompt(prompt_token_ids=ids),
        {"prompt_token_ids": ids, "prompt": TEXT},
        ids,
    ]
    outs = llm.generate(forms, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [ids] * len(forms)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert [o.prompt for o in outs] == [TEXT, TEXT, None, TEXT, None]
    assert all(o.finished and o.prompt_logprobs is None for o in outs)
    # One prompt alone, in each form, is a one-element batch.
    for single in (TEXT, TextPrompt(prompt=TEXT), TokensPrompt(prompt_token_ids=ids)):
        [one] = llm.generate(single, params, use_tqdm=False)
        assert one.outputs[0].token_ids == outs[0].outputs[0].token_ids
    text = outs[0].outputs[0]
    assert text.text == hf_tokenizer.decode(text.token_ids)


def test_sampling_params_per_prompt(llm: LLM) -> None:
    prompts = [TEXT, TokensPrompt(prompt_token_ids=[5, 6, 7]), TextPrompt(prompt="hello")]
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (2, 5, 3)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5, 3]
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 3
    # Each request's result equals its own run alone (order kept, no cross-talk).
    for prompt, p, out in zip(prompts, params, outs):
        [alone] = llm.generate(prompt, p, use_tqdm=False)
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids


def test_logprobs_are_vllm_logprob_objects(llm: LLM, tiny_llama, hf_tokenizer) -> None:
    _, hf_model = tiny_llama
    ids = hf_tokenizer(TEXT).input_ids
    [out] = llm.generate(
        TokensPrompt(prompt_token_ids=ids),
        SamplingParams(max_tokens=3, logprobs=4, **GREEDY),
        use_tqdm=False,
    )
    c = out.outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == 3
    context = list(ids)
    total = 0.0
    for token, entry in zip(c.token_ids, c.logprobs):
        assert all(isinstance(lp, Logprob) for lp in entry.values())
        with torch.no_grad():
            logits = hf_model(torch.tensor([context])).logits[0, -1]
        ref = torch.log_softmax(logits.float(), dim=-1)
        top = torch.topk(ref, 4)
        # Greedy: the sampled token is the most likely one, rank 1, and among the top 4.
        assert entry[token].rank == 1 and len(entry) == 4
        assert sorted(entry, key=lambda t: entry[t].rank) == top.indices.tolist()
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(ref[t].item(), abs=1e-4)
            assert lp.decoded_token == hf_tokenizer.decode([t])
        total += entry[token].logprob
        context.append(token)
    assert c.cumulative_logprob == pytest.approx(total)


def test_sampled_token_outside_the_top_n_has_no_rank(llm: LLM) -> None:
    # logprobs=0: only the sampled token's own logprob, whose rank was not computed.
    [out] = llm.generate(
        TEXT, SamplingParams(max_tokens=4, logprobs=0, temperature=1.0, seed=1), use_tqdm=False
    )
    for token, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs or []):
        assert list(entry) == [token] and entry[token].rank is None
        assert math.isfinite(entry[token].logprob) and entry[token] <= 0


def test_cache_salt_separates_prefix_caches(llm: LLM) -> None:
    engine = llm.llm_engine
    long = "hello world, hello engine, hello paged attention, " * 3
    params = SamplingParams(max_tokens=1, **GREEDY)

    def hits(prompt: object) -> int:
        before = engine.get_stats().prefix_cache_hits
        llm.generate(prompt, params, use_tqdm=False)
        return engine.get_stats().prefix_cache_hits - before

    hits(TextPrompt(prompt=long, cache_salt="a"))
    assert hits(TextPrompt(prompt=long, cache_salt="b")) == 0
    assert hits(TextPrompt(prompt=long, cache_salt="a")) > 0


@pytest.mark.parametrize(
    ("prompt", "error", "message"),
    [
        ({"prompt": TEXT, "multi_modal_data": {}}, ValueError, "'multi_modal_data'"),
        ({"prompt_embeds": [0.1]}, ValueError, "'prompt_embeds'"),
        ({"text": TEXT}, ValueError, "unknown prompt key 'text'"),
        ({"prompt_token_ids": ["a"]}, TypeError, "list of ints"),
        ({"cache_salt": "x"}, ValueError, "needs 'prompt'"),
        ({"prompt": TEXT, "cache_salt": ""}, ValueError, "cache_salt"),
        (3.5, TypeError, "string or a list of token ids"),
    ],
)
def test_bad_prompts_are_refused(llm: LLM, prompt: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        llm.generate([TEXT, prompt], use_tqdm=False)  # type: ignore[list-item]
    assert not llm.llm_engine.has_unfinished_requests()


def test_generate_arguments(llm: LLM) -> None:
    with pytest.raises(ValueError, match="LoRA"):
        llm.generate(TEXT, lora_request=object(), use_tqdm=False)  # type: ignore[arg-type]
    from pagemill.runtime.lora import LoRARequest

    with pytest.raises(ValueError, match="enable_lora"):  # this engine serves no adapters
        llm.generate(TEXT, lora_request=LoRARequest("a", 1, "/a"), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="2 priorities for 1 prompts"):
        llm.generate(TEXT, priority=[0, 1], use_tqdm=False)
    [out] = llm.generate(TEXT, SamplingParams(max_tokens=1), priority=[3], use_tqdm=False)
    assert out.finished
