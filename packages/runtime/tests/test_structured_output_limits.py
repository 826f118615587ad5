"""Hostile grammars: refused by the documented limits, or stopped by the compile deadline.

Each case comes from an attack on `pagemill serve` (issue 23): a schema, regex or grammar
that stalled the server or compiled forever. Refusals name their problem; a compile past
its deadline is killed, and the next grammar compiles at once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
import torch

from pagemill.runtime import LLMEngine, SamplingParams, StructuredOutputsParams
from pagemill.runtime.sample.structured_output import LIMITS, validate
from pagemill.runtime.sample.structured_output.worker import (
    CompileWorkers,
    GrammarCompileCancelled,
    GrammarCompileTimeout,
)
from pagemill.runtime.sampling_params import RequestOutputKind

FINAL = RequestOutputKind.FINAL_ONLY
# Parses, and compiles for minutes: 5,000 optional properties (even on the tiny vocabulary
# here; `(.*){1,1000}`, a runaway on a 49k one, compiles in 1 s on 300 tokens).
RUNAWAY = ("json", json.dumps({"type": "object", "properties": {str(i): {} for i in range(5000)}}))


def deep(n: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    return schema


def check(**kw) -> None:
    validate(StructuredOutputsParams(**kw))


@pytest.mark.parametrize(
    "kw, match",
    [
        (
            dict(json={"type": "object", "properties": {str(i): {} for i in range(5000)}}),
            "5,000 properties",
        ),
        (dict(regex="(.*){1,1000}"), "can match any length"),
        (dict(regex="a{1,5000}"), "exceeds the limit of 1,000"),
        (dict(json={"type": "string", "pattern": "(.+){1,50}"}), "pattern.*any length"),
        (dict(json=deep(300)), "deeper than 32"),
        (dict(json={"$ref": "#"}), "recursive"),
        (
            dict(json={"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}}),
            "refers back to itself",
        ),
        (
            dict(
                json={
                    "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                    "$ref": "#/$defs/a",
                }
            ),
            "refers back to itself",
        ),
        (dict(json={"$ref": "#/$defs/missing"}), "does not resolve"),
        (dict(json={"$ref": "https://example.com/s.json"}), "only references inside"),
        (dict(json={"type": "string", "format": "idn-email"}), "unsupported format 'idn-email'"),
        (dict(json={"type": "integer", "not": {"const": 3}}), "keyword.*not"),
        (
            dict(json={"type": "object", "if": {}, "then": {}, "unevaluatedProperties": False}),
            "if, then, unevaluatedProperties",
        ),
        (dict(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
        (dict(json={"type": "string", "maxLength": 100000}), "maxLength=100000"),
        (dict(json={"minimum": 0, "maximum": 10}), "minimum, maximum can be enforced only"),
        (dict(json={"type": "string", "exclusiveMinimum": 0}), "exclusiveMinimum can be"),
        (dict(json={"type": ["number", "null"], "maximum": 1}), "maximum can be enforced"),
        (dict(json={"type": "integer", "multipleOf": 2}), "keyword.*multipleOf"),
    ],
)
def test_hostile_constraints_are_refused_by_name(kw: dict, match: str, monkeypatch) -> None:
    import xgrammar as xgr

    # Refused by the linear-time checks, before xgrammar parses anything (its parse of
    # these can take seconds or never end): a parse here fails the test.
    def no_parse(*args: object, **kwargs: object) -> None:
        raise AssertionError("xgrammar parsed a constraint the limits should refuse")

    for name in ("from_json_schema", "from_regex", "from_ebnf"):
        monkeypatch.setattr(xgr.Grammar, name, staticmethod(no_parse))
    with pytest.raises(ValueError, match=match):
        check(**kw)


def test_oversized_text_fails_when_built() -> None:
    ebnf = "root ::= " + " | ".join(f'"w{i}"' for i in range(120_000))  # ~1.2 MB
    assert len(ebnf) > 1_000_000
    with pytest.raises(ValueError, match="bytes; at most 65,536"):
        StructuredOutputsParams(grammar=ebnf)


def test_what_is_supported_still_passes() -> None:
    check(json=deep(20))
    check(
        json={
            "type": "object",
            "properties": {
                "d": {"type": "string", "format": "date"},
                "n": {"type": "integer", "minimum": 0},
            },
            "$defs": {"t": {"enum": ["a", "b"]}},
            "additionalProperties": False,
        }
    )
    check(
        json={
            "$defs": {"t": {"type": "string"}},
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/t"}, "b": {"$ref": "#/$defs/t"}},
        }
    )
    check(regex=r"(ab|cd){1,8}[0-9]{3,1000}\{1,5000\}")
    check(grammar='root ::= "{1,5000}" | "x"{1,4}')
    check(choice=["a{99999}", "b"])
    assert LIMITS["schema_depth"] == 32


# ---------------------------------------------------------------- the compile workers


@pytest.fixture(scope="module")
def tokenizer_info(tiny_llama):
    import transformers
    import xgrammar as xgr

    folder, _ = tiny_llama
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    return xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))


def _allowed(bitmask: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask[token // 32]) >> (token % 32)) & 1)


@pytest.mark.parametrize("kind", ["json", "json_object"])
def test_json_output_caps_whitespace_runs(tiny_llama, kind: str) -> None:
    """A sampled model must not spend max_tokens on the whitespace JSON allows anywhere:
    past `MAX_JSON_WHITESPACE` characters in a row, or `MAX_JSON_NEWLINES` newlines, the
    manager bans whitespace, and only whitespace; drafts that would go past it are cut and
    their rows ban it too."""
    import transformers

    from pagemill.runtime.sample.structured_output.limits import (
        MAX_JSON_NEWLINES,
        MAX_JSON_WHITESPACE,
    )
    from pagemill.runtime.sample.structured_output.manager import StructuredOutputManager

    folder, _ = tiny_llama
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    manager = StructuredOutputManager(tok, len(tok), [tok.eos_token_id], 2, prestart=False)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    params = (
        StructuredOutputsParams(json=schema)
        if kind == "json"
        else StructuredOutputsParams(json_object=True)
    )
    vocab = [bytes(t) for t in manager.compiler.tokenizer_info.decoded_vocab]
    space, newline, one = vocab.index(b" "), vocab.index(b"\n"), vocab.index(b"1")
    try:
        manager.add_request("r", params)
        manager.wait_any(["r"], 60)
        assert manager.error("r") is None
        manager.start("r")
        assert not manager.accept_tokens({"r": tok.encode('{"a":', add_special_tokens=False)})
        for n in range(MAX_JSON_WHITESPACE):
            mask = manager.grammar_bitmask(["r"])
            assert mask is not None and _allowed(mask[0], space), n
            assert _allowed(mask[0], newline) == (n < MAX_JSON_NEWLINES), n
            manager.accept_tokens({"r": newline if n < MAX_JSON_NEWLINES else space})
        mask = manager.grammar_bitmask(["r"])
        assert mask is not None
        assert not _allowed(mask[0], space) and not _allowed(mask[0], newline)
        assert _allowed(mask[0], one)  # the value itself is still allowed
        # Drafts: cut before the space past the cap; the draft rows say the same.
        assert manager.validate_drafts({"r": [one, space]}) == {"r": [one, space]}
        assert manager.validate_drafts({"r": [space, one]}) == {}
        _, rows = manager.grammar_bitmasks(["r"], [0], [[one, space]])
        assert rows is not None and _allowed(rows[1], space)  # "1" ended the run
        _, rows = manager.grammar_bitmasks(["r"], [0], [[space, one]])
        assert rows is not None and not _allowed(rows[0], space)
        # The request itself has not moved: its next token still may not be a space.
        mask = manager.grammar_bitmask(["r"])
        assert mask is not None and not _allowed(mask[0], space)
        manager.accept_tokens({"r": one})
        mask = manager.grammar_bitmask(["r"])
        assert mask is not None and _allowed(mask[0], space)  # a new run starts at 0
    finally:
        manager.shutdown()


def test_json_grammars_stay_small(tokenizer_info) -> None:
    """The whitespace cap is not in the grammar: xgrammar's own (`max_whitespace_cnt`)
    gives each gap a grammar state per allowed character, each with a token mask; capped
    at 32 there, this schema compiled to 2.9 GB on this 320-token vocabulary (1.1 MB
    without), and a two-property one took 17 s to come back from a compile worker."""
    import xgrammar as xgr

    from pagemill.runtime.sample.structured_output.worker import compile_key

    props = {
        f"f{i}": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "boolean"}},
            },
        }
        for i in range(12)
    }
    schema = json.dumps({"type": "object", "properties": props, "required": list(props)})
    compiler = xgr.GrammarCompiler(tokenizer_info)
    for kind in ("json", "json:compact"):
        assert compile_key(compiler, (kind, schema)).memory_size_bytes < 8 << 20, kind


def test_compact_json_and_gapless_schemas(tokenizer_info) -> None:
    import xgrammar as xgr

    from pagemill.runtime.sample.structured_output.worker import compile_key

    compiler = xgr.GrammarCompiler(tokenizer_info)
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    compact = compile_key(compiler, ("json:compact", schema))
    assert xgr.GrammarMatcher(compact).accept_string('{"a": 1}')  # xgrammar's separators
    assert not xgr.GrammarMatcher(compact).accept_string('{\n"a": 1}')
    lone = compile_key(compiler, ("json", json.dumps({"enum": ["x", 3]})))  # no gap at all
    assert xgr.GrammarMatcher(lone).accept_string("3")


@pytest.mark.parametrize(
    "bounds",
    [
        {"minimum": -180, "maximum": 180},
        {"exclusiveMinimum": -181, "exclusiveMaximum": 181},
        {"minimum": 7, "maximum": 1234},
    ],
)
def test_integer_bounds_hold_exactly(tokenizer_info, bounds: dict) -> None:
    """An integer's bounds are enforced, not approximated (the limits accept them for that):
    exactly the integers inside them complete the output. xgrammar 0.1 let 181-189 through
    a maximum of 180 (a model sampling longitudes wrote 184)."""
    import xgrammar as xgr

    from pagemill.runtime.sample.structured_output.worker import compile_key

    check(json={"type": "integer", **bounds})
    grammar = compile_key(
        xgr.GrammarCompiler(tokenizer_info), ("json", json.dumps({"type": "integer", **bounds}))
    )
    stop = tokenizer_info.stop_token_ids[0]
    lo = bounds.get("minimum", bounds.get("exclusiveMinimum", 0) + 1)
    hi = bounds.get("maximum", bounds.get("exclusiveMaximum", 0) - 1)

    def completes(text: str) -> bool:
        matcher = xgr.GrammarMatcher(grammar)
        return matcher.accept_string(text) and matcher.accept_token(stop)

    for value in [*range(-400, 400), *range(lo - 12, lo + 12), *range(hi - 12, hi + 12), 12340]:
        assert completes(str(value)) == (lo <= value <= hi), value


@pytest.mark.parametrize(
    "bounds",
    [
        {"minimum": 0, "maximum": 10},
        {"minimum": 0.5, "maximum": 2.25},
        {"minimum": -3.75, "maximum": -1.5},
        {"exclusiveMinimum": 0, "exclusiveMaximum": 1},
        {"minimum": 0.001, "maximum": 5000},
        {"maximum": -2.5},
        {"exclusiveMinimum": 2.5},
    ],
)
def test_number_bounds_hold(tokenizer_info, bounds: dict) -> None:
    """A number's bounds are enforced (accepted by the limits since xgrammar 0.2.9): no value
    outside them completes the output, and every one inside does when written in decimal
    notation (an exponent is refused, as is "-0": narrower than JSON, never wrong)."""
    import random
    from decimal import Decimal

    import xgrammar as xgr

    from pagemill.runtime.sample.structured_output.worker import compile_key

    schema = {"type": "number", **bounds}
    check(json=schema)
    grammar = compile_key(xgr.GrammarCompiler(tokenizer_info), ("json", json.dumps(schema)))
    stop = tokenizer_info.stop_token_ids[0]

    def inside(v: Decimal) -> bool:
        d = {k: Decimal(str(x)) for k, x in bounds.items()}
        return (
            v >= d.get("minimum", v)
            and v <= d.get("maximum", v)
            and ("exclusiveMinimum" not in d or v > d["exclusiveMinimum"])
            and ("exclusiveMaximum" not in d or v < d["exclusiveMaximum"])
        )

    rng = random.Random(0)
    texts = set()
    for _ in range(1500):
        whole = rng.choice([0, 1, 2, 3, 5, 9, 10, 11, 99, 4999, 5000, 5001, rng.randrange(10**6)])
        frac = rng.choice(["", ".0", ".5", ".25", ".75", ".001", ".0009", ".9999", ".50"])
        texts.add(f"{rng.choice(['', '-'])}{whole}{frac}{rng.choice(['', '', 'e0', 'e-1'])}")
    for text in sorted(texts):
        matcher = xgr.GrammarMatcher(grammar)
        completes = matcher.accept_string(text) and matcher.accept_token(stop)
        value = Decimal(text)
        if completes:
            assert inside(value), text
        elif "e" not in text and text.lstrip("-0.") != "":
            assert not inside(value), text


def test_runaway_compile_is_killed_at_its_deadline_and_blocks_nobody(tokenizer_info) -> None:
    # The deadline is CPU time, so "beside, not behind" is judged by order, not by the
    # wall clock: on a loaded 2-core box the small compile may wait for a core.
    workers = CompileWorkers(tokenizer_info, num_workers=2, timeout=3.0, cache_limit_bytes=8 << 20)
    try:
        warm = workers.submit(("regex", "[ab]+"))  # workers started (forkserver warm)
        assert warm.future.result(timeout=120) is not None
        deadline = time.monotonic() + 60  # both: the small one must not wait for a start
        while not all(workers._workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        t0 = time.monotonic()
        runaway = workers.submit(RUNAWAY)
        small = workers.submit(
            (
                "json",
                json.dumps(
                    {
                        "type": "object",
                        "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
                    }
                ),
            )
        )
        assert small.future.result(timeout=30) is not None
        assert not runaway.future.done()  # beside the runaway, not behind it
        with pytest.raises(GrammarCompileTimeout, match="within 3 s"):
            runaway.future.result(timeout=60)
        assert time.monotonic() - t0 < 30.0
        assert workers.num_killed == 1
        # The slot replaced its worker: the next grammar compiles promptly.
        t1 = time.monotonic()
        assert workers.submit(("regex", "[0-9]{4}")).future.result(timeout=30) is not None
        assert time.monotonic() - t1 < 5.0
    finally:
        workers.shutdown()


def test_a_compile_starved_of_cpu_is_not_a_timeout(tokenizer_info) -> None:
    """The deadline counts the worker's CPU time: a compile that cannot get a core for
    longer than the deadline (a loaded machine; here its worker is stopped) still
    completes, while a runaway (above) is stopped."""
    workers = CompileWorkers(tokenizer_info, num_workers=1, timeout=1.0, cache_limit_bytes=8 << 20)
    try:
        assert workers.submit(("regex", "[ab]+")).future.result(timeout=120) is not None
        worker = workers._workers[0]
        assert worker is not None and worker.pid is not None
        before = worker.cpu_seconds()
        assert before is not None
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            job = workers.submit(("regex", "[0-9]{3}-[a-z]+"))
            time.sleep(2.5)  # 2.5x the deadline in wall time, no CPU used
            assert not job.future.done()
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        assert job.future.result(timeout=30) is not None
        assert workers.num_killed == 0
    finally:
        workers.shutdown()


def test_a_compile_nobody_waits_for_is_stopped(tokenizer_info) -> None:
    workers = CompileWorkers(tokenizer_info, num_workers=1, timeout=60.0, cache_limit_bytes=8 << 20)
    try:
        assert workers.submit(("regex", "a+")).future.result(timeout=120) is not None
        runaway = workers.submit(RUNAWAY)
        time.sleep(0.3)
        runaway.abandon()
        t = time.monotonic()
        assert workers.submit(("regex", "b+")).future.result(timeout=30) is not None
        assert time.monotonic() - t < 5.0  # not the 60 s deadline
        assert workers.num_killed == 1
        assert runaway.future.cancelled() or isinstance(
            runaway.future.exception(), GrammarCompileCancelled
        )
    finally:
        workers.shutdown()


# ---------------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def engine(tiny_llama):
    folder, _ = tiny_llama
    return LLMEngine(
        model=str(folder),
        dtype="float32",
        max_model_len=128,
        kv_cache_memory_bytes=2 << 20,
        structured_outputs_compile_timeout=1.0,
        structured_outputs_cache_bytes=1 << 20,
    )


def _run(engine: LLMEngine) -> dict:
    done = {}
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        for out in engine.step():
            done[out.request_id] = out
    return done


def test_engine_refuses_hostile_grammar_at_add_request(engine) -> None:
    with pytest.raises(ValueError, match="deeper than 32"):
        engine.add_request(
            "deep",
            "hello",
            SamplingParams(structured_outputs=StructuredOutputsParams(json=deep(300))),
        )
    assert not engine.has_unfinished_requests()


def test_compile_timeout_ends_the_request_with_error_and_the_next_grammar_works(
    engine, monkeypatch
) -> None:
    # A grammar the limits let through but that compiles too long: skip the limits.
    monkeypatch.setattr(
        "pagemill.runtime.engine.input_processor.validate_structured_output", lambda params: None
    )
    engine.add_request(
        "runaway",
        "hello",
        SamplingParams(
            max_tokens=8,
            output_kind=FINAL,
            structured_outputs=StructuredOutputsParams(json=RUNAWAY[1]),
        ),
    )
    engine.add_request(
        "free",
        "hello",
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, output_kind=FINAL),
    )
    done = _run(engine)
    out = done["runaway"].outputs[0]
    assert out.finish_reason == "error" and out.text == ""
    assert done["free"].outputs[0].finish_reason == "length"
    engine.add_request(
        "small",
        "hello",
        SamplingParams(
            temperature=0.0,
            max_tokens=8,
            output_kind=FINAL,
            structured_outputs=StructuredOutputsParams(regex="[0-9]{3}"),
        ),
    )
    assert re.fullmatch("[0-9]{3}", _run(engine)["small"].outputs[0].text)
    # The same runaway again fails at once: its failure is cached, not compiled again.
    compiles = engine.engine_core.structured_output.num_compiles
    t = time.monotonic()
    engine.add_request(
        "again",
        "hello",
        SamplingParams(
            max_tokens=8,
            output_kind=FINAL,
            structured_outputs=StructuredOutputsParams(json=RUNAWAY[1]),
        ),
    )
    assert _run(engine)["again"].outputs[0].finish_reason == "error"
    assert engine.engine_core.structured_output.num_compiles == compiles
    assert time.monotonic() - t < 10.0  # never another deadline's wait plus a kill


def test_grammar_cache_is_bounded_in_bytes(engine) -> None:
    manager = engine.engine_core.structured_output
    for i in range(60):
        engine.add_request(
            f"c{i}",
            "hello",
            SamplingParams(
                max_tokens=2,
                output_kind=FINAL,
                structured_outputs=StructuredOutputsParams(
                    json={
                        "type": "object",
                        "properties": {f"k{i}_{j}": {"type": "integer"} for j in range(6)},
                    }
                ),
            ),
        )
        _run(engine)
    assert 0 < manager.cache_bytes <= manager.cache_limit_bytes == 1 << 20
    assert manager.num_requests == 0


@pytest.mark.parametrize("how", ["killed", "pipe lost"])
def test_a_worker_lost_between_jobs_fails_no_request(tokenizer_info, how: str) -> None:
    """A worker that died between two compiles (killed from outside) or whose pipe end was
    lost (closed under it: `OSError(9, 'Bad file descriptor')`) is replaced and the job
    compiles on the fresh one, instead of failing its request."""
    workers = CompileWorkers(tokenizer_info, num_workers=1, timeout=60.0, cache_limit_bytes=8 << 20)
    try:
        assert workers.submit(("regex", "a+")).future.result(timeout=120) is not None
        worker = workers._workers[0]
        assert worker is not None and worker.pid is not None
        if how == "killed":
            os.kill(worker.pid, signal.SIGKILL)
            time.sleep(0.2)
        else:
            os.close(worker.conn.fileno())  # the fd closed under the Connection
        assert workers.submit(("regex", "[0-9]{3}")).future.result(timeout=60) is not None
        fresh = workers._workers[0]
        assert fresh is not None and fresh.pid != worker.pid
    finally:
        workers.shutdown()
