"""Grammar-constrained decoding and logit_bias on a tiny random Llama (fast, no real model).

A random model knows nothing of JSON, so every constrained token here is the grammar's
doing: outputs must match the regex / choice / schema exactly, whatever the weights.
"""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagemill.runtime import LLM, LLMEngine, SamplingParams, StructuredOutputsParams
from pagemill.runtime.sample.sampler import Sampler, apply_token_bitmask
from pagemill.runtime.sample.sampling_metadata import SamplingMetadata
from pagemill.runtime.sample.structured_output import validate
from pagemill.runtime.sample.structured_output.worker import CompileJob
from pagemill.runtime.sampling_params import RequestOutputKind

FINAL = RequestOutputKind.FINAL_ONLY


def unpack_reference(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Plain-torch unpacking of an xgrammar bitmask: [R, vocab] bool, True = allowed."""
    bits = torch.arange(32, dtype=torch.int32)
    return (((bitmask.unsqueeze(-1) >> bits) & 1).bool().view(bitmask.shape[0], -1))[:, :vocab]


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 6), vocab=st.integers(1, 200), seed=st.integers(0, 2**31 - 1))
def test_bitmask_matches_plain_torch_unpacking(rows: int, vocab: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    logits = torch.randn(rows, vocab, generator=g)
    got = logits.clone()
    apply_token_bitmask(got, bitmask)
    allowed = unpack_reference(bitmask, vocab)
    expect = logits.masked_fill(~allowed, float("-inf"))
    assert torch.equal(got, expect)


def _metadata(params: list[SamplingParams], bitmask: torch.Tensor | None) -> SamplingMetadata:
    return SamplingMetadata.from_params(
        params, output_token_ids=[[] for _ in params], prompt_token_ids=None, token_bitmask=bitmask
    )


def test_sampler_draws_only_allowed_tokens_greedy_and_random() -> None:
    vocab, rows = 100, 4
    g = torch.Generator().manual_seed(0)
    allowed = torch.zeros(rows, vocab, dtype=torch.bool)
    for r in range(rows):
        allowed[r, torch.randperm(vocab, generator=g)[:3]] = True
    words = torch.zeros(rows, (vocab + 31) // 32, dtype=torch.int64)
    for r, t in allowed.nonzero().tolist():
        words[r, t // 32] |= 1 << (t % 32)
    bitmask = words.to(torch.int32)  # wraps bit 31 to the sign, as xgrammar stores it
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5),
        SamplingParams(temperature=1.0, top_k=50, seed=3),
        SamplingParams(temperature=0.7),
    ]
    sampler = Sampler(seed=0)
    for step in range(30):
        logits = torch.randn(rows, vocab, generator=g)
        out = sampler(logits, _metadata(params, bitmask))
        for r, t in enumerate(out.sampled_token_ids):
            assert allowed[r, t], (step, r, t)
        # The greedy row takes the best allowed token, not the best token.
        assert out.sampled_token_ids[0] == int(logits[0].masked_fill(~allowed[0], -1e9).argmax())


def test_logit_bias_moves_greedy_choice_and_stays_in_its_row() -> None:
    logits = torch.zeros(2, 10)
    logits[:, 4] = 1.0
    params = [SamplingParams(temperature=0.0, logit_bias={7: 5.0}), SamplingParams(temperature=0.0)]
    md = SamplingMetadata.from_params(params, output_token_ids=[[], []], prompt_token_ids=None)
    out = Sampler()(logits, md)
    assert out.sampled_token_ids == [7, 4]
    assert logits[0, 7] == 0.0  # the caller's logits are not touched


def test_logit_bias_is_validated() -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(json={"type": "nope"}), "Unsupported type"),
        (dict(json="{not json"), "not valid JSON"),
        (dict(regex="(unclosed"), "regex"),
        (dict(grammar="root ::= "), "grammar"),
        (dict(choice=[]), "choice"),
        (dict(json={"type": "object"}, regex="a"), "exactly one"),
    ],
)
def test_bad_constraints_fail_validation(bad: dict, match: str) -> None:
    """Types and sizes fail when built; the rest in `validate` (InputProcessor's check)."""
    with pytest.raises(ValueError, match=match):
        validate(StructuredOutputsParams(**bad))


# ---------------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    folder, _ = tiny_llama
    return LLM(
        str(folder),
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=4 << 20,
        max_num_batched_tokens=128,
    )


def _gen(llm: LLM, params: list[SamplingParams], prompt: str = "hello world") -> list:
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def so(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


def test_regex_choice_and_grammar_are_matched_exactly(llm) -> None:
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so(regex=r"[ab]{3,6}x")),
        SamplingParams(
            temperature=1.0,
            seed=1,
            max_tokens=40,
            structured_outputs=so(regex=r"(fox|dog) [0-9]{2}"),
        ),
        SamplingParams(
            temperature=0.0,
            max_tokens=40,
            structured_outputs=so(choice=["brown fox", "lazy dog", "héllo"]),
        ),
        SamplingParams(
            temperature=0.9,
            seed=2,
            max_tokens=40,
            structured_outputs=so(grammar='root ::= "yes" | "no" | "maybe"'),
        ),
        SamplingParams(temperature=0.0, max_tokens=12),  # unconstrained, same batch
    ]
    regex_g, regex_r, choice, grammar, free = _gen(llm, params)
    assert re.fullmatch(r"[ab]{3,6}x", regex_g.text) and regex_g.finish_reason == "stop"
    assert re.fullmatch(r"(fox|dog) [0-9]{2}", regex_r.text) and regex_r.finish_reason == "stop"
    assert choice.text in ("brown fox", "lazy dog", "héllo") and choice.finish_reason == "stop"
    assert grammar.text in ("yes", "no", "maybe") and grammar.finish_reason == "stop"
    # The unconstrained row is what it would be alone.
    (alone,) = _gen(llm, [SamplingParams(temperature=0.0, max_tokens=12)])
    assert free.token_ids == alone.token_ids


BOUNDED_SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
            "inner": {"type": "object", "properties": {"n": {"type": "null"}}, "required": ["n"]},
        },
        "required": ["color", "flags", "inner"],
    },
]


