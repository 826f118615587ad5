"""Structured output with speculative decoding: drafts are cut by the grammar and every
verified position is masked by the grammar's state there, so a constrained request's
greedy output is the one it has without speculation, and it matches its grammar.

The grammars here force repeats of text the prompt holds, so the n-gram proposer has
something to propose and some drafts are accepted (a random model knows no JSON)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr

from pagemill.runtime import LLM, SamplingParams, StructuredOutputsParams
from pagemill.runtime.sample.structured_output.worker import CompileJob, compile_key

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip
PROMPT = "hello world hello world hello world hello world"
REGEX = r"(hello world ){2,6}(fox|dog)"
SCHEMA = {
    "type": "object",
    "properties": {
        "words": {
            "type": "array",
            "items": {"enum": ["hello world", "hello"]},
            "minItems": 3,
            "maxItems": 6,
        }
    },
    "required": ["words"],
}


def _llm(folder, **kw) -> LLM:
    return LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory_bytes=4 << 20,
               max_num_batched_tokens=128, **kw)  # fmt: skip


@pytest.fixture(scope="module")
def pair(tiny_llama) -> tuple[LLM, LLM]:
    folder, _ = tiny_llama
    return _llm(folder), _llm(folder, speculative_config=NGRAM)


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(
            temperature=0.0,
            max_tokens=60,
            structured_outputs=StructuredOutputsParams(regex=REGEX),
        ),
        SamplingParams(
            temperature=0.0,
            max_tokens=80,
            structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        ),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),  # plain, drafting too
    ]


def test_greedy_structured_with_ngram_equals_without(pair) -> None:
    plain_llm, spec_llm = pair
    params = _params()
    want = plain_llm.generate([PROMPT] * 3, params, use_tqdm=False)
    before = spec_llm.llm_engine.get_stats()
    mixed = spec_llm.generate([PROMPT] * 3, params, use_tqdm=False)
    stats = spec_llm.llm_engine.get_stats()
    for w, g in zip(want, mixed):
        assert list(g.outputs[0].token_ids) == list(w.outputs[0].token_ids)
    regex_out, json_out = mixed[0].outputs[0], mixed[1].outputs[0]
    assert re.fullmatch(REGEX, regex_out.text) and regex_out.finish_reason == "stop"
    assert json_out.finish_reason == "stop", json_out.text
    jsonschema.validate(json.loads(json_out.text), SCHEMA)
    accepted = stats.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    drafted = stats.spec_num_draft_tokens - before.spec_num_draft_tokens
    assert 0 < accepted <= drafted


@pytest.mark.slow  # two more decodes on a loaded box
def test_constrained_requests_alone_accept_drafts_and_keep_their_output(pair) -> None:
    plain_llm, spec_llm = pair
    for p in _params()[:2]:
        (want,) = plain_llm.generate([PROMPT], [p], use_tqdm=False)
        before = spec_llm.llm_engine.get_stats().spec_num_accepted_tokens
        (got,) = spec_llm.generate([PROMPT], [p], use_tqdm=False)
        assert spec_llm.llm_engine.get_stats().spec_num_accepted_tokens > before, p
        assert list(got.outputs[0].token_ids) == list(want.outputs[0].token_ids)


@pytest.mark.slow  # four more decodes on a loaded box
def test_seeded_structured_sampling_with_drafts_matches_its_grammar(pair) -> None:
    """At temperature > 0 every emitted token, accepted draft or drawn, obeys the grammar."""
    _, spec_llm = pair
    params = [
        SamplingParams(
            temperature=1.0, seed=s, max_tokens=60,
            structured_outputs=StructuredOutputsParams(regex=REGEX),
        )
        for s in range(4)
    ]  # fmt: skip
    first = spec_llm.generate([PROMPT] * 4, params, use_tqdm=False)
    for out in first:
        assert re.fullmatch(REGEX, out.outputs[0].text), out.outputs[0].text


# ---- the manager's masks against matchers walked independently ------------------------


@pytest.fixture(scope="module")
def manager(pair):
    _, spec_llm = pair
    return spec_llm.llm_engine.engine_core.structured_output


def _admit(manager, rid: str, key) -> xgr.CompiledGrammar:
    compiled = compile_key(xgr.GrammarCompiler(manager.compiler.tokenizer_info), key)
    job = CompileJob(key)
    job.future.set_result(compiled)
    submit = manager._submit
    manager._submit = lambda _key: job
    try:
        manager.add_request(rid, StructuredOutputsParams(regex=key[1]))
    finally:
        manager._submit = submit
    manager.start(rid)
    return compiled


def _mask(matcher: xgr.GrammarMatcher, vocab: int) -> torch.Tensor:
    out = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(out, 0)
    return out[0]


def test_draft_masks_are_the_grammar_states_after_each_prefix(pair, manager) -> None:
    spec_llm = pair[1]
    tok = spec_llm.get_tokenizer()
    vocab = manager.vocab_size
    rid = "mask-check"
    compiled = _admit(manager, rid, ("regex", REGEX))
    try:
        good = tok.encode("hello world hello", add_special_tokens=False)
        bad = tok.encode("hello fox", add_special_tokens=False)
        # Both cut where the grammar stops taking them; the matcher itself does not move.
        cut = manager.validate_drafts({rid: good + bad, "free": [1, 2]})
        assert cut["free"] == [1, 2]
        ref = xgr.GrammarMatcher(compiled)
        n = 0
        for t in good + bad:
            if not ref.accept_token(t):
                break
            n += 1
        assert 0 < len(good) <= n < len(good + bad) and cut[rid] == (good + bad)[:n]
        fresh = xgr.GrammarMatcher(compiled)
        state = manager._requests[rid].matcher
        assert torch.equal(_mask(state, vocab), _mask(fresh, vocab))

        drafts = cut[rid]
        bonus, rows = manager.grammar_bitmasks(["other", rid], [1], [drafts])
        assert bonus is not None and rows is not None and rows.shape[0] == len(drafts)
        assert bool((bonus[0] == -1).all())  # an unconstrained row stays all ones
        walk = xgr.GrammarMatcher(compiled)
        for j, t in enumerate(drafts):
            assert torch.equal(rows[j], _mask(walk, vocab)), j
            assert walk.accept_token(t)
        assert torch.equal(bonus[1], _mask(walk, vocab))
        assert torch.equal(_mask(state, vocab), _mask(fresh, vocab))

        # A draft the grammar rejects: its row bans it (so it is replaced), and the
        # matcher is back where it was.
        rejected = drafts[:1] + bad[-1:]
        _, rows = manager.grammar_bitmasks([rid], [0], [rejected])
        assert rows is not None
        t = rejected[1]
        assert not (int(rows[1, t // 32]) >> (t % 32)) & 1
        assert torch.equal(_mask(state, vocab), _mask(fresh, vocab))

        # The real matcher moves only by emitted tokens, and says where the grammar ended.
        done = manager.accept_tokens({rid: drafts})
        assert rid not in done
        assert torch.equal(_mask(state, vocab), _mask(walk, vocab))
    finally:
        manager.remove_requests([rid])
