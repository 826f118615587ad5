"""Regional compilation: one compiled graph per group of identical decoder layers.

With `PAGEMILL_COMPILE_REGIONAL=1` the compile cache's forward compiles a decoder layer, not
the whole model, and every layer of a group runs the graph traced on the first with its own weights
(the layers' own guards are dropped). Checked against transformers (greedy, fp32, token for
token), and layers that differ get graphs of their own; layers of a group share one graph
with their own weights (a graph holding the first one's would fail the unit test).
"""

from __future__ import annotations

import pytest
import torch

from pagemill.runtime import LLM, SamplingParams
from pagemill.runtime.worker.compilation import (
    COMPILE_CACHE_ENV,
    ENFORCE_EAGER_ENV,
    REGIONAL_ENV,
    compile_forward,
    compile_unavailable_reason,
    layer_groups,
)

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _skip_without_compiler() -> None:
    reason = compile_unavailable_reason(torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def regional_llm(tiny_llama, tmp_path_factory) -> LLM:
    _skip_without_compiler()
    folder, _ = tiny_llama
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(ENFORCE_EAGER_ENV, raising=False)
        mp.setenv(COMPILE_CACHE_ENV, "1")
        mp.setenv(REGIONAL_ENV, "1")
        mp.setenv("PAGEMILL_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        llm = LLM(
            str(folder),
            dtype="float32",
            max_num_batched_tokens=64,
            max_num_seqs=6,
            kv_cache_memory_bytes=8 * 16 * 512,
            max_model_len=128,
        )
    return llm


def test_regional_greedy_matches_hf(regional_llm, tiny_llama, hf_greedy, random_prompts) -> None:
    runner = regional_llm.llm_engine.engine_core.model_runner
    assert runner.compiled and runner.compile_cache is not None
    groups = layer_groups(runner.model)
    assert [len(g) for g in groups] == [1, 1]  # the first layer is a group of its own
    assert all("forward" in vars(layer) for layer in runner.model.layers)
    _, model = tiny_llama
    prefix = random_prompts([32], model.config.vocab_size, seed=31)[0]
    prompts = [prefix + p for p in random_prompts([1, 9, 40], model.config.vocab_size, seed=32)]
    prompts += random_prompts([1, 3, 70], model.config.vocab_size, seed=33)
    max_tokens = [12, 20, 5, 16, 9, 24]
    outs = regional_llm.generate(
        prompts, [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens], use_tqdm=False
    )
    for prompt, m, out in zip(prompts, max_tokens, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, m)
    stats = regional_llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


class _Layer(torch.nn.Module):
    def __init__(self, scale: float, double: bool) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((4,), scale), requires_grad=False)
        self.double = double

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        y = x * self.weight
        return y * 2 if self.double else y + 1


class _Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # Weights differ everywhere; the flag splits the layers into two groups.
        self.layers = torch.nn.ModuleList(
            _Layer(s, d)
            for s, d in [(1.0, True), (2.0, True), (3.0, False), (4.0, True), (5.0, True)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(len(self.layers)):
            x = self.layers[i](x, None)
        return x


def test_layers_that_differ_get_their_own_graph() -> None:
    _skip_without_compiler()
    model = _Stack()
    groups = layer_groups(model)
    assert [[list(model.layers).index(m) for m in g] for g in groups] == [[0], [1, 3, 4], [2]]
    x = torch.arange(1.0, 5.0)
    expected = model(x)
    forward = compile_forward(model, freezing=False, regional=True)
    assert all("forward" in vars(layer) for layer in model.layers)
    torch.testing.assert_close(forward(x), expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="freeze"):
        compile_forward(model, freezing=True, regional=True)
    # A whole-model compile takes the layers back to their eager forward first.
    compile_forward(model, freezing=True)
    assert not any("forward" in vars(layer) for layer in model.layers)


def test_regional_switch(tiny_llama, monkeypatch) -> None:
    from pagemill.runtime.worker.compilation import compile_cache_key

    _, model = tiny_llama
    monkeypatch.setenv(REGIONAL_ENV, "1")
    on, _ = compile_cache_key(model, {})
    monkeypatch.setenv(REGIONAL_ENV, "0")
    off, _ = compile_cache_key(model, {})
    assert on != off  # the two compiles never share an entry
    monkeypatch.setenv(REGIONAL_ENV, "no")
    with pytest.raises(ValueError, match=REGIONAL_ENV):
        compile_cache_key(model, {})
