"""The compiled step (torch.compile over the forward, CPU) computes what the eager one does.

One engine per module: compilation costs seconds even for a two-layer model. It is checked
against transformers (greedy, fp32, token for token) on a batch that mixes decodes with
chunked prefills, prefix hits and preemption, and seeded sampling must give the same tokens
compiled and eager.
"""

from __future__ import annotations

import pytest
import torch

from pagemill.runtime import LLM, SamplingParams
from pagemill.runtime.worker.compilation import (
    ENFORCE_EAGER_ENV,
    compile_forward,
    compile_unavailable_reason,
)

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def compiled_llm(tiny_llama, compiled_llm_of) -> LLM:
    folder, _ = tiny_llama
    # 8 blocks of 16 for prompts of up to 120 tokens: requests are preempted.
    return compiled_llm_of(
        folder,
        dtype="float32",
        max_num_batched_tokens=64,
        max_num_seqs=6,
        kv_cache_memory_bytes=8 * 16 * 512,
        max_model_len=128,
    )


def test_compiled_greedy_matches_hf(compiled_llm, tiny_llama, hf_greedy, random_prompts) -> None:
    _, model = tiny_llama
    prefix = random_prompts([32], model.config.vocab_size, seed=21)[0]
    prompts = [prefix + p for p in random_prompts([1, 9, 40, 60], model.config.vocab_size, seed=22)]
    prompts += random_prompts([1, 3, 70], model.config.vocab_size, seed=23)
    max_tokens = [12, 20, 5, 16, 9, 24, 10]
    outs = compiled_llm.generate(
        prompts, [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens], use_tqdm=False
    )
    for prompt, m, out in zip(prompts, max_tokens, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, m)
    stats = compiled_llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_compiled_seeded_sampling_equals_eager(compiled_llm, tiny_llama, random_prompts) -> None:
    folder, model = tiny_llama
    prompts = random_prompts([5, 17, 30], model.config.vocab_size, seed=24)
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True)
    compiled = compiled_llm.generate(prompts, params, use_tqdm=False)
    eager = LLM(str(folder), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=4 << 20)
    assert not eager.llm_engine.engine_core.model_runner.compiled
    again = eager.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in compiled] == [o.outputs[0].token_ids for o in again]


def test_no_compiler_falls_back_to_eager_with_one_warning(tiny_llama, monkeypatch, caplog) -> None:
    import pagemill.runtime.worker.compilation as compilation

    monkeypatch.delenv(ENFORCE_EAGER_ENV, raising=False)
    monkeypatch.setattr(compilation, "_cxx_compiler", lambda: None)
    folder, _ = tiny_llama
    with caplog.at_level("WARNING"):
        llm = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=1 << 20)
    assert not llm.llm_engine.engine_core.model_runner.compiled
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0]
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


class _Branchy(torch.nn.Module):
    """Branches on a Python attribute, as Linear does on its weight format."""

    def __init__(self, double: bool) -> None:
        super().__init__()
        self.double = double

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: object
    ) -> torch.Tensor:
        return input_ids * 2 if self.double else input_ids + 1


def test_each_model_compiles_its_own_graph() -> None:
    # Dynamo caches graphs on the forward's code object and the model's own guards are
    # dropped: without a private code object the second model ran the first one's graph
    # (a quantized engine built after a dense one ran the dense branches).
    if compile_unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip(compile_unavailable_reason(torch.device("cpu")))
    x = torch.arange(4.0)
    first = compile_forward(_Branchy(True))(x, x, None)
    second = compile_forward(_Branchy(False))(x, x, None)
    assert first.tolist() == [0.0, 2.0, 4.0, 6.0]
    assert second.tolist() == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.slow  # compiling a fresh model costs ~90 s on two shared cores
