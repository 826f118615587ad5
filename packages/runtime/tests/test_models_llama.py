"""The Llama-family module computes what transformers computes, for every family it serves.

Logits at every position of a prompt (one flattened batch of several sequences, through
the paged KV cache) are compared with the transformers model on the same saved weights.
"""

from __future__ import annotations

import pytest
import torch

from pagemill.runtime.config import ModelConfig
from pagemill.runtime.model_executor.loader import load_model
from pagemill.runtime.worker.model_runner import ModelRunner

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

CASES = {
    "llama3-rope-tied": ("llama", dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True)),
    "llama-attention-bias": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "qwen2": ("qwen2", dict(num_key_value_heads=1)),
    "mistral-head-dim": ("mistral", dict(head_dim=32)),
}


def _runner_for(folder, dtype=torch.float32) -> ModelRunner:
    config = ModelConfig.from_pretrained(folder)
    model = load_model(folder, config, dtype, torch.device("cpu"), max_position=512)
    runner = ModelRunner(model, config, torch.device("cpu"), dtype, 16, 8, 512, 512)
    runner.init_kv_cache(64)
    return runner


def _hf_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_logits_match_transformers(
    case, tmp_path, build_tiny_model, random_prompts, all_logits
) -> None:
    arch, overrides = CASES[case]
    model = build_tiny_model(tmp_path, arch, **overrides)
    runner = _runner_for(tmp_path)
    # Long enough to pass original_max_position_embeddings, so llama3 scaling matters.
    prompts = random_prompts([1, 15, 16, 40, 100], model.config.vocab_size, seed=11)
    for prompt, got in zip(prompts, all_logits(runner, prompts)):
        torch.testing.assert_close(got, _hf_logits(model, prompt), rtol=1e-4, atol=1e-4)


def test_fused_weights_hold_the_separate_projections(tmp_path, build_tiny_model) -> None:
    model = build_tiny_model(tmp_path, "qwen2")
    runner = _runner_for(tmp_path)
    attn = runner.model.layers[1].self_attn
    hf_attn = model.model.layers[1].self_attn
    q, kv = attn.q_size, attn.kv_size
    torch.testing.assert_close(
        attn.qkv_proj.weight[q + kv :], hf_attn.v_proj.weight, rtol=0, atol=0
    )
    torch.testing.assert_close(attn.qkv_proj.bias[q : q + kv], hf_attn.k_proj.bias, rtol=0, atol=0)
    assert attn.o_proj.bias is None  # Qwen2 has q/k/v biases only
    mlp, hf_mlp = runner.model.layers[0].mlp, model.model.layers[0].mlp
    torch.testing.assert_close(
        mlp.gate_up_proj.weight[hf_mlp.up_proj.weight.shape[0] :], hf_mlp.up_proj.weight
    )


def test_tied_embeddings_share_one_tensor(tmp_path, build_tiny_model) -> None:
    build_tiny_model(tmp_path, "llama", tie_word_embeddings=True)
    runner = _runner_for(tmp_path)
    assert runner.model.lm_head is None
    assert runner.model.lm_head_weight.data_ptr() == runner.model.embed_tokens.data_ptr()


def test_bf16_forward_stays_close(tmp_path, build_tiny_model, random_prompts, all_logits) -> None:
    model = build_tiny_model(tmp_path, "llama")
    runner = _runner_for(tmp_path, torch.bfloat16)
    assert runner.kv_cache is not None and runner.kv_cache.caches[0][0].dtype == torch.bfloat16
    prompt = random_prompts([30], model.config.vocab_size, seed=12)[0]
    [got] = all_logits(runner, [prompt])
    assert got.dtype == torch.bfloat16
    # Same weights run by transformers in bf16: only rounding-order differences remain.
    ref = _hf_logits(model.to(torch.bfloat16), prompt)
    scale = ref.float().abs().max()
    assert (got.float() - ref.float()).abs().max() <= 0.02 * scale
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_profiling_batch_runs_at_the_limits(tiny_llama) -> None:
    """The dummy step used to size the KV pool on CUDA is a valid batch at the limits."""
    folder, _ = tiny_llama
    config = ModelConfig.from_pretrained(folder)
    model = load_model(folder, config, torch.float32, torch.device("cpu"), max_position=512)
    runner = ModelRunner(model, config, torch.device("cpu"), torch.float32, 16, 8, 300, 100)
    batch, blocks = runner.dummy_batch()
    assert batch.total_num_scheduled_tokens == 300 == sum(s.num_tokens for s in batch.scheduled)
    assert len(batch.scheduled) == 8 and max(s.num_tokens for s in batch.scheduled) <= 100
    runner.init_kv_cache(blocks)
    out = runner.execute_model(batch)
    assert out.logits.shape == (8, config.vocab_size) and torch.isfinite(out.logits).all()


def test_packed_int32_inputs_give_the_same_logits(tiny_qwen2, random_prompts, all_logits) -> None:
    """The single-copy int32 packing used on CUDA is exercised here on CPU."""
    folder, model = tiny_qwen2
    runner = _runner_for(folder)
    prompts = random_prompts([3, 20, 37], model.config.vocab_size, seed=13)
    plain = all_logits(runner, prompts)
    runner.pack_inputs = True
    for _ in range(2):  # the second round reuses the staging buffer
        packed = all_logits(runner, prompts)
        for a, b in zip(plain, packed):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert runner._staging is not None and runner._staging.dtype == torch.int32


def test_profiling_batch_respects_max_num_seqs(tiny_llama) -> None:
    folder, _ = tiny_llama
    config = ModelConfig.from_pretrained(folder)
    model = load_model(folder, config, torch.float32, torch.device("cpu"), max_position=512)
    runner = ModelRunner(model, config, torch.device("cpu"), torch.float32, 16, 2, 2048, 100)
    batch, _ = runner.dummy_batch()
    assert len(batch.scheduled) == 2 and batch.total_num_scheduled_tokens == 200
