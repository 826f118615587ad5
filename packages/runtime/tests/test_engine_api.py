"""LLMEngine / LLM behaviour beyond greedy equality: validation, stops, abort, sampling, stats."""

from __future__ import annotations

import itertools

import pytest

from pagemill.runtime import LLM, LLMEngine, SamplingParams
from pagemill.runtime.config import EngineConfig
from pagemill.runtime.sampling_params import RequestOutputKind
from pagemill.scheduler import SchedulerOutput

CUMULATIVE = RequestOutputKind.CUMULATIVE

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    folder, _ = tiny_llama
    return LLM(
        str(folder),
        dtype="float32",
        max_model_len=128,
        kv_cache_memory_bytes=2 << 20,
        max_num_batched_tokens=64,
    )


def _drain(engine: LLMEngine) -> dict:
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def test_add_request_rejects_bad_input(llm) -> None:
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("a", "", SamplingParams())
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("a", [], SamplingParams())
    with pytest.raises(ValueError, match="127 fit"):
        engine.add_request("a", [1] * 128, SamplingParams())
    with pytest.raises(ValueError, match=r"\+ max_tokens \(30\) = 130 exceeds max_model_len=128"):
        engine.add_request("a", [1] * 100, SamplingParams(max_tokens=30))
    with pytest.raises(ValueError, match="token ids must be ints"):
        engine.add_request("a", [1, 10_000], SamplingParams())
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.add_request("a", [1, 2], {"max_tokens": 3})  # type: ignore[arg-type]
    engine.add_request("dup", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [4, 5], SamplingParams())
    _drain(engine)
    assert not engine.has_unfinished_requests()


