"""Decode-only steps take the lean host path.

`ModelRunner._decode_layout` lays out a step where every request decodes one token in its
row's order, and must give exactly what the general `_layout` gives for it. On a compiled
runner whose attention layers all take the C++ decode operator, such a step skips the
attention plan (`_plan_free_inputs`): the graph reads the decode buffers, and the plan is
built only when something runs the step eagerly (`AttentionMetadata.attention_plan`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagemill.kernels import cpu_native
from pagemill.runtime import LLM, SamplingParams
from pagemill.runtime.worker import model_runner as model_runner_module
from pagemill.runtime.worker.attention_metadata import AttentionMetadata

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _tokens(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _same_batch(a: object, b: object) -> None:
    for field in ("positions", "slots", "query_start_loc", "seq_lens", "block_tables"):
        x, y = getattr(a, field), getattr(b, field)
        assert x.dtype == y.dtype and np.array_equal(x, y), field
    assert np.array_equal(a.query_lens, b.query_lens)  # type: ignore[attr-defined]
    assert torch.equal(a.input_ids, b.input_ids)  # type: ignore[attr-defined]
    for field in ("sample_indices", "num_samples", "group_slots", "group_block_tables"):
        assert getattr(a, field) == getattr(b, field), field


def test_decode_layout_is_the_general_layout(
    tiny_llama, random_prompts, monkeypatch, small_engine
) -> None:
    folder, model = tiny_llama
    llm = LLM(str(folder), **small_engine)
    runner = llm.llm_engine.engine_core.model_runner
    lean_steps: list[int] = []
    general_steps = 0
    real = runner._decode_layout

    def both(scheduled):
        nonlocal general_steps
        lean = real(scheduled)
        if lean is None:
            general_steps += 1
            return None
        step, req_ids, metadata = lean
        g_step, g_req_ids, g_metadata = runner._layout(scheduled)
        _same_batch(step, g_step)
        assert req_ids == g_req_ids and metadata is g_metadata
        lean_steps.append(len(scheduled))
        return lean

    monkeypatch.setattr(runner, "_decode_layout", both)
    # Different lengths: requests finish at different steps, so rows are removed and the
    # batch is laid out again (the general path takes the steps with a prompt in them).
    prompts = random_prompts([3, 17, 9], model.config.vocab_size, seed=5)
    max_tokens = [12, 5, 9]
    got = _tokens(llm, prompts, max_tokens)
    assert lean_steps and max(lean_steps) == 3 and general_steps
    runner.decode_fast_path = False
    assert _tokens(llm, prompts, max_tokens) == got


def test_decode_layout_leaves_other_steps_to_the_general_path(
    tiny_llama, random_prompts, small_engine
) -> None:
    folder, model = tiny_llama
    llm = LLM(str(folder), **small_engine)
    engine = llm.llm_engine
    runner = engine.engine_core.model_runner
    seen: list[bool] = []
    real = runner._decode_layout
    runner._decode_layout = lambda scheduled: (seen.append(real(scheduled) is not None), None)[1]
    prompt = random_prompts([6], model.config.vocab_size, seed=2)[0]
    engine.add_request("a", prompt, SamplingParams(max_tokens=4, **GREEDY))
    engine.step()  # the prompt
    engine.step()  # a decode
    # A second prompt joins: its step mixes a prompt with a decode.
    engine.add_request("b", prompt, SamplingParams(max_tokens=4, **GREEDY))
    engine.step()
    assert seen == [False, True, False]


def test_compiled_decode_steps_plan_nothing(
    native_compiled_llm, tiny_llama, hf_greedy, random_prompts, monkeypatch
) -> None:
    _, model = tiny_llama
    runner = native_compiled_llm.llm_engine.engine_core.model_runner
    assert runner._plan_free_decode
    planned: list[int] = []
    real = model_runner_module.plan_attention

    def counting(*args, **kwargs):
        planned.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(model_runner_module, "plan_attention", counting)
    # One-token prompts: every step is decode-only, the first included.
    prompts = random_prompts([1, 1], model.config.vocab_size, seed=31)
    got = _tokens(native_compiled_llm, prompts, [16, 16])
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == hf_greedy(model, prompt, 16)
    assert planned == []
    monkeypatch.setattr(runner, "decode_fast_path", False)
    assert _tokens(native_compiled_llm, prompts, [16, 16]) == got
    assert planned  # the general path plans every step (so the count above can fail)


def test_an_eager_run_of_a_plan_free_step_builds_the_plan(
    native_compiled_llm, tiny_llama, random_prompts, monkeypatch
) -> None:
    _, model = tiny_llama
    runner = native_compiled_llm.llm_engine.engine_core.model_runner
    checked: list[int] = []
    real = runner._local_logits

    def eager_first(step):
        if step.attn.plan is None and step.attn.native_decode:
            # The same tokens written to the same slots: the compiled step after it sees
            # the cache it would have seen.
            eager = runner.model.forward(step.input_ids, step.positions, step.attn)
            assert step.attn.plan is not None  # built on the way, from the host layout
            general = runner._plan_of(step.batch)
            assert torch.equal(step.attn.plan.block_tables, general.block_tables)
            assert torch.equal(step.attn.plan.seq_lens, general.seq_lens)
            hidden, logits = real(step)
            torch.testing.assert_close(hidden, eager, rtol=1e-4, atol=1e-4)
            checked.append(len(step.sample_req_ids))
            return hidden, logits
        return real(step)

    monkeypatch.setattr(runner, "_local_logits", eager_first)
    prompts = random_prompts([4, 7], model.config.vocab_size, seed=8)
    _tokens(native_compiled_llm, prompts, [6, 6])
    assert checked and max(checked) == 2


def test_a_layer_the_decode_operator_does_not_take_keeps_the_plan(tiny_llama, small_engine) -> None:
    if not cpu_native.load_attention_ops():
        pytest.skip("the C++ attention operators cannot be built here")
    folder, _ = tiny_llama
    llm = LLM(str(folder), **small_engine)
    runner = llm.llm_engine.engine_core.model_runner
    runner._bind_decode_buffers()
    assert runner._plan_free_decode
    layer = next(m for m in runner.model.modules() if hasattr(m, "serves_native_decode"))
    layer.sinks = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16), requires_grad=False)
    runner._bind_decode_buffers()
    assert not layer.serves_native_decode(runner.dtype)
    assert not runner._plan_free_decode


def test_metadata_without_a_plan_or_its_source_says_so() -> None:
    meta = AttentionMetadata(slot_mapping=torch.zeros(1, dtype=torch.int64), plan=None)
    with pytest.raises(RuntimeError, match="plan"):
        meta.attention_plan()