@pytest.mark.parametrize("schema", BOUNDED_SCHEMAS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(llm, schema: dict, temperature: float) -> None:
    params = SamplingParams(
        temperature=temperature,
        seed=5,
        max_tokens=120,
        structured_outputs=so(json=schema, disable_any_whitespace=True),
    )
    (out,) = _gen(llm, [params])
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), schema)


def test_grammar_that_cannot_finish_ends_with_length(llm) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5, structured_outputs=so(regex=r"a{50}"))
    (out,) = _gen(llm, [params])
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 5 and set(out.text) <= {"a"}


def test_min_tokens_past_the_grammar_never_crashes(llm) -> None:
    # EOS is banned until 8 tokens while the grammar wants to stop after "yes": the row has
    # no allowed token; the request must still end cleanly.
    params = SamplingParams(
        temperature=0.0, max_tokens=10, min_tokens=8, structured_outputs=so(choice=["yes"])
    )
    (out,) = _gen(llm, [params])
    assert out.finish_reason in ("stop", "length")
    assert out.text.startswith("yes")


def test_logit_bias_through_the_engine(llm) -> None:
    engine = llm.llm_engine
    target = engine.tokenizer.encode("fox")[0]
    (out,) = _gen(
        llm,
        [
            SamplingParams(
                temperature=0.0, max_tokens=4, ignore_eos=True, logit_bias={target: 100.0}
            )
        ],
    )
    assert out.token_ids == [target] * 4
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("bad-bias", "hi", SamplingParams(logit_bias={10**6: 1.0}))


def test_a_compiling_grammar_holds_up_nobody(tiny_llama) -> None:
    """While one request's grammar compiles, another runs to the end; then it runs too."""
    folder, _ = tiny_llama
    engine = LLMEngine(
        model=str(folder), dtype="float32", max_model_len=128, kv_cache_memory_bytes=2 << 20
    )
    manager = engine.engine_core.structured_output
    release = threading.Event()
    submit = manager._submit

    def slow_submit(key):
        inner, outer = submit(key), CompileJob(key)

        def later() -> None:
            assert release.wait(30)
            outer.future.set_result(inner.future.result(timeout=60))

        threading.Thread(target=later, daemon=True).start()
        return outer

    manager._submit = slow_submit
    engine.add_request(
        "slow",
        "hello",
        SamplingParams(
            temperature=0.0,
            max_tokens=20,
            output_kind=FINAL,
            structured_outputs=so(regex=r"[0-9]{4}"),
        ),
    )
    engine.add_request(
        "free",
        "hello",
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, output_kind=FINAL),
    )
    finished = {}
    for _ in range(50):
        for out in engine.step():
            finished[out.request_id] = out
        if "free" in finished:
            break
    assert "free" in finished and "slow" not in finished
    assert engine.engine_core.num_waiting_for_grammar == 1
    release.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out
    assert re.fullmatch(r"[0-9]{4}", finished["slow"].outputs[0].text)
    assert manager.num_requests == 0


def test_abort_while_compiling_and_cached_grammars(tiny_llama) -> None:
    folder, _ = tiny_llama
    engine = LLMEngine(
        model=str(folder), dtype="float32", max_model_len=128, kv_cache_memory_bytes=2 << 20
    )
    manager = engine.engine_core.structured_output
    params = SamplingParams(
        temperature=0.0,
        max_tokens=8,
        output_kind=FINAL,
        n=3,
        structured_outputs=so(regex=r"[a-c]+"),
    )
    engine.add_request("a", "hello", params)
    engine.add_request("b", "hello", params)
    engine.abort_request("b")
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert done["b"].outputs[0].finish_reason == "abort"
    assert all(re.fullmatch(r"[a-c]+", c.text) for c in done["a"].outputs)
    assert manager.num_compiles == 1  # six requests, one grammar
    assert manager.num_requests == 0 and engine.engine_core.num_waiting_for_grammar == 0


def test_grammar_starts_after_the_reasoning_end_token(llm) -> None:
    """With `reasoning_end_token_ids` the tokens up to and including the end token are the
    unconstrained model's own (greedy: the plain run's), and only what follows matches."""
    (plain,) = _gen(llm, [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)])
    ref = list(plain.token_ids)
    k = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])
    gated = SamplingParams(
        temperature=0.0,
        max_tokens=40,
        structured_outputs=so(choice=["lazy dog", "brown fox"], reasoning_end_token_ids=[ref[k]]),
    )
    ungated = SamplingParams(
        temperature=0.0, max_tokens=40, structured_outputs=so(choice=["lazy dog", "brown fox"])
    )
    out, control = _gen(llm, [gated, ungated])
    assert list(out.token_ids[: k + 1]) == ref[: k + 1]
    answer = out.text[len(llm.get_tokenizer().decode(ref[: k + 1])) :]
    assert answer in ("lazy dog", "brown fox") and out.finish_reason == "stop"
    assert control.text in ("lazy dog", "brown fox")