def test_compiled_gemma2_windows_and_softcap(
    tmp_path, build_tiny_model, hf_greedy, random_prompts
) -> None:
    """Per-layer windows and soft-caps enter the compiled graph as plain numbers of the
    attention op: Gemma 2 (alternating windows, capped scores) compiled equals transformers."""
    import torch

    reason = compile_unavailable_reason(torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)
    model = build_tiny_model(
        tmp_path,
        "gemma2",
        seed=2,
        head_dim=16,
        sliding_window=10,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0,
        tie_word_embeddings=True,
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(ENFORCE_EAGER_ENV, raising=False)
        llm = LLM(
            str(tmp_path), dtype="float32", max_num_batched_tokens=16, kv_cache_memory_bytes=1 << 20
        )
    assert llm.llm_engine.engine_core.model_runner.compiled
    prompts = random_prompts([40, 3, 25], model.config.vocab_size, seed=24)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 12)


@pytest.mark.slow  # compiling a fresh model costs ~90 s on two shared cores
@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("smollm3", dict(num_hidden_layers=3, no_rope_layer_interval=2)),
        ("olmo2", dict(attention_bias=True)),
        ("granite", dict(embedding_multiplier=3.0, residual_multiplier=0.5, logits_scaling=2.5)),
    ],
    ids=["smollm3", "olmo2", "granite"],
)
def test_compiled_new_families(
    arch, overrides, tmp_path, build_tiny_model, hf_greedy, random_prompts
) -> None:
    """NoPE layers, OLMo 2's post-norms and whole-projection q/k norms, Granite's multipliers:
    each compiled equals transformers."""
    reason = compile_unavailable_reason(torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)
    model = build_tiny_model(tmp_path, arch, seed=2, **overrides)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(ENFORCE_EAGER_ENV, raising=False)
        llm = LLM(
            str(tmp_path), dtype="float32", max_num_batched_tokens=16, kv_cache_memory_bytes=1 << 20
        )
    assert llm.llm_engine.engine_core.model_runner.compiled
    prompts = random_prompts([40, 3, 25], model.config.vocab_size, seed=24)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 12)


def _entry_codes(llm: LLM) -> list[object]:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    forward = llm.llm_engine.engine_core.model_runner._forward
    code = forward._torchdynamo_orig_callable.__func__.__code__
    return [entry.code for entry in _debug_get_cache_entry_list(code)]


def test_norm_epsilons_are_graph_constants(compiled_llm) -> None:
    # Unspecialized, every norm's epsilon was a graph input that the compiled frame's
    # prologue wrapped in a new tensor on every step (`torch._as_tensor_fullprec`).
    codes = _entry_codes(compiled_llm)
    assert codes, "the compiled forward has no graph"
    for code in codes:
        assert "_as_tensor_fullprec" not in code.co_names


class _Eps(torch.nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: object
    ) -> torch.Tensor:
        return input_ids * self.eps + positions


def test_specialized_floats_are_each_models_own() -> None:
    # The float guards are dropped with the model's: each model's constant must come from
    # its own trace, never the first model's graph.
    if compile_unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip(compile_unavailable_reason(torch.device("cpu")))
    from pagemill.runtime.worker.compilation import model_trace_config

    x = torch.arange(4.0)
    with model_trace_config():
        first = compile_forward(_Eps(2.0))(x, x, None)
        second = compile_forward(_Eps(3.0))(x, x, None)
    assert first.tolist() == [0.0, 3.0, 6.0, 9.0]
    assert second.tolist() == [0.0, 4.0, 8.0, 12.0]


def test_cpp_wrapper_mode_is_checked(monkeypatch) -> None:
    from pagemill.runtime.worker import compilation

    monkeypatch.delenv(compilation.CPP_WRAPPER_ENV, raising=False)
    assert compilation.cpp_wrapper_mode() == "1"
    for value, mode in (("", "1"), ("0", "0"), ("1", "1"), (" single ", "single")):
        monkeypatch.setenv(compilation.CPP_WRAPPER_ENV, value)
        assert compilation.cpp_wrapper_mode() == mode
    monkeypatch.setenv(compilation.CPP_WRAPPER_ENV, "yes")
    with pytest.raises(ValueError, match="PAGEMILL_CPP_WRAPPER"):
        compilation.cpp_wrapper_mode()