def test_max_tokens_none_fills_the_context(llm) -> None:
    [out] = llm.generate([[5] * 100], SamplingParams(max_tokens=None, **GREEDY), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 28
    assert out.outputs[0].finish_reason == "length"


def test_abort_frees_blocks_and_reports_once(llm) -> None:
    engine = llm.llm_engine
    engine.add_request("x", [3] * 40, SamplingParams(max_tokens=50, **GREEDY))
    engine.add_request("y", [4] * 10, SamplingParams(max_tokens=3, **GREEDY))
    engine.step()
    engine.abort_request(["x", "never-seen"])
    final = _drain(engine)
    assert final["x"].outputs[0].finish_reason == "abort"
    assert final["y"].outputs[0].finish_reason == "length"
    assert engine.get_stats().kv_cache_usage == 0.0
    engine.abort_request("x")  # already gone: nothing happens
    assert not engine.has_unfinished_requests()


def test_stop_strings_cut_the_text(llm) -> None:
    prompt = "hello world, the quick"
    base = llm.generate(prompt, SamplingParams(max_tokens=40, **GREEDY), use_tqdm=False)[0].outputs[
        0
    ]
    text = base.text
    assert text and base.token_ids
    # A two-letter stop string from the middle of the greedy text (random weights emit
    # random bytes, so look for plain ASCII letters).
    k = next(
        i
        for i in range(3, len(text) - 2)
        if text[i : i + 2].isascii() and text[i : i + 2].isalpha()
    )
    stop = text[k : k + 2]
    cut = text.index(stop)
    out = llm.generate(prompt, SamplingParams(max_tokens=40, stop=stop, **GREEDY), use_tqdm=False)[
        0
    ].outputs[0]
    assert out.text == text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == base.token_ids[: len(out.token_ids)]
    kept = llm.generate(
        prompt,
        SamplingParams(max_tokens=40, stop=[stop], include_stop_str_in_output=True, **GREEDY),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == text[: cut + len(stop)]


def test_stop_token_ids_and_min_tokens(llm) -> None:
    prompt = [7, 8, 9, 10]
    base = (
        llm.generate([prompt], SamplingParams(max_tokens=20, **GREEDY), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    stop_tok = base[2]
    first = base.index(stop_tok)
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=20, stop_token_ids=[stop_tok], **GREEDY), use_tqdm=False
    )
    comp = out[0].outputs[0]
    assert comp.token_ids == base[: first + 1]
    assert comp.finish_reason == "stop" and comp.stop_reason == stop_tok
    longer = llm.generate(
        [prompt],
        SamplingParams(max_tokens=20, min_tokens=first + 3, stop_token_ids=[stop_tok], **GREEDY),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(longer.token_ids) >= first + 3
    assert stop_tok not in longer.token_ids[: first + 3]


def test_seeded_sampling_ignores_the_batch_around_it(llm, random_prompts) -> None:
    params = SamplingParams(
        temperature=0.9, top_k=50, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True
    )
    prompt = [11, 12, 13, 14, 15]
    alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    others = random_prompts([9, 30, 2, 17], 300, seed=31)
    noisy = [SamplingParams(temperature=1.2, max_tokens=12, ignore_eos=True)] * 4
    outs = llm.generate(
        [*others[:2], prompt, *others[2:]], [*noisy[:2], params, *noisy[2:]], use_tqdm=False
    )
    assert outs[2].outputs[0].token_ids == alone
    # n copies of a seeded request use seed + i: reproducible, and not all the same.
    many = llm.generate(
        [prompt],
        SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    again = llm.generate(
        [prompt],
        SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    ids = [c.token_ids for c in many[0].outputs]
    assert ids == [c.token_ids for c in again[0].outputs]
    assert len({tuple(t) for t in ids}) > 1
    first = llm.generate(
        [prompt],
        SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    assert ids[0] == first[0].outputs[0].token_ids


def test_logprobs_are_reported_per_token(llm) -> None:
    out = llm.generate(
        [[1, 2, 3]], SamplingParams(max_tokens=5, logprobs=3, **GREEDY), use_tqdm=False
    )[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    total = 0.0
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and 3 <= len(entry) <= 4
        assert entry[tok] == pytest.approx(max(entry.values()))  # greedy picks the most likely
        total += entry[tok]
    assert out.cumulative_logprob == pytest.approx(total)


def test_step_outputs_are_cumulative_with_metrics(llm) -> None:
    engine = llm.llm_engine
    engine.add_request(
        "c", [1, 2, 3, 4], SamplingParams(max_tokens=4, output_kind=CUMULATIVE, **GREEDY)
    )
    seen = []
    while engine.has_unfinished_requests():
        seen += [o for o in engine.step() if o.request_id == "c"]
    assert [len(o.outputs[0].token_ids) for o in seen] == [1, 2, 3, 4]
    assert [o.finished for o in seen] == [False, False, False, True]
    m = seen[-1].metrics
    assert (
        m.arrival_time
        <= m.first_scheduled_time
        <= m.first_token_time
        <= m.last_token_time
        <= m.finished_time
    )


def test_chat_and_string_prompts_use_the_tokenizer(llm, tiny_llama) -> None:
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "hello world"}]
    [out] = llm.chat(messages, SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
    assert out.prompt_token_ids == tok.encode(
        "<|user|>hello world\n<|assistant|>", add_special_tokens=False
    )
    outs = llm.chat([messages, messages], SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [out.outputs[0].token_ids] * 2
    [res] = llm.generate(
        "the quick brown fox", SamplingParams(max_tokens=3, **GREEDY), use_tqdm=True
    )
    assert res.prompt == "the quick brown fox"
    assert res.prompt_token_ids == tok.encode("the quick brown fox")


def test_stats_count_tokens_and_requests(tiny_llama) -> None:
    folder, _ = tiny_llama
    engine = LLMEngine(
        EngineConfig.from_kwargs(model=str(folder), dtype="float32", kv_cache_memory_bytes=1 << 20)
    )
    for i, n in enumerate([5, 9, 12]):
        engine.add_request(f"s{i}", list(range(1, n + 1)), SamplingParams(max_tokens=4, **GREEDY))
    stats = engine.get_stats()
    assert stats.num_waiting == 3 and stats.num_running == 0
    _drain(engine)
    stats = engine.get_stats()
    assert stats.prompt_tokens_total == 26
    assert stats.generation_tokens_total == 12
    assert stats.num_requests_finished == 3
    assert stats.num_blocks * stats.block_size == 2048


def test_streamed_text_is_never_taken_back(llm) -> None:
    """Successive outputs extend each other's text, even while a stop string is half matched."""
    prompt = "hello world, the quick"
    full = (
        llm.generate(prompt, SamplingParams(max_tokens=40, **GREEDY), use_tqdm=False)[0]
        .outputs[0]
        .text
    )
    k = next(
        i
        for i in range(6, len(full) - 3)
        if full[i : i + 3].isascii() and full[i : i + 3].isalpha()
    )
    stop = full[k : k + 3]
    engine = llm.llm_engine
    engine.add_request(
        "s", prompt, SamplingParams(max_tokens=40, stop=stop, output_kind=CUMULATIVE, **GREEDY)
    )
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in engine.step() if o.request_id == "s"]
    for before, after in itertools.pairwise(texts):
        assert after.startswith(before)
    assert texts[-1] == full[: full.index(stop)]


def test_cache_salt_isolates_prefix_cache(tiny_llama) -> None:
    folder, _ = tiny_llama
    engine = LLMEngine(
        EngineConfig.from_kwargs(model=str(folder), dtype="float32", kv_cache_memory_bytes=1 << 20)
    )
    prompt = list(range(1, 50))
    engine.add_request("a", prompt, SamplingParams(max_tokens=1, **GREEDY), cache_salt="tenant-a")
    _drain(engine)
    engine.add_request("b", prompt, SamplingParams(max_tokens=1, **GREEDY), cache_salt="tenant-b")
    _drain(engine)
    assert engine.get_stats().prefix_cache_hits == 0
    engine.add_request("c", prompt, SamplingParams(max_tokens=1, **GREEDY), cache_salt="tenant-a")
    _drain(engine)
    assert engine.get_stats().prefix_cache_hits == 48


def test_priority_policy_serves_urgent_requests_first(tiny_llama) -> None:
    folder, _ = tiny_llama
    engine = LLMEngine(
        EngineConfig.from_kwargs(
            model=str(folder),
            dtype="float32",
            kv_cache_memory_bytes=1 << 20,
            max_num_seqs=1,
            scheduling_policy="priority",
        )
    )
    engine.add_request("late", [1, 2, 3], SamplingParams(max_tokens=2, **GREEDY), priority=5)
    engine.add_request("urgent", [4, 5, 6], SamplingParams(max_tokens=2, **GREEDY), priority=-1)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["urgent", "late"]


def test_generate_checks_its_arguments(llm) -> None:
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate([[1], [2], [3]], [SamplingParams(), SamplingParams()], use_tqdm=False)
    with pytest.raises(TypeError, match="string or a list of token ids"):
        llm.generate([1.5], use_tqdm=False)  # type: ignore[list-item]
    assert llm.generate([], use_tqdm=False) == []
    assert not llm.llm_engine.has_unfinished_requests()


def test_delta_outputs_add_up_to_the_whole(llm) -> None:
    """The default output kind: each output carries only what is new, and nothing twice."""
    prompt = "hello world, the quick"
    params = dict(max_tokens=24, logprobs=2, **GREEDY)
    [whole] = llm.generate(prompt, SamplingParams(**params), use_tqdm=False)
    engine = llm.llm_engine
    engine.add_request("d", prompt, SamplingParams(n=2, seed=3, **params))
    pieces: dict[int, list] = {0: [], 1: []}
    finished = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                assert len(c.token_ids) <= 1  # a delta of one decode step
                pieces[c.index].append(c)
            finished.append(out.finished)
    assert finished[-1] and not any(finished[:-1])
    for index in (0, 1):
        cs = pieces[index]
        assert "".join(c.text for c in cs) == whole.outputs[0].text
        assert [t for c in cs for t in c.token_ids] == whole.outputs[0].token_ids
        entries = [e for c in cs for e in c.logprobs]
        # The same tokens and top ids; values agree up to the batch's GEMM rounding.
        assert [list(e) for e in entries] == [list(e) for e in whole.outputs[0].logprobs]
        for got, want in zip(entries, whole.outputs[0].logprobs):
            assert list(got.values()) == pytest.approx(list(want.values()), abs=1e-5)
        assert cs[-1].finish_reason == "length" and all(c.finish_reason is None for c in cs[:-1])
        assert cs[-1].cumulative_logprob == pytest.approx(whole.outputs[0].cumulative_logprob)


def test_delta_text_is_held_back_only_for_a_possible_stop(llm) -> None:
    """Text is released as soon as it cannot start a stop string: no second hold-back."""
    prompt = "hello world, the quick"
    engine = llm.llm_engine
    engine.add_request("h", prompt, SamplingParams(max_tokens=16, stop="\u2603\u2603", **GREEDY))
    released = []
    while engine.has_unfinished_requests():
        released += [o.outputs[0] for o in engine.step() if o.request_id == "h"]
    text = "".join(c.text for c in released)
    tok = llm.get_tokenizer()
    ids = [t for c in released for t in c.token_ids]
    # Before the last token, everything but what that token added was already out.
    assert "".join(c.text for c in released[:-1]) == tok.decode(ids[:-1]).rstrip("\ufffd")
    assert text == tok.decode(ids)


def test_arrival_time_reaches_the_request_record(llm) -> None:
    engine = llm.llm_engine
    engine.add_request(
        "t",
        [1, 2, 3],
        SamplingParams(max_tokens=2, output_kind=CUMULATIVE, **GREEDY),
        arrival_time=12.5,
    )
    record = engine.scheduler.get_request("t")
    assert record.arrival_time == 12.5
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].metrics.arrival_time == 12.5
    assert outs[-1].metrics.first_scheduled_time >= record.first_scheduled_time > 12.5


def test_runner_checks_each_requests_own_table(llm) -> None:
    """A request whose own table is too short is refused, even if another's is wide enough."""
    engine = llm.llm_engine
    engine.add_request("wide", [5] * 40, SamplingParams(max_tokens=4, **GREEDY))
    engine.add_request("short", [6] * 3, SamplingParams(max_tokens=4, **GREEDY))
    out = engine.scheduler.schedule()
    wide, short = out.scheduled
    assert len(wide.new_block_ids) == 3 and len(short.new_block_ids) == 1
    # Pretend `short` computes 20 tokens: its one block cannot hold them.
    short.token_ids, short.num_tokens = [6] * 20, 20
    bad = SchedulerOutput([wide, short], wide.num_tokens + 20, [], out.finished_req_ids)
    with pytest.raises(ValueError, match=r"'short'.*beyond its block table of 1 blocks"):
        engine.engine_core.model_runner.execute_model(bad)
    engine.abort_request(["wide", "short"])
    _drain(engine)
    assert engine.engine_core.model_runner.input_batch.req_ids == []
