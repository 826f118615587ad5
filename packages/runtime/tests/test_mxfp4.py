"""MXFP4 checkpoints (gpt-oss's published format): the dequantization against transformers'
own on random blocks, and a gpt-oss whose experts are stored as MXFP4 served equal to
transformers running the same (dequantized) weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagemill.runtime import LLM, SamplingParams
from pagemill.runtime.model_executor.quantization.hf_config import (
    UnsupportedQuantization,
    get_quantization_config,
)
from pagemill.runtime.model_executor.quantization.mxfp4 import dequantize_mxfp4

transformers_mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")


def _random_mxfp4(shape: tuple[int, ...], seed: int, lo: int = 118, hi: int = 130):
    """Blocks of every byte value, scales over a range of exponents around 2^-5."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(lo, hi, shape, generator=g, dtype=torch.int32).to(torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_matches_transformers(dtype) -> None:
    # [experts, rows, groups]: transformers returns the stack transposed ([E, K, N]).
    blocks, scales = _random_mxfp4((3, 10, 4), seed=1, lo=100, hi=150)
    ours = dequantize_mxfp4(blocks, scales, dtype)
    theirs = transformers_mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    assert ours.shape == (3, 10, 128) and ours.dtype == dtype
    assert torch.equal(ours.transpose(1, 2), theirs)
    # Slicing rows (the memory bound) changes nothing.
    from pagemill.runtime.model_executor.quantization import mxfp4

    mp = pytest.MonkeyPatch()
    mp.setattr(mxfp4, "_SLICE_VALUES", 64)
    try:
        assert torch.equal(dequantize_mxfp4(blocks, scales, dtype), ours)
    finally:
        mp.undo()


def test_bad_mxfp4_tensors_are_refused() -> None:
    blocks, scales = _random_mxfp4((2, 3), seed=2)
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_mxfp4(blocks, scales[:, :2], torch.float32)
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks.int(), scales, torch.float32)


def _mxfp4_gpt_oss(folder: Path, dense: Path, build_tiny_model) -> torch.nn.Module:
    """A tiny gpt-oss whose experts are random MXFP4 blocks: `folder` holds the MXFP4
    checkpoint (as published: experts as *_blocks/*_scales, the rest dense), the returned
    transformers model (also saved dense in `dense`) the same weights dequantized by
    transformers."""
    model = build_tiny_model(
        dense,
        "gpt_oss",
        seed=5,
        num_hidden_layers=2,
        head_dim=16,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        swiglu_limit=2.0,
        attn_implementation="eager",
    )
    hidden, inter, experts = 64, 32, 4
    packed: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            e = layer.mlp.experts
            e.gate_up_proj_bias.normal_(0, 0.3)
            e.down_proj_bias.normal_(0, 0.3)
            layer.self_attn.sinks.normal_(0, 1.0)
            for n, rows, k in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
                blocks, scales = _random_mxfp4((experts, rows, k // 32), seed=10 * i + len(n))
                name = f"model.layers.{i}.mlp.experts.{n}"
                packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
                w = transformers_mxfp4.convert_moe_packed_tensors(
                    blocks, scales, dtype=torch.float32
                )
                getattr(e, n).copy_(w)
    model.save_pretrained(str(dense))
    tensors = load_file(str(dense / "model.safetensors"))
    for name in list(tensors):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            del tensors[name]
    tensors.update(packed)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for f in dense.iterdir():
        if f.suffix == ".json" and f.name != "model.safetensors.index.json":
            (folder / f.name).write_text(f.read_text())
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
    }
    (folder / "config.json").write_text(json.dumps(config))
    return model


def test_mxfp4_gpt_oss_matches_transformers(
    tmp_path, build_tiny_model, hf_greedy, random_prompts
) -> None:
    model = _mxfp4_gpt_oss(tmp_path / "mxfp4", tmp_path / "dense", build_tiny_model)
    q = get_quantization_config(tmp_path / "mxfp4", torch.float32)
    assert q is not None and q.quant_method == "mxfp4"
    llm = LLM(
        str(tmp_path / "mxfp4"),
        dtype="float32",
        quantization="mxfp4",  # vLLM's flag: checked against the checkpoint's method
        max_model_len=256,  # the default YaRN config reaches 128k
        max_num_batched_tokens=32,
        kv_cache_memory_bytes=4 << 20,
    )
    prompts = random_prompts([40, 7, 23], model.config.vocab_size, seed=3)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (15, 20, 9)]
    for prompt, p, out in zip(prompts, params, llm.generate(prompts, params, use_tqdm=False)):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, p.max_tokens)


def test_an_unknown_quant_method_still_names_mxfp4(tmp_path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"quantization_config": {"quant_method": "x"}})
    )
    with pytest.raises(UnsupportedQuantization, match="mxfp4"):
        get_quantization_config(tmp_path, torch.float32)