@pytest.mark.slow  # C++ wrappers' builds add tens of seconds to the tiny model's compile
@pytest.mark.parametrize("mode", ["single", "1"])
def test_cpp_wrapper_graphs(
    tiny_llama, hf_greedy, random_prompts, monkeypatch, caplog, mode
) -> None:
    # `single`: the one-token graph (every batch-1 decode) gets a C++ wrapper, the token-
    # dynamic graphs keep the Python one. `1` (the default): the decode-only graphs of
    # several requests get one too; the graphs that take the attention plan (prefill-like
    # steps) cannot. Tokens must not change either way.
    if compile_unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip(compile_unavailable_reason(torch.device("cpu")))
    from pagemill.runtime.worker import compilation

    monkeypatch.delenv(ENFORCE_EAGER_ENV, raising=False)
    monkeypatch.setenv(compilation.CPP_WRAPPER_ENV, mode)
    folder, model = tiny_llama
    with caplog.at_level("INFO", logger=compilation.__name__):
        llm = LLM(str(folder), dtype="float32", max_num_seqs=4, kv_cache_memory_bytes=4 << 20)
    wrapped = [
        r.getMessage().endswith("True")
        for r in caplog.records
        if r.getMessage().startswith("compile: a graph with cpp_wrapper=")
    ]
    assert llm.llm_engine.engine_core.model_runner.decode_graph_token_counts()
    assert wrapped.count(False) >= 1  # the graphs that take the attention plan
    if mode == "single":
        assert wrapped.count(True) == 1
    else:  # the one-token graph and at least one decode-only graph of several requests
        assert wrapped.count(True) >= 2
    prompts = random_prompts([1, 7, 30], model.config.vocab_size, seed=31)
    # Three requests decode together, then two, then the last alone: every decode graph.
    max_tokens = [3, 6, 14]
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, m, out in zip(prompts, max_tokens, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, m)


@torch.library.custom_op("pagemill_test::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def test_first_call_aliasing_check_follows_its_switch(monkeypatch) -> None:
    """torch's first-call aliasing check of custom ops runs on a compiled graph's first call
    when PAGEMILL_CHECK_OP_ALIASING=1 (the suites' setting) and on no call otherwise: not
    the warm-up's, and not the first request's after it (a check skipped only around the
    warm-up ran there instead, a graph's first call counting as done only once checked)."""
    import torch._dynamo  # first: runtime_wrappers alone is a circular import
    import torch._functorch._aot_autograd.runtime_wrappers as runtime_wrappers
    import torch._functorch.config as functorch_config

    from pagemill.runtime.worker.model_runner import (
        OP_ALIASING_CHECK_ENV,
        apply_first_call_checks,
    )

    checked: list[str] = []
    real = runtime_wrappers._check_custom_op_aliasing

    def count(name, *args, **kwargs):
        checked.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(runtime_wrappers, "_check_custom_op_aliasing", count)
    # Restored by hand: monkeypatch would delete the setting (a torch config module keeps
    # it outside its __dict__), which hides it from every later compile in the process.
    before = functorch_config.check_custom_op_aliasing
    fn = torch.compile(lambda t: _twice(t) + 1, backend="aot_eager", fullgraph=True, dynamic=False)
    try:
        for size, (value, expected) in enumerate((("1", 1), ("", 0), ("0", 0)), 4):
            monkeypatch.setenv(OP_ALIASING_CHECK_ENV, value)
            apply_first_call_checks()
            checked.clear()
            x = torch.ones(size)  # a new shape: a new graph, with its own first call
            for _ in range(3):  # the warm-up's call, then requests' calls
                assert torch.equal(fn(x), x * 2 + 1)
            assert len(checked) == expected, (value, checked)
        monkeypatch.setenv(OP_ALIASING_CHECK_ENV, "yes")
        with pytest.raises(ValueError, match=OP_ALIASING_CHECK_ENV):
            apply_first_call_checks()
    finally:
        functorch_config.check_custom_op_aliasing = before
