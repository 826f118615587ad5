"""A compiled graph reads every layer's packed weights, norm weights and K/V caches through
one input each (slices of the tensor they all live in), not one input per tensor.

Each input costs every call (fetched by its attribute path, passed on, turned into a
pointer), so at batch 1 the per-layer inputs were a measurable share of the step. The
views must be the very tensors eager code reads (same memory, same shape), and the
compiled engine must generate what the eager one does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagemill.kernels import gemv_q4_cpu
from pagemill.runtime import LLM, SamplingParams
from pagemill.runtime.model_executor.gathered_params import gathered_view
from pagemill.runtime.model_executor.huge_page_weights import HUGE_PAGE_WEIGHTS_ENV, arena_view
from pagemill.runtime.model_executor.layers.linear import Linear
from pagemill.runtime.model_executor.models.llama import LlamaAttention, RMSNorm
from pagemill.runtime.worker import compilation

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not gemv_q4_cpu.available(), reason="no C++ compiler")

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _same(view: torch.Tensor | None, t: torch.Tensor) -> None:
    assert view is not None
    assert view.data_ptr() == t.data_ptr() and view.shape == t.shape and view.dtype == t.dtype
    assert torch.equal(view, t)


def test_views_are_the_tensors_eager_code_reads(q4_gguf, monkeypatch) -> None:
    monkeypatch.delenv(HUGE_PAGE_WEIGHTS_ENV, raising=False)
    llm = LLM(str(q4_gguf), dtype="bfloat16", enforce_eager=True, kv_cache_memory_bytes=1 << 20)
    model = llm.llm_engine.engine_core.model_runner.model
    packed = [m for m in model.modules() if isinstance(m, Linear) and m.native_gemv]
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    attention = [m for m in model.modules() if isinstance(m, LlamaAttention)]
    assert packed and norms and attention
    for layer in packed:
        assert layer.qweight is not None
        _same(arena_view(layer, "qweight"), layer.qweight)
        assert arena_view(layer, "scales") is None  # only what was moved there
    assert len({id(layer.packed_arena) for layer in packed}) == 1
    for norm in norms:
        _same(gathered_view(norm, "weight"), norm.weight)
    assert len({id(norm.gathered) for norm in norms}) == 1
    pools = set()
    for attn in attention:
        assert attn.k_cache is not None and attn.v_cache is not None
        k, v = attn._graph_kv()
        assert attn.kv_pool is not None
        pools.add(id(attn.kv_pool))
        _same(k, attn.k_cache)
        _same(v, attn.v_cache)
    assert len(pools) == 1
    # Writing through a view is writing the cache (the graph's KV write goes through it).
    k, _ = attention[-1]._graph_kv()
    k[3, 1].fill_(1.5)
    assert bool((attention[-1].k_cache[3, 1] == 1.5).all())


def test_a_cache_outside_the_pool_is_read_as_itself() -> None:
    attn = LlamaAttention.__new__(LlamaAttention)
    torch.nn.Module.__init__(attn)
    pool = torch.zeros(64)
    attn.k_cache, attn.v_cache = pool[:16].view(2, 8), torch.zeros(2, 8)  # v not in the pool
    attn.bind_pool(pool)
    assert attn.kv_pool is None
    k, v = attn._graph_kv()
    assert k is attn.k_cache and v is attn.v_cache
    attn.v_cache = pool[32:48].view(2, 8)
    attn.bind_pool(pool)
    assert attn.kv_pool_slots == ((0, (2, 8)), (32, (2, 8)))
    attn.bind_pool(None)
    assert attn.kv_pool is None and attn.kv_pool_slots == ()


def _per_layer_sources(gm: torch.fx.GraphModule) -> list[str]:
    """The graph's inputs that are one layer's own packed weight, norm weight or cache (by
    the placeholder's name, which dynamo derives from the attribute path it was read by,
    e.g. `l_self_modules_layers_modules_0_modules_self_attn_k_cache`)."""
    found = []
    for node in gm.graph.nodes:
        name = node.name
        if node.op == "placeholder" and (
            name.endswith(("_k_cache", "_v_cache", "_buffers_qweight_"))
            or ("norm" in name and name.endswith("_parameters_weight_"))
        ):
            found.append(name)
    return found


def _compiled_run(path: Path, monkeypatch) -> tuple[list[list[int]], list[str]]:
    """Greedy tokens of a freshly compiled engine, and its graphs' per-layer inputs."""
    graphs: list[torch.fx.GraphModule] = []
    inner = compilation._inductor_per_graph

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        backend = inner(*args, **kwargs)

        def record(gm, example_inputs):  # type: ignore[no-untyped-def]
            graphs.append(gm)
            return backend(gm, example_inputs)

        return record

    with monkeypatch.context() as mp:
        mp.setattr(compilation, "_inductor_per_graph", recording)
        llm = LLM(str(path), dtype="bfloat16", kv_cache_memory_bytes=1 << 20, max_num_seqs=4)
        assert llm.llm_engine.engine_core.model_runner.compiled
        outs = llm.generate([[5, 9, 2, 7], list(range(3, 40))], GREEDY, use_tqdm=False)
    assert graphs
    return [o.outputs[0].token_ids for o in outs], [
        n for g in graphs for n in _per_layer_sources(g)
    ]


@pytest.mark.slow  # two cold compiles of the tiny model
def test_compiled_graph_takes_no_per_layer_inputs(q4_gguf, tmp_path, monkeypatch) -> None:
    """Compiled with the views, no graph input is one layer's own tensor; compiled with each
    tensor an input of its own (the switches off), the same tokens."""
    reason = compilation.compile_unavailable_reason(torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.delenv(compilation.ENFORCE_EAGER_ENV, raising=False)
    monkeypatch.setenv("PAGEMILL_CACHE_DIR", str(tmp_path / "cache"))  # cold: the graphs trace
    monkeypatch.setenv("PAGEMILL_COMPILE_BACKGROUND", "0")
    monkeypatch.delenv(HUGE_PAGE_WEIGHTS_ENV, raising=False)
    tokens, per_layer = _compiled_run(q4_gguf, monkeypatch)
    assert per_layer == []
    monkeypatch.setattr(Linear, "read_from_arena", False)
    monkeypatch.setattr(RMSNorm, "gathered_params", ())
    monkeypatch.setattr(LlamaAttention, "read_kv_from_pool", False)
    before, per_layer = _compiled_run(q4_gguf, monkeypatch)
    assert before == tokens
    # What the check above looks for is there without the views: every layer's own.
    assert any(n.endswith("_k_cache") for n in per_layer)
    assert any(n.endswith("_buffers_qweight_") for n in per_layer)
    assert any(n.endswith("_parameters_weight_") for n in per_layer)
