"""gpt-oss (``GptOssForCausalLM``) equals transformers.

A tiny random model built by transformers, fp32, eager attention: attention sinks, layers
alternating an 8-key sliding window with full attention, YaRN RoPE, q/k/v/o biases, the
router's bias and top-k-then-softmax, expert biases and a clamp limit low enough that the
clamped SwiGLU clamps. Logits at every prompt position through the paged cache; greedy
generation through the engine with chunked prefill, prefix-cache hits and preemption,
against `generate`; the MoE block alone against transformers' on the same weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagemill.runtime import LLM, SamplingParams
from pagemill.runtime.config import ModelConfig
from pagemill.runtime.model_executor.loader import load_model
from pagemill.runtime.model_executor.models.gpt_oss import GptOssMoeBlock, stacked_experts
from pagemill.runtime.moe_config import moe_spec
from pagemill.runtime.worker.model_runner import ModelRunner

GREEDY = dict(temperature=0.0, ignore_eos=True)

CONFIG = dict(
    num_hidden_layers=4,
    head_dim=16,
    intermediate_size=32,
    num_local_experts=6,
    num_experts_per_tok=2,
    sliding_window=8,
    swiglu_limit=1.0,
    attention_bias=True,
    attn_implementation="eager",
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=150000.0,
        factor=4.0,
        original_max_position_embeddings=128,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
    ),
)


def build(folder: Path, build_tiny_model, seed: int) -> torch.nn.Module:
    """The tiny model with the parameters transformers initialises to zero (expert biases)
    or small (sinks, router bias) drawn at a scale where getting them wrong shows."""
    model = build_tiny_model(folder, "gpt_oss", seed=seed, **CONFIG)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=g))
            layer.mlp.router.bias.copy_(torch.randn(layer.mlp.router.bias.shape, generator=g))
            for p in (layer.mlp.experts.gate_up_proj_bias, layer.mlp.experts.down_proj_bias):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            for p in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(str(folder))
    return model


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory, build_tiny_model) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("tiny-gpt-oss")
    return folder, build(folder, build_tiny_model, seed=3)


def _check_against_hf(llm, model, prompts, max_tokens, hf_greedy) -> None:
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, m, out in zip(prompts, max_tokens, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, m), (
            f"prompt of {len(prompt)} tokens diverged"
        )


def test_config_reads_gpt_oss(gpt_oss) -> None:
    folder, _ = gpt_oss
    config = ModelConfig.from_pretrained(folder)
    assert config.architecture == "GptOssForCausalLM"
    assert [config.layer_window(i) for i in range(4)] == [8, 0, 8, 0]
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "yarn"
    assert config.attention_bias and config.o_proj_bias
    spec = moe_spec(config.hf_config)
    assert spec is not None and (spec.num_experts, spec.top_k) == (6, 2)
    assert spec.intermediate_size == 32 and all(spec.sparse_layers)


def test_config_without_layer_types_alternates_as_transformers() -> None:
    import transformers

    raw = dict(
        architectures=["GptOssForCausalLM"],
        model_type="gpt_oss",
        vocab_size=8,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=128,
    )
    config = ModelConfig.from_dict(raw)
    assert config.layer_types == transformers.GptOssConfig(**raw).layer_types


def test_prefill_logits_match_transformers(gpt_oss, random_prompts, all_logits) -> None:
    folder, model = gpt_oss
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


def test_chunked_prefill_matches_hf(gpt_oss, hf_greedy, random_prompts) -> None:
    folder, model = gpt_oss
    prompts = random_prompts([70, 5, 33, 21], model.config.vocab_size, seed=4)
    llm = LLM(
        str(folder),
        dtype="float32",
        max_num_batched_tokens=16,
        max_num_seqs=3,
        kv_cache_memory_bytes=4 << 20,
    )
    _check_against_hf(llm, model, prompts, [12, 30, 8, 10], hf_greedy)


def test_prefix_hits_match_hf(gpt_oss, hf_greedy, random_prompts) -> None:
    folder, model = gpt_oss
    vocab = model.config.vocab_size
    prefix = random_prompts([48], vocab, seed=5)[0]
    prompts = [prefix + s for s in random_prompts([1, 9, 20], vocab, seed=6)]
    llm = LLM(
        str(folder), dtype="float32", max_num_batched_tokens=64, kv_cache_memory_bytes=4 << 20
    )
    llm.generate([[*prefix, 7]], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    before = llm.llm_engine.get_stats().prefix_cache_hits
    _check_against_hf(llm, model, prompts, [8, 8, 8], hf_greedy)
    assert llm.llm_engine.get_stats().prefix_cache_hits - before >= 32 * len(prompts)


def test_preemption_recomputes_exactly(gpt_oss, hf_greedy, random_prompts) -> None:
    folder, model = gpt_oss
    prompts = random_prompts([20, 33, 12, 40, 27], model.config.vocab_size, seed=7)
    probe = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=1 << 20)
    block_bytes = (1 << 20) // probe.llm_engine.num_blocks
    del probe
    llm = LLM(
        str(folder),
        dtype="float32",
        max_model_len=128,
        kv_cache_memory_bytes=11 * block_bytes,
        max_num_batched_tokens=64,
    )
    # The windowed and full layers are separate KV cache groups (one block table each over
    # one pool): one 128-token request needs the full group's 8 blocks, the windowed
    # group's last window and the null block.
    assert llm.llm_engine.num_blocks == 11
    _check_against_hf(llm, model, prompts, [30, 25, 40, 20, 28], hf_greedy)
    assert llm.llm_engine.get_stats().num_preemptions > 0


def test_block_matches_transformers_block(gpt_oss) -> None:
    """The MoE block on transformers' block's weights (loaded through the checkpoint-layout
    conversion), 37 tokens large enough that the clamp, biases and every expert matter."""
    folder, model = gpt_oss
    config = ModelConfig.from_pretrained(folder)
    hf = model.model.layers[1].mlp
    ours = GptOssMoeBlock(config, torch.float32)
    tensors = {
        "router.weight": hf.router.weight,
        "router.bias": hf.router.bias,
        **{f"experts.{n}": getattr(hf.experts, n) for n in (
            "gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")},
    }  # fmt: skip
    prefixed = ((f"model.layers.1.mlp.{n}", t.detach()) for n, t in tensors.items())
    got_tensors = dict(stacked_experts(prefixed))
    e = ours.experts
    assert e.w13_bias is not None and e.w2_bias is not None
    with torch.no_grad():
        ours.router_weight.copy_(got_tensors["model.layers.1.mlp.router.weight"])
        ours.router_bias.copy_(got_tensors["model.layers.1.mlp.router.bias"])
        e.w13_weight.copy_(got_tensors["model.layers.1.mlp.experts.gate_up_proj"])
        e.w13_bias.copy_(got_tensors["model.layers.1.mlp.experts.gate_up_proj_bias"])
        e.w2_weight.copy_(got_tensors["model.layers.1.mlp.experts.down_proj"])
        e.w2_bias.copy_(got_tensors["model.layers.1.mlp.experts.down_proj_bias"])
    x = torch.randn(37, config.hidden_size, generator=torch.Generator().manual_seed(1)) * 2
    with torch.no_grad():
        ref = hf(x[None])[0][0]
        got = ours(x)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_quantization_is_refused_not_ignored(gpt_oss) -> None:
    folder, _ = gpt_oss
    config = ModelConfig.from_pretrained(folder)
    with pytest.raises(ValueError, match="not supported for mixture-of-experts"):
        load_model(folder, config, torch.float32, torch.device("cpu"), 512, quantization="int4")


class _TwoRanks:
    """The sizes of a 2-rank group, without the processes: each rank's partial sum is
    returned as is, and the test adds them up as the all-reduce would."""

    world_size = 2

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t


def test_block_shards_sum_to_the_whole(gpt_oss) -> None:
    """Tensor parallelism's cut of the stacked experts (interleaved gate/up pairs, the down
    bias on rank 0 only): the two ranks' partial sums add up to the unsplit block."""
    from pagemill.runtime.distributed import ShardLayout

    folder, model = gpt_oss
    config = ModelConfig.from_pretrained(folder)
    hf = model.model.layers[0].mlp
    names = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    full = {
        "model.layers.0.mlp.router.weight": hf.router.weight.detach(),
        "model.layers.0.mlp.router.bias": hf.router.bias.detach(),
        **{f"model.layers.0.mlp.experts.{n}": getattr(hf.experts, n).detach() for n in names},
    }
    x = torch.randn(23, config.hidden_size, generator=torch.Generator().manual_seed(4)) * 2

    def block(tp, tensors) -> torch.Tensor:
        b = GptOssMoeBlock(config, torch.float32, tp)
        got = dict(stacked_experts(tensors.items()))
        e = b.experts
        assert e.w13_bias is not None and e.w2_bias is not None
        with torch.no_grad():
            p = "model.layers.0.mlp."
            b.router_weight.copy_(got[p + "router.weight"])
            b.router_bias.copy_(got[p + "router.bias"])
            e.w13_weight.copy_(got[p + "experts.gate_up_proj"])
            e.w13_bias.copy_(got[p + "experts.gate_up_proj_bias"])
            e.w2_weight.copy_(got[p + "experts.down_proj"])
            e.w2_bias.copy_(got[p + "experts.down_proj_bias"])
            return b(x)

    whole = block(None, full)
    parts = []
    for rank in range(2):
        layout = ShardLayout.create(config, 2, rank)
        parts.append(block(_TwoRanks(), {n: layout.shard(n, t) for n, t in full.items()}))
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-5, atol=1e-5)
    sinks = model.model.layers[0].self_attn.sinks.detach()
    name = "model.layers.0.self_attn.sinks"
    cut = [ShardLayout.create(config, 2, r).shard(name, sinks) for r in range(2)]
    assert torch.equal(torch.cat(cut), sinks) and cut[0].shape == (2,)


