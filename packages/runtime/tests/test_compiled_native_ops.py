"""A compiled decode step calls the C++ KV-write and decode operators directly, with plain
tensors, never the Python custom ops (`torch.ops.pagemill.*`), when they are loaded; without
them (`PAGEMILL_NATIVE_ATTENTION_OPS=0`) the custom ops serve and compute the same tokens.

Which operators a step ran is read from torch.profiler, which records every dispatcher call,
the custom ops' included.
"""

from __future__ import annotations

from collections import Counter

from torch.profiler import ProfilerActivity, profile

from pagemill.kernels import cpu_native
from pagemill.runtime import LLM, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)
PY_ATTENTION = "pagemill::paged_attention"
PY_KV_WRITE = "pagemill::write_kv_cache"
NATIVE_DECODE = "pagemill_native::paged_decode"
NATIVE_KV_WRITE = "pagemill_native::write_kv_cache"


def _ops_of(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], Counter]:
    params = SamplingParams(max_tokens=max_tokens, **GREEDY)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        outs = llm.generate(prompts, params, use_tqdm=False)
    names = Counter(e.name for e in prof.events())
    return [o.outputs[0].token_ids for o in outs], names


def test_compiled_decode_calls_no_python_attention_op(
    native_compiled_llm, tiny_llama, hf_greedy, random_prompts
) -> None:
    _, model = tiny_llama
    # One-token prompts: every step is decode-only (one query token per request), the
    # first (two requests) included.
    prompts = random_prompts([1, 1], model.config.vocab_size, seed=31)
    tokens, names = _ops_of(native_compiled_llm, prompts, 20)
    for prompt, got in zip(prompts, tokens):
        assert got == hf_greedy(model, prompt, 20)
    assert names[NATIVE_DECODE] > 0 and names[NATIVE_KV_WRITE] > 0
    assert names[PY_ATTENTION] == 0 and names[PY_KV_WRITE] == 0


def test_compiled_prefill_keeps_the_plan_path(
    native_compiled_llm, tiny_llama, hf_greedy, random_prompts
) -> None:
    # Prefill chunks run the attention custom op with the plan (the native kernel is
    # decode-only); the KV write is the C++ operator there too. Also shows the profiler
    # sees the custom op, so the test above can fail.
    _, model = tiny_llama
    prompts = random_prompts([9, 40, 3], model.config.vocab_size, seed=32)
    tokens, names = _ops_of(native_compiled_llm, prompts, 12)
    for prompt, got in zip(prompts, tokens):
        assert got == hf_greedy(model, prompt, 12)
    assert names[PY_ATTENTION] > 0 and names[NATIVE_DECODE] > 0
    assert names[PY_KV_WRITE] == 0


def test_compiled_without_native_ops_uses_the_custom_ops(
    tiny_llama, hf_greedy, random_prompts, monkeypatch, compiled_llm_of, small_engine
) -> None:
    # As with PAGEMILL_NATIVE_ATTENTION_OPS=0 (the operators, once loaded, stay loaded in
    # this process: the switch the runner and the trace read is patched instead).
    monkeypatch.setattr(cpu_native, "attention_ops_loaded", lambda: False)
    folder, model = tiny_llama
    llm = compiled_llm_of(folder, **small_engine)
    runner = llm.llm_engine.engine_core.model_runner
    assert runner.decode_graph_token_counts() == []
    assert runner.compile_settings()["native_attention_ops"] is False
    prompts = random_prompts([1, 1, 7], model.config.vocab_size, seed=33)
    tokens, names = _ops_of(llm, prompts, 16)
    for prompt, got in zip(prompts, tokens):
        assert got == hf_greedy(model, prompt, 16)
    assert names[PY_ATTENTION] > 0 and names[PY_KV_WRITE] > 0
    assert names[NATIVE_DECODE] == 0
