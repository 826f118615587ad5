"""Mixture-of-experts models (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE) equal transformers.

Tiny random models built by transformers, fp32: logits at every prompt position through the
paged cache; greedy generation through the engine with chunked prefill (a 16-token budget),
prefix-cache hits and preemption, against `generate`; and the sparse block alone against
transformers' own MoE block on the same weights (routing, renormalisation, shared expert).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagemill.runtime import LLM, SamplingParams
from pagemill.runtime.config import ModelConfig
from pagemill.runtime.model_executor.layers.fused_moe import SparseMoeBlock
from pagemill.runtime.model_executor.loader import load_model
from pagemill.runtime.moe_config import moe_spec
from pagemill.runtime.worker.model_runner import ModelRunner

GREEDY = dict(temperature=0.0, ignore_eos=True)

FAMILIES = {
    # Per-head q/k norms, renormalised top-k, one dense layer (mlp_only_layers).
    "qwen3_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        head_dim=32,
        num_hidden_layers=3,
        mlp_only_layers=[1],
    ),
    # q/k/v biases, a shared expert with its sigmoid gate, top-3 not renormalised, a dense
    # layer off the decoder_sparse_step grid.
    "qwen2_moe": dict(
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_hidden_layers=4,
        decoder_sparse_step=2,
    ),
    # block_sparse_moe.experts.{e}.w1/w3/w2, always renormalised.
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48),
    # Whole-projection q/k norms, top-2 of 8 not renormalised.
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, build_tiny_model) -> tuple[str, Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    model = build_tiny_model(folder, request.param, seed=3, **FAMILIES[request.param])
    return request.param, folder, model


def _check_against_hf(llm, model, prompts, max_tokens, hf_greedy) -> None:
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, m, out in zip(prompts, max_tokens, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, m), (
            f"prompt of {len(prompt)} tokens diverged"
        )


def test_config_reads_the_experts(family) -> None:
    name, folder, model = family
    config = ModelConfig.from_pretrained(folder)
    assert config.architecture == type(model).__name__
    spec = moe_spec(config.hf_config)
    assert spec is not None
    hf = model.config
    assert spec.num_experts == hf.num_experts and spec.top_k == hf.num_experts_per_tok
    sparse = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in model.model.layers]
    assert list(spec.sparse_layers) == sparse
    assert any(sparse) and (not all(sparse) or name in ("mixtral", "olmoe"))
    # The routers are random (not HF's zero init): routing is exercised, not a tie.
    routers = [layer.mlp.gate.weight for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    assert routers and all(float(w.detach().std()) > 0.05 for w in routers)


def test_prefill_logits_match_transformers(family, random_prompts, all_logits) -> None:
    _, folder, model = family
    config = ModelConfig.from_pretrained(folder)
    runner = ModelRunner(
        load_model(folder, config, torch.float32, torch.device("cpu"), 512),
        config,
        torch.device("cpu"),
        torch.float32,
        16,
        8,
        512,
        512,
    )
    runner.init_kv_cache(64)
    prompts = random_prompts([1, 9, 16, 40, 100], model.config.vocab_size, seed=11)
    for prompt, logits in zip(prompts, all_logits(runner, prompts)):
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_chunked_prefill_matches_hf(family, hf_greedy, random_prompts) -> None:
    _, folder, model = family
    prompts = random_prompts([70, 5, 33, 21], model.config.vocab_size, seed=4)
    llm = LLM(
        str(folder),
        dtype="float32",
        max_num_batched_tokens=16,
        max_num_seqs=3,
        kv_cache_memory_bytes=4 << 20,
    )
    _check_against_hf(llm, model, prompts, [12, 30, 8, 10], hf_greedy)


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral"])
def test_prefix_hits_match_hf(name, tmp_path, build_tiny_model, hf_greedy, random_prompts) -> None:
    model = build_tiny_model(tmp_path, name, seed=5, **FAMILIES[name])
    vocab = model.config.vocab_size
    prefix = random_prompts([48], vocab, seed=5)[0]
    prompts = [prefix + s for s in random_prompts([1, 9, 20], vocab, seed=6)]
    llm = LLM(
        str(tmp_path), dtype="float32", max_num_batched_tokens=64, kv_cache_memory_bytes=4 << 20
    )
    llm.generate([[*prefix, 7]], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    before = llm.llm_engine.get_stats().prefix_cache_hits
    _check_against_hf(llm, model, prompts, [8, 8, 8], hf_greedy)
    assert llm.llm_engine.get_stats().prefix_cache_hits - before >= 32 * len(prompts)


@pytest.mark.parametrize("name", ["qwen3_moe", "olmoe"])
def test_preemption_recomputes_exactly(
    name, tmp_path, build_tiny_model, hf_greedy, random_prompts
) -> None:
    model = build_tiny_model(tmp_path, name, seed=7, **FAMILIES[name])
    prompts = random_prompts([20, 33, 12, 40, 27], model.config.vocab_size, seed=7)
    probe = LLM(str(tmp_path), dtype="float32", kv_cache_memory_bytes=1 << 20)
    block_bytes = (1 << 20) // probe.llm_engine.num_blocks
    del probe
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        max_model_len=128,
        kv_cache_memory_bytes=9 * block_bytes,
        max_num_batched_tokens=64,
    )
    assert llm.llm_engine.num_blocks == 9
    _check_against_hf(llm, model, prompts, [30, 25, 40, 20, 28], hf_greedy)
    assert llm.llm_engine.get_stats().num_preemptions > 0


def _hf_block(name: str, **overrides):
    import transformers

    common = dict(
        vocab_size=64,
        hidden_size=48,
        intermediate_size=40,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.3,
    )
    common.update(overrides)
    if name == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(**common)
        block = transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock(config)
    else:
        config = transformers.MixtralConfig(**common)
        block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return config, block.eval()


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("qwen2_moe", dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
                           shared_expert_intermediate_size=32, norm_topk_prob=False)),
        ("qwen2_moe", dict(num_experts=6, num_experts_per_tok=4, moe_intermediate_size=24,
                           shared_expert_intermediate_size=32, norm_topk_prob=True)),
        ("mixtral", dict(num_local_experts=5, num_experts_per_tok=2)),
    ],
)  # fmt: skip
def test_block_matches_transformers_block(name, overrides) -> None:
    """The sparse block on transformers' block's weights, 37 tokens (every expert used)."""
    config, hf = _hf_block(name, **overrides)
    spec = moe_spec(config.to_dict())
    assert spec is not None
    ours = SparseMoeBlock(spec, config.hidden_size, torch.float32)
    with torch.no_grad():
        ours.gate.copy_(hf.gate.weight)
        ours.experts.w13_weight.copy_(hf.experts.gate_up_proj)
        ours.experts.w2_weight.copy_(hf.experts.down_proj)
        if ours.shared_expert is not None and ours.shared_expert_gate is not None:
            s = hf.shared_expert
            ours.shared_expert.gate_up_proj.load_rows(
                0, torch.cat([s.gate_proj.weight, s.up_proj.weight])
            )
            ours.shared_expert.down_proj.load_rows(0, s.down_proj.weight)
            ours.shared_expert_gate.copy_(hf.shared_expert_gate.weight)
    x = torch.randn(37, config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(x[None])
        ref = (ref[0] if isinstance(ref, tuple) else ref)[0]
        got = ours(x)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_block_compiles_without_graph_breaks() -> None:
    """The routed experts are one opaque op in a graph: fullgraph tracing succeeds, and the
    compiled block equals the eager one for a routing the trace never saw."""
    config, _ = _hf_block("mixtral", num_local_experts=5, num_experts_per_tok=2)
    spec = moe_spec(config.to_dict())
    assert spec is not None
    block = SparseMoeBlock(spec, config.hidden_size, torch.float32)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    compiled = torch.compile(block, backend="eager", fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(2)
    for t in (3, 17):
        x = torch.randn(t, config.hidden_size, generator=g)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), block(x))


def test_quantization_is_refused_not_ignored(tmp_path, build_tiny_model) -> None:
    build_tiny_model(tmp_path, "mixtral", seed=1, **FAMILIES["mixtral"])
    config = ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not supported for mixture-of-experts"):
        load_model(tmp_path, config, torch.float32, torch.device("cpu"), 512, quantization="int8")


@pytest.mark.slow
def test_compiled_step_matches_hf(tmp_path, build_tiny_model, hf_greedy, random_prompts) -> None:
    """The engine's compiled step (inductor) with the MoE op opaque in the graph: greedy
    tokens equal transformers' through chunked prefill and decode of mixed batches."""
    from pagemill.runtime.worker.compilation import (
        ENFORCE_EAGER_ENV,
        compile_unavailable_reason,
    )

    reason = compile_unavailable_reason(torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)
    model = build_tiny_model(tmp_path, "qwen2_moe", seed=2, **FAMILIES["qwen2_moe"])
    prompts = random_prompts([30, 7, 19], model.config.vocab_size, seed=8)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(ENFORCE_EAGER_ENV, raising=False)
        llm = LLM(
            str(tmp_path),
            dtype="float32",
            max_num_batched_tokens=16,
            max_num_seqs=3,
            kv_cache_memory_bytes=4 << 20,
        )
    assert llm.llm_engine.engine_core.model_runner.compiled
    _check_against_hf(llm, model, prompts, [10, 12, 6], hf_greedy)