@pytest.mark.slow
def test_tp2_equals_tp1(gpt_oss, random_prompts) -> None:
    """Two ranks (gloo): experts split by intermediate size, sinks with their heads."""
    folder, model = gpt_oss
    vocab = model.config.vocab_size
    prompts = random_prompts([70, 9, 40, 23], vocab, seed=12)
    max_tokens = [20, 30, 12, 25]
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens]

    def run(tp: int) -> list[list[int]]:
        llm = LLM(
            str(folder),
            tensor_parallel_size=tp,
            dtype="float32",
            max_model_len=160,
            max_num_batched_tokens=32,
            kv_cache_memory_bytes=4 << 20,
        )
        try:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.shutdown()

    assert run(2) == run(1)


@pytest.mark.slow
def test_compiled_step_matches_hf(gpt_oss, hf_greedy, random_prompts) -> None:
    """The engine's compiled step (inductor): the sinks pass through the attention op and
    the biases and activation through the MoE op, both opaque in the graph."""
    from pagemill.runtime.worker.compilation import (
        ENFORCE_EAGER_ENV,
        compile_unavailable_reason,
    )

    reason = compile_unavailable_reason(torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)
    folder, model = gpt_oss
    prompts = random_prompts([30, 7, 19], model.config.vocab_size, seed=8)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(ENFORCE_EAGER_ENV, raising=False)
        llm = LLM(
            str(folder),
            dtype="float32",
            max_num_batched_tokens=16,
            max_num_seqs=3,
            kv_cache_memory_bytes=4 << 20,
        )
    assert llm.llm_engine.engine_core.model_runner.compiled
    _check_against_hf(llm, model, prompts, [10, 12, 6], hf_greedy)
