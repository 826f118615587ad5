"""Per-KV-head K/V cache scales in the engine: from a checkpoint whose scales are
[num_kv_heads] (llm-compressor's ``strategy: "attn_head"``), or calculated per head from the
first prefill (``kv_scales_per_head``). The engine's logits equal those of a float-cache
engine whose K/V are first rounded head by head, as the definition says, with the same
scales (written here from the definition, not kv_quant's code)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagemill.blockpool import CacheConfig
from pagemill.runtime import LLM
from pagemill.runtime.model_executor.kv_scales import read_kv_scales

COMMON = dict(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=2 << 20)
# [layer][kv head]: far apart between the two heads, not powers of two.
K_SCALES = [[0.0173, 0.00291], [0.0041, 0.0219]]
V_SCALES = [[0.0017, 0.0233], [0.0311, 0.0027]]


def _tensors(shape_tail: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    out = {}
    for i, (k, v) in enumerate(zip(K_SCALES, V_SCALES)):
        out[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k).reshape(2, *shape_tail)
        out[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v).reshape(2, *shape_tail)
    return out


def _f32(values: list[list[float]]) -> list[list[float]]:
    return [torch.tensor(v).tolist() for v in values]


@pytest.mark.parametrize("tail", [(), (1, 1)])
def test_read_per_head(tmp_path: Path, tail: tuple[int, ...]) -> None:
    save_file(_tensors(tail), tmp_path / "model.safetensors")
    got = read_kv_scales(tmp_path, 2, num_kv_heads=2)
    assert got is not None and got.per_head
    assert (got.k, got.v) == (_f32(K_SCALES), _f32(V_SCALES))


@pytest.mark.parametrize("shape", [(2, 8), (4,), (1, 2)])
def test_other_shapes_refused_by_name(tmp_path: Path, shape: tuple[int, ...]) -> None:
    save_file(
        {"model.layers.1.self_attn.v_scale": torch.full(shape, 0.5)},
        tmp_path / "model.safetensors",
    )
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.v_scale has shape"):
        read_kv_scales(tmp_path, 2, num_kv_heads=2)


def test_per_head_needs_a_quantized_cache() -> None:
    with pytest.raises(ValueError, match="kv_scales_per_head needs an fp8 or int8"):
        CacheConfig(kv_scales_per_head=True)


def _rounded_writes(llama: Any, runner: Any, scales: list[tuple[list, list]], int8: bool) -> Any:
    """Float-cache writes of K/V first rounded per head as the 8-bit cache stores them."""
    write = llama.write_kv_cache
    layer_of = {kc.data_ptr(): i for i, (kc, _) in enumerate(runner.kv_cache.caches)}
    m = torch.finfo(torch.float8_e4m3fn).max

    def rounded(k, v, kc, vc, slots, ks=None, vs=None):  # type: ignore[no-untyped-def]
        sk, sv = (
            torch.tensor(s, dtype=torch.float64)[:, None] for s in scales[layer_of[kc.data_ptr()]]
        )
        if int8:
            kq = torch.round(k.double() / sk).clamp(-127, 127) * sk
            vq = torch.round(v.double() / sv).clamp(-127, 127) * sv
        else:
            kq = (k.double() / sk).clamp(-m, m).float().to(torch.float8_e4m3fn).double() * sk
            vq = (v.double() / sv).clamp(-m, m).float().to(torch.float8_e4m3fn).double() * sv
        write(kq.to(k.dtype), vq.to(v.dtype), kc, vc, slots)

    return rounded


def _with_scales(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    weights.update(tensors)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_fp8_engine_uses_per_head_checkpoint_scales(
    tiny_llama, tmp_path: Path, random_prompts, all_logits, monkeypatch
) -> None:
    import pagemill.runtime.model_executor.models.llama as llama

    src, model = tiny_llama
    folder = _with_scales(src, tmp_path / "m", _tensors())
    runner = LLM(str(folder), kv_cache_dtype="fp8", **COMMON).llm_engine.engine_core.model_runner
    got = [(s.k_scale.tolist(), s.v_scale.tolist()) for s in runner.kv_cache.scales]
    assert got == list(zip(_f32(K_SCALES), _f32(V_SCALES)))
    prompts = random_prompts([3, 17, 45, 70], model.config.vocab_size, seed=13)
    ours = all_logits(runner, prompts)
    ref_runner = LLM(str(folder), **COMMON).llm_engine.engine_core.model_runner
    scales = list(zip(_f32(K_SCALES), _f32(V_SCALES)))
    monkeypatch.setattr(llama, "write_kv_cache", _rounded_writes(llama, ref_runner, scales, False))
    ref = all_logits(ref_runner, prompts)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_int8_scales_calculated_per_head(
    build_tiny_model, tmp_path: Path, random_prompts, all_logits, monkeypatch
) -> None:
    """Each head's scale is its own amax / 127 over the first prefill (the per-layer scale
    is the largest of them), and the logits equal the per-head rounded reference. One
    layer: past the first, K/V would differ from the reference's in the last bits (fp32
    sums in another order), and a value on a rounding boundary takes the next int8 code."""
    import pagemill.runtime.model_executor.models.llama as llama

    folder = tmp_path / "one-layer"
    model = build_tiny_model(folder, "llama", num_hidden_layers=1)
    prompts = random_prompts([3, 17, 45, 70], model.config.vocab_size, seed=13)
    kw = dict(kv_cache_dtype="int8", calculate_kv_scales=True, **COMMON)
    per_layer = LLM(str(folder), **kw).llm_engine.engine_core.model_runner
    all_logits(per_layer, prompts)  # the same first forward
    runner = LLM(str(folder), kv_scales_per_head=True, **kw).llm_engine.engine_core.model_runner
    ours = all_logits(runner, prompts)  # its first forward sets the scales
    scales = [(s.k_scale.tolist(), s.v_scale.tolist()) for s in runner.kv_cache.scales]
    (k, v), layer = scales[0], per_layer.kv_cache.scales[0]
    assert len(k) == len(v) == 2 and len(set(k)) == 2
    assert max(k) == float(layer.k_scale) and max(v) == float(layer.v_scale)
    ref_runner = LLM(str(folder), **COMMON).llm_engine.engine_core.model_runner
    monkeypatch.setattr(llama, "write_kv_cache", _rounded_writes(llama, ref_runner, scales, True))
    ref = all_logits(ref_runner, prompts)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
