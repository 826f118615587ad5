"""K/V cache scales read from a checkpoint (vLLM's spellings of fp8 checkpoints' k_scale /
v_scale): an fp8 cache gets exactly the written scales, and the engine then computes what a
float-cache engine computes when K/V are first rounded through torch's float8 cast with
those scales. A float cache, or calculated scales, leave them unused with a log line; a
scale that is neither one value per layer nor one per KV head is refused by name."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagemill.runtime import LLM
from pagemill.runtime.model_executor.kv_scales import read_kv_scales

COMMON = dict(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=2 << 20)
# Distinct per layer and per K/V, not powers of two, so a mix-up or a dropped scale shows.
K_SCALES = [0.0173, 0.0291]
V_SCALES = [0.0117, 0.0233]

LAYOUTS = {
    "llm-compressor": ("self_attn.k_scale", "self_attn.v_scale"),
    "vllm": ("self_attn.attn.k_scale", "self_attn.attn.v_scale"),
    "modelopt": ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"),
    "compressed-tensors": ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
}


def _scale_tensors(layout: str, shape: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    kname, vname = LAYOUTS[layout]
    out = {}
    for i, (k, v) in enumerate(zip(K_SCALES, V_SCALES)):
        out[f"model.layers.{i}.{kname}"] = torch.full(shape, k, dtype=torch.float32)
        out[f"model.layers.{i}.{vname}"] = torch.full(shape, v, dtype=torch.float32)
    return out


def _with_scales(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A copy of the tiny checkpoint whose model.safetensors also holds `tensors`."""
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    weights.update(tensors)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_read_each_layout(tmp_path: Path, layout: str) -> None:
    save_file(_scale_tensors(layout), tmp_path / "model.safetensors")
    got = read_kv_scales(tmp_path, 2)
    assert got is not None
    assert got.k == [torch.tensor(s).item() for s in K_SCALES]
    assert got.v == [torch.tensor(s).item() for s in V_SCALES]


def test_legacy_kv_scale_serves_k_and_v(tmp_path: Path) -> None:
    save_file(
        {
            "model.layers.0.self_attn.kv_scale": torch.tensor(0.5),
            "model.layers.1.self_attn.kv_scale": torch.tensor([0.25]),
            "model.layers.1.self_attn.v_scale": torch.tensor(0.125),  # its own wins
        },
        tmp_path / "model.safetensors",
    )
    got = read_kv_scales(tmp_path, 2)
    assert got is not None and (got.k, got.v) == ([0.5, 0.25], [0.5, 0.125])


def test_no_scales(tmp_path: Path) -> None:
    save_file(
        {"model.layers.0.self_attn.q_proj.weight": torch.ones(2, 2)}, tmp_path / "a.safetensors"
    )
    assert read_kv_scales(tmp_path, 2) is None


def _fp8_reference_writes(llama: Any, runner: Any) -> Any:
    """Float-cache writes that first round K/V as an fp8 cache with the checkpoint's scales
    would store them (torch's own saturating float8 cast), then widen them back."""
    write = llama.write_kv_cache
    layer_of = {kc.data_ptr(): i for i, (kc, _) in enumerate(runner.kv_cache.caches)}
    m = torch.finfo(torch.float8_e4m3fn).max

    def rounded(k, v, kc, vc, slots, ks=None, vs=None):  # type: ignore[no-untyped-def]
        i = layer_of[kc.data_ptr()]
        sk, sv = torch.tensor(K_SCALES[i]), torch.tensor(V_SCALES[i])
        kq = (k.float() / sk).clamp(-m, m).to(torch.float8_e4m3fn).float() * sk
        vq = (v.float() / sv).clamp(-m, m).to(torch.float8_e4m3fn).float() * sv
        write(kq, vq, kc, vc, slots)

    return rounded


def test_fp8_engine_uses_checkpoint_scales(
    tiny_llama, tmp_path: Path, random_prompts, all_logits, monkeypatch
) -> None:
    import pagemill.runtime.model_executor.models.llama as llama

    src, model = tiny_llama
    folder = _with_scales(src, tmp_path / "m", _scale_tensors("llm-compressor"))
    q = LLM(str(folder), kv_cache_dtype="fp8", **COMMON)
    runner = q.llm_engine.engine_core.model_runner
    got = [(s.k_scale.item(), s.v_scale.item()) for s in runner.kv_cache.scales]
    want = [(torch.tensor(k).item(), torch.tensor(v).item()) for k, v in zip(K_SCALES, V_SCALES)]
    assert got == want
    prompts = random_prompts([3, 17, 45, 70], model.config.vocab_size, seed=13)
    ours = all_logits(runner, prompts)
    ref_runner = LLM(str(folder), **COMMON).llm_engine.engine_core.model_runner
    monkeypatch.setattr(llama, "write_kv_cache", _fp8_reference_writes(llama, ref_runner))
    ref = all_logits(ref_runner, prompts)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_unused_with_auto_cache_or_calculated_scales(tiny_llama, tmp_path: Path, caplog) -> None:
    src, _ = tiny_llama
    folder = _with_scales(src, tmp_path / "m", _scale_tensors("modelopt"))
    with caplog.at_level(logging.INFO, logger="pagemill.runtime.model_executor.kv_scales"):
        auto = LLM(str(folder), **COMMON)
    assert "not used: kv_cache_dtype is auto" in caplog.text
    scales = auto.llm_engine.engine_core.model_runner.kv_cache.scales
    assert all(s.k_scale.item() == 1.0 and s.v_scale.item() == 1.0 for s in scales)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagemill.runtime.model_executor.kv_scales"):
        calc = LLM(str(folder), kv_cache_dtype="fp8", calculate_kv_scales=True, **COMMON)
    assert "not used: --calculate-kv-scales" in caplog.text
    assert calc.llm_engine.engine_core.model_runner.kv_cache.scales_pending


def test_per_query_head_scale_refused_by_name(tiny_llama, tmp_path: Path) -> None:
    """One scale per query head (4) is not one per KV head (2; see test_kv_scales_per_head)."""
    src, _ = tiny_llama
    folder = _with_scales(src, tmp_path / "m", _scale_tensors("llm-compressor", (4,)))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_scale has shape \(4,\)"):
        LLM(str(folder), kv_cache_dtype="fp8", **COMMON)
    # A float cache never reads them: the same checkpoint serves with --kv-cache-dtype auto.
    LLM(str(folder), **COMMON)
