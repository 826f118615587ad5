"""An int8 KV cache (``--kv-cache-dtype int8 --calculate-kv-scales``): the pool holds twice
the tokens of a 16-bit cache, and the engine computes exactly what the same engine with a
float cache computes when K and V are first rounded to ``round(x / scale) * scale`` (codes
clamped to +-127) with the scales the int8 engine calculated."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pagemill.blockpool import CacheConfig
from pagemill.runtime import LLM, SamplingParams
from pagemill.runtime.worker.kv_cache import KVCache, cpu_num_blocks

GREEDY = dict(temperature=0.0, ignore_eos=True)
COMMON = dict(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=2 << 20)


def test_pool_holds_twice_the_blocks() -> None:
    config = SimpleNamespace(num_hidden_layers=3, num_key_value_heads=2, head_dim=32)
    budget = 3 << 20
    n16 = cpu_num_blocks(config, torch.bfloat16, 16, budget, 8, 512)
    n8 = cpu_num_blocks(config, torch.bfloat16, 16, budget, 8, 512, "int8")
    assert n8 == 2 * n16
    pool16 = KVCache(config, n16, 16, torch.bfloat16, torch.device("cpu"))
    pool8 = KVCache(config, n8, 16, torch.bfloat16, torch.device("cpu"), "int8")
    assert pool8.nbytes == pool16.nbytes <= budget
    assert all(k.dtype == torch.int8 and v.dtype == torch.int8 for k, v in pool8.caches)
    assert pool8.caches[0][0].shape[0] == n8


def test_int8_needs_calculated_scales() -> None:
    with pytest.raises(ValueError, match="calculate_kv_scales"):
        CacheConfig(kv_cache_dtype="int8")
    assert CacheConfig(kv_cache_dtype="int8", calculate_kv_scales=True).kv_cache_dtype == "int8"


def _fake_quant_writes(llama: Any, runner: Any, scales: list[tuple[float, float]]) -> Any:
    """A write_kv_cache for a float-cache engine that first rounds K/V as int8 codes with
    each layer's (k, v) scale: written here from the definition, not kv_quant's code."""
    write = llama.write_kv_cache
    layer_of = {kc.data_ptr(): i for i, (kc, _) in enumerate(runner.kv_cache.caches)}

    def rounded(k, v, kc, vc, slots, ks=None, vs=None):  # type: ignore[no-untyped-def]
        sk, sv = scales[layer_of[kc.data_ptr()]]
        kq = torch.round(k.double() / sk).clamp(-127, 127) * sk
        vq = torch.round(v.double() / sv).clamp(-127, 127) * sv
        write(kq.to(k.dtype), vq.to(v.dtype), kc, vc, slots)

    return rounded


def test_logits_equal_fake_quantized_reference(
    tiny_llama, random_prompts, all_logits, monkeypatch
) -> None:
    import pagemill.runtime.model_executor.models.llama as llama

    folder, model = tiny_llama
    prompts = random_prompts([3, 17, 45, 70], model.config.vocab_size, seed=13)
    q = LLM(str(folder), kv_cache_dtype="int8", calculate_kv_scales=True, **COMMON)
    runner = q.llm_engine.engine_core.model_runner
    ours = all_logits(runner, prompts)  # its first forward sets the scales
    scales = [(float(s.k_scale), float(s.v_scale)) for s in runner.kv_cache.scales]
    assert all(k != 1.0 and v != 1.0 for k, v in scales)
    ref_llm = LLM(str(folder), **COMMON)
    ref_runner = ref_llm.llm_engine.engine_core.model_runner
    monkeypatch.setattr(llama, "write_kv_cache", _fake_quant_writes(llama, ref_runner, scales))
    ref = all_logits(ref_runner, prompts)
    for got, want in zip(ours, ref):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_greedy_close_to_compute_dtype_cache(tiny_llama, random_prompts, all_logits) -> None:
    """Greedy agreement with the float cache over many prompts: bounds as loose as the fp8
    test's (the tiny random model is very sensitive to K/V rounding)."""
    folder, model = tiny_llama
    vocab = model.config.vocab_size
    prompts = random_prompts([3, 9, 17, 30, 45, 64, 8, 21, 50, 12, 33, 70], vocab, seed=11)
    ref = LLM(str(folder), **COMMON)
    q = LLM(str(folder), kv_cache_dtype="int8", calculate_kv_scales=True, **COMMON)
    params = SamplingParams(max_tokens=16, **GREEDY)
    a = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in q.generate(prompts, params, use_tqdm=False)]
    agree = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb)) / (16 * len(prompts))
    first = sum(ra[0] == rb[0] for ra, rb in zip(a, b)) / len(prompts)
    print(f"greedy token agreement {agree:.3f}, first token {first:.3f}")
    assert first >= 0.75 and agree >= 0.15
