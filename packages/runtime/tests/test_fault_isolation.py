"""A step that raises for one request: that request fails, the others finish exactly.

The engine core's model runner is replaced by a double (`FaultyModelRunner`, through the
public `EngineCore.model_runner`) that raises whenever a marked token id is in the batch;
only one request carries the mark. Before fault isolation the first failing step
killed every request for good; now the culprit finishes with finish_reason "error", the
others' tokens equal transformers' greedy continuation, and the pool ends empty.
"""

from __future__ import annotations

import pytest

from pagemill.runtime import LLMEngine, SamplingParams
from pagemill.runtime.engine.fault_injection import FaultyModelRunner, TokenFault, inject_fault
from pagemill.runtime.engine.fault_isolation import MAX_CONSECUTIVE_CULPRITS, EngineFaultError
from pagemill.runtime.sampling_params import RequestOutputKind

MARK = 7
NEW_TOKENS = 6


def _engine(folder, **kw) -> LLMEngine:
    return LLMEngine(
        model=str(folder),
        dtype="float32",
        max_model_len=128,
        kv_cache_memory_bytes=1 << 20,
        max_num_batched_tokens=256,
        **kw,
    )


def _poison(engine: LLMEngine, message: str = "boom: bad token in the batch") -> list[int]:
    """Make a step raise while MARK is among its input ids; returns a log of step sizes."""
    calls: list[int] = []
    token_fault = TokenFault(MARK, message)

    def fault(out):
        calls.append(out.total_num_scheduled_tokens)
        return token_fault(out)

    inject_fault(engine, fault)
    assert isinstance(engine.engine_core.model_runner, FaultyModelRunner)
    return calls


def _clean_prompts(random_prompts, n: int, vocab: int) -> list[list[int]]:
    prompts = random_prompts([9 + 3 * i for i in range(n)], vocab, seed=3)
    return [[t if t != MARK else MARK + 1 for t in p] for p in prompts]


def _assert_pool_clean(engine: LLMEngine) -> None:
    core = engine.engine_core
    assert not engine.has_unfinished_requests()
    assert core.kv_cache_manager.get_num_free_blocks() == core.num_blocks
    assert core.kv_cache_manager.req_to_blocks == {}
    assert core.scheduler.requests == {} and core.scheduler.running == []
    assert core.scheduler.restricted_to is None
    assert core.scheduler.get_stats().num_waiting == 0
    assert not core.isolator.active and core.isolator.suspects == []


def _run(engine: LLMEngine, late: dict[int, tuple[str, list[int]]] | None = None) -> dict:
    final: dict = {}
    step = 0
    while engine.has_unfinished_requests() or (late and step <= max(late)):
        if late and step in late:
            rid, prompt = late[step]
            engine.add_request(
                rid,
                prompt,
                SamplingParams(
                    max_tokens=NEW_TOKENS,
                    temperature=0.0,
                    ignore_eos=True,
                    output_kind=RequestOutputKind.FINAL_ONLY,
                ),
            )
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        step += 1
        assert step < 500
    return final


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_one_poisoned_prompt_fails_alone(
    tiny_llama, hf_greedy, random_prompts, prefix_caching
) -> None:
    folder, hf_model = tiny_llama
    engine = _engine(folder, enable_prefix_caching=prefix_caching)
    vocab = engine.model_config.vocab_size
    prompts = _clean_prompts(random_prompts, 7, vocab)
    bad = [*prompts[4][:5], MARK, *prompts[4][5:]]
    prompts[4] = bad
    calls = _poison(engine)
    params = SamplingParams(
        max_tokens=NEW_TOKENS,
        temperature=0.0,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    final = _run(engine)

    assert set(final) == {f"r{i}" for i in range(7)}
    assert final["r4"].outputs[0].finish_reason == "error"
    for i, p in enumerate(prompts):
        if i == 4:
            continue
        out = final[f"r{i}"].outputs[0]
        assert out.finish_reason == "length"
        assert out.token_ids == hf_greedy(hf_model, p, NEW_TOKENS), f"r{i}"
    core = engine.engine_core
    # 7 suspects: found in ceil(log2 7) = 3 failed steps after the first.
    assert core.isolator.num_failed_steps <= 4
    assert core.isolator.num_culprits == 1
    _assert_pool_clean(engine)
    # The engine keeps serving afterwards (the poison is still armed).
    again = _run(engine, {0: ("after", prompts[0])})
    assert again["after"].outputs[0].token_ids == hf_greedy(hf_model, prompts[0], NEW_TOKENS)
    assert len(calls) > 0


def test_poison_arriving_mid_decode(tiny_llama, hf_greedy, random_prompts) -> None:
    """Others are decoding when the poisoned prompt joins: they recompute and stay exact."""
    folder, hf_model = tiny_llama
    engine = _engine(folder)
    vocab = engine.model_config.vocab_size
    prompts = _clean_prompts(random_prompts, 4, vocab)
    _poison(engine)
    params = SamplingParams(
        max_tokens=NEW_TOKENS,
        temperature=0.0,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    final = _run(engine, {2: ("bad", [MARK, 3, 4, 5]), 3: ("late", prompts[1][:6])})
    assert final["bad"].outputs[0].finish_reason == "error"
    for i, p in enumerate(prompts):
        assert final[f"r{i}"].outputs[0].token_ids == hf_greedy(hf_model, p, NEW_TOKENS)
    assert final["late"].outputs[0].token_ids == hf_greedy(hf_model, prompts[1][:6], NEW_TOKENS)
    _assert_pool_clean(engine)


def test_abort_during_isolation(tiny_llama, random_prompts) -> None:
    folder, _ = tiny_llama
    engine = _engine(folder)
    prompts = _clean_prompts(random_prompts, 4, engine.model_config.vocab_size)
    prompts[0] = [MARK] + prompts[0]
    _poison(engine)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    engine.step()  # fails: isolation starts, half of the requests are held aside
    core = engine.engine_core
    assert core.isolator.active and core.isolator.suspects == ["r0", "r1"]
    assert core.scheduler.restricted_to == {"r0", "r1"}
    engine.abort_request(["r1", "r3"])
    final = _run(engine)
    assert final["r0"].outputs[0].finish_reason == "error"
    assert final["r2"].outputs[0].finish_reason == "length"
    _assert_pool_clean(engine)


def test_device_error_is_not_contained(tiny_llama, random_prompts) -> None:
    folder, _ = tiny_llama
    engine = _engine(folder)
    _poison(engine, "CUDA error: an illegal memory access was encountered")
    engine.add_request("a", [MARK, 3, 4], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="CUDA error"):
        engine.step()


def test_a_fault_every_request_hits_stops_the_engine(tiny_llama, random_prompts) -> None:
    folder, _ = tiny_llama
    engine = _engine(folder)
    inject_fault(engine, lambda _out: RuntimeError("the weights are gone"))
    prompts = _clean_prompts(
        random_prompts, MAX_CONSECUTIVE_CULPRITS + 2, engine.model_config.vocab_size
    )
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=2))
    with pytest.raises(EngineFaultError, match="in a row"):
        for _ in range(200):
            engine.step()
