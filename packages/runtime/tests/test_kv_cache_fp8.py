"""An fp8 KV cache (`kv_cache_dtype`): the pool holds twice the tokens of a 16-bit cache in
the same bytes, and a tiny random Llama's greedy output and logits stay close to those of
the same model with a compute-dtype cache (close, not equal: fp8 rounds K and V)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pagemill.blockpool import CacheConfig
from pagemill.runtime import LLM, SamplingParams
from pagemill.runtime.worker.kv_cache import KVCache, cpu_num_blocks

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _config() -> Any:
    """What the pool's sizing and layout read of a model config."""
    return SimpleNamespace(num_hidden_layers=3, num_key_value_heads=2, head_dim=32)


@pytest.mark.parametrize("kv", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_pool_holds_twice_the_blocks(kv: str) -> None:
    config = _config()
    budget = 3 << 20
    n16 = cpu_num_blocks(config, torch.bfloat16, 16, budget, 8, 512)
    n8 = cpu_num_blocks(config, torch.bfloat16, 16, budget, 8, 512, kv)
    assert n8 == 2 * n16
    pool16 = KVCache(config, n16, 16, torch.bfloat16, torch.device("cpu"))
    pool8 = KVCache(config, n8, 16, torch.bfloat16, torch.device("cpu"), kv)
    assert pool8.nbytes == pool16.nbytes <= budget
    want = torch.float8_e5m2 if kv == "fp8_e5m2" else torch.float8_e4m3fn
    assert all(k.dtype == want and v.dtype == want for k, v in pool8.caches)
    assert pool8.caches[0][0].shape[0] == n8


def test_calculate_kv_scales_needs_fp8() -> None:
    with pytest.raises(ValueError, match="calculate_kv_scales"):
        CacheConfig(calculate_kv_scales=True)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="int4")


def _greedy(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, **GREEDY), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_logits_equal_fake_quantized_reference(
    tiny_llama, random_prompts, all_logits, monkeypatch, kv: str
) -> None:
    """The engine with an fp8 cache computes what the same engine with a float cache
    computes when K and V are first rounded through torch's own float8 cast: the rounding
    is the only difference (the fp8 storage, scales and kernels add none)."""
    import pagemill.runtime.model_executor.models.llama as llama

    folder, model = tiny_llama
    fp8 = torch.float8_e5m2 if kv == "fp8_e5m2" else torch.float8_e4m3fn
    prompts = random_prompts([3, 17, 45, 70], model.config.vocab_size, seed=13)
    common = dict(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=2 << 20)
    ours = all_logits(
        LLM(str(folder), kv_cache_dtype=kv, **common).llm_engine.engine_core.model_runner, prompts
    )
    write = llama.write_kv_cache

    def rounded(k, v, kc, vc, slots, ks=None, vs=None):  # type: ignore[no-untyped-def]
        write(k.to(fp8).float(), v.to(fp8).float(), kc, vc, slots)

    monkeypatch.setattr(llama, "write_kv_cache", rounded)
    ref = all_logits(LLM(str(folder), **common).llm_engine.engine_core.model_runner, prompts)
    for got, want in zip(ours, ref):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_greedy_and_logits_close_to_compute_dtype_cache(
    tiny_llama, random_prompts, all_logits
) -> None:
    """Greedy agreement with the float cache over many prompts, and the logit error. The
    tiny random model is far more sensitive to K/V rounding than a trained one (its
    attention is sharp and its logits close), so the bounds are loose, set from a
    measurement with room."""
    folder, model = tiny_llama
    vocab = model.config.vocab_size
    prompts = random_prompts([3, 9, 17, 30, 45, 64, 8, 21, 50, 12, 33, 70], vocab, seed=11)
    common = dict(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=2 << 20)
    ref = LLM(str(folder), **common)
    fp8 = LLM(str(folder), kv_cache_dtype="fp8", **common)
    ref_runner = ref.llm_engine.engine_core.model_runner
    fp8_runner = fp8.llm_engine.engine_core.model_runner
    errs, top1 = [], []
    for want, got in zip(all_logits(ref_runner, prompts), all_logits(fp8_runner, prompts)):
        errs.append(((got - want).abs().max() / want.abs().max()).item())
        top1.append((got.argmax(-1) == want.argmax(-1)).float().mean().item())
    a, b = _greedy(ref, prompts, 16), _greedy(fp8, prompts, 16)
    agree = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb)) / (16 * len(prompts))
    first = sum(ra[0] == rb[0] for ra, rb in zip(a, b)) / len(prompts)
    print(
        f"max rel logit err {max(errs):.4f}, prefill top-1 {sum(top1) / len(top1):.3f}, "
        f"greedy token agreement {agree:.3f}, first token {first:.3f}"
    )
    assert 0 < max(errs) < 0.6
    assert sum(top1) / len(top1) > 0.7
    assert first >= 0.75 and agree >= 0.15


def test_calculate_kv_scales_from_first_prefill(tiny_llama, random_prompts) -> None:
    folder, model = tiny_llama
    prompts = random_prompts([20, 35], model.config.vocab_size, seed=12)
    llm = LLM(
        str(folder),
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=2 << 20,
        kv_cache_dtype="fp8",
        calculate_kv_scales=True,
    )
    runner = llm.llm_engine.engine_core.model_runner
    assert runner.kv_cache.scales_pending
    assert all(float(s.k_scale) == 1.0 for s in runner.kv_cache.scales)
    _greedy(llm, prompts, 4)
    assert not runner.kv_cache.scales_pending
    scales = [(float(s.k_scale), float(s.v_scale)) for s in runner.kv_cache.scales]
    assert all(k != 1.0 and v != 1.0 and k > 0 and v > 0 for k, v in scales)
    # Later steps keep them (set once, from the first prefill).
    _greedy(llm, prompts, 4)
    assert [(float(s.k_scale), float(s.v_scale)) for s in runner.kv_cache.scales] == scales


@pytest.mark.slow
def test_compiled_step_with_fp8_cache_equals_eager(tiny_llama, random_prompts, monkeypatch) -> None:
    """The compiled step passes the scales through the custom ops: same tokens as eager,
    with scales calculated (not 1.0) so a dropped scale would show."""
    from pagemill.runtime.worker.compilation import ENFORCE_EAGER_ENV, compile_unavailable_reason

    if compile_unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip("torch.compile unavailable here")
    monkeypatch.delenv(ENFORCE_EAGER_ENV, raising=False)
    folder, model = tiny_llama
    prompts = random_prompts([5, 30, 61], model.config.vocab_size, seed=14)
    common = dict(
        dtype="float32",
        kv_cache_memory_bytes=1 << 20,
        max_model_len=128,
        kv_cache_dtype="fp8",
        calculate_kv_scales=True,
    )
    compiled = LLM(str(folder), **common)
    assert compiled.llm_engine.engine_core.model_runner.compiled
    eager = LLM(str(folder), enforce_eager=True, **common)
    a, b = _greedy(compiled, prompts, 12), _greedy(eager, prompts, 12)
    scales = compiled.llm_engine.engine_core.model_runner.kv_cache.scales
    assert all(float(s.k_scale) != 1.0 for s in scales)
    assert a == b
