"""GGUF files of mixture-of-experts models, written as llama.cpp's converter writes them,
generate like the transformers model they came from.

Each case is a tiny random transformers MoE model (fp32) whose saved checkpoint (per-expert
tensors, as released checkpoints hold them) is written with `gguf.GGUFWriter` the way
`convert_hf_to_gguf.py` does: a layer's experts stacked into `ffn_{gate,up,down}_exps`
([E, rows, in]), routers (`ffn_gate_inp`, `ffn_gate_inp_shexp`) kept F32, the expert
counts and sizes as metadata keys; Mixtral as llama (q/k rows permuted). The reference is
the original model with the file's weights (each tensor through the `gguf` package's
quantize/dequantize): logits at every prompt position and greedy tokens. (transformers'
own GGUF reader cannot serve as a second reference here: it fails on these qwen2moe /
qwen3moe files' expert shapes and reads a llama file with experts as a dense Llama.)
"""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pagemill.runtime import LLM
from pagemill.runtime.model_executor.gguf_arch import Metadata, config_from_gguf
from pagemill.runtime.model_executor.layers.fused_moe import FusedMoE

# The dense architectures' writer (metadata keys, tokenizer, q/k permutation, round trip);
# tests are imported by path (--import-mode=importlib), so it is loaded by path too.
_spec = importlib.util.spec_from_file_location(
    "gguf_archs_writer", Path(__file__).with_name("test_gguf_archs.py")
)
assert _spec is not None and _spec.loader is not None
_archs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_archs)
GREEDY, _permute, _roundtrip = _archs.GREEDY, _archs._permute, _archs._roundtrip
_write_params, _write_tokenizer = _archs._write_params, _archs._write_tokenizer

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
QT = gguf.GGMLQuantizationType

QWEN3_MOE = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,  # what llama.cpp's qwen3moe does
    head_dim=32,
    num_hidden_layers=3,
)
# case -> (HF family, GGUF architecture, tensor type, overrides of the tiny config)
CASES: dict[str, tuple[str, str, Any, dict[str, Any]]] = {
    "qwen3moe-F16": ("qwen3_moe", "qwen3moe", QT.F16, QWEN3_MOE),
    "qwen3moe-Q8_0": ("qwen3_moe", "qwen3moe", QT.Q8_0, {**QWEN3_MOE, "tie_word_embeddings": True}),
    "olmoe-Q4_0": (
        "olmoe",
        "olmoe",
        QT.Q4_0,
        dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32, norm_topk_prob=False),
    ),
    # A shared expert with its sigmoid gate, top-3 not renormalised (llama.cpp's qwen2moe).
    # Every layer sparse: llama.cpp's qwen MoE architectures have no dense-MLP tensors.
    "qwen2moe-F32": (
        "qwen2_moe",
        "qwen2moe",
        QT.F32,
        dict(
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            num_hidden_layers=3,
        ),
    ),
    "mixtral-F16": (
        "mixtral",
        "llama",
        QT.F16,
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48),
    ),
    "olmoe-F32": (
        "olmoe",
        "olmoe",
        QT.F32,
        dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32, norm_topk_prob=False),
    ),
}
_EXPERT = re.compile(r"^(.*\.experts\.)(\d+)\.(.*)$")
_F32_ALWAYS = (".ffn_gate_inp.", ".ffn_gate_inp_shexp.")  # the converter's forced-F32 routers


def _stacked(checkpoint: dict[str, torch.Tensor]) -> dict[str, list[tuple[int, str]]]:
    """Merged name -> [(expert, per-expert name)], as the converter merges them."""
    out: dict[str, list[tuple[int, str]]] = {}
    for name in checkpoint:
        if (m := _EXPERT.match(name)) is not None:
            out.setdefault(m[1] + m[3], []).append((int(m[2]), name))
    return {k: sorted(v) for k, v in out.items()}


def write_moe_gguf(
    hf_dir: Path,
    path: Path,
    family: str,
    arch: str,
    qtype: Any,
    expert_blocks: Any = None,
) -> Path:
    """Write the checkpoint in `hf_dir` as llama.cpp would; returns a model folder holding
    the weights the file holds (each tensor through its type's quantize/dequantize).

    `expert_blocks`: (GGML type, data [E, rows, in] -> raw blocks) for the stacked expert
    tensors, for types the `gguf` package cannot quantize (K-quants); they hold what the
    package dequantizes those blocks to."""
    config = transformers.AutoConfig.from_pretrained(str(hf_dir))
    checkpoint = safetensors_torch.load_file(str(hf_dir / "model.safetensors"))
    w = gguf.GGUFWriter(str(path), arch)
    _write_params(w, family, arch, config)
    if arch == "qwen3moe":
        w.add_key_length(config.head_dim)
        w.add_value_length(config.head_dim)
    w.add_expert_count(getattr(config, "num_experts", None) or config.num_local_experts)
    w.add_expert_used_count(config.num_experts_per_tok)
    if family.startswith("qwen"):
        w.add_expert_feed_forward_length(config.moe_intermediate_size)
    if family == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    _write_tokenizer(w, hf_dir, config.eos_token_id)
    names = gguf.get_tensor_name_map(
        {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], config.num_hidden_layers
    )
    stacks = _stacked(checkpoint)
    merged = {n for members in stacks.values() for _, n in members}
    tensors = [(hf, t.float().numpy()) for hf, t in checkpoint.items() if hf not in merged]
    tensors += [
        (hf, np.stack([checkpoint[n].float().numpy() for _, n in members]))
        for hf, members in stacks.items()
    ]
    held: dict[str, torch.Tensor] = {}
    for hf, data in tensors:
        name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf
        routed = any(k in name for k in _F32_ALWAYS)
        stored = qtype if data.ndim >= 2 and not routed else QT.F32
        raw = None
        if expert_blocks is not None and hf in stacks:
            stored, make = expert_blocks
            raw = make(data)
            back = torch.from_numpy(gguf.quants.dequantize(raw, stored).copy())
        else:
            back = torch.from_numpy(_roundtrip(data, stored).copy())
        if hf in stacks:
            for j, n in stacks[hf]:
                held[n] = back[j].clone()
        else:
            held[hf] = back
        if arch == "llama" and ".attn_q." in name:
            data = _permute(data, config.num_attention_heads)
        elif arch == "llama" and ".attn_k." in name:
            data = _permute(data, config.num_key_value_heads)
        if raw is not None:
            w.add_tensor(name, raw, raw_dtype=stored)
        elif stored in (QT.F32, QT.F16):
            w.add_tensor(name, data.astype(np.float16 if stored == QT.F16 else np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(data, stored), raw_dtype=stored)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ref_dir = path.parent / "reference"
    shutil.copytree(hf_dir, ref_dir)
    safetensors_torch.save_file(held, str(ref_dir / "model.safetensors"))
    return ref_dir


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PAGEMILL_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("key", list(CASES))
def test_moe_gguf_generates_like_transformers(
    tmp_path, key, build_tiny_model, random_prompts, hf_greedy, all_logits
) -> None:
    family, arch, qtype, overrides = CASES[key]
    hf_dir = tmp_path / "hf"
    build_tiny_model(hf_dir, family, seed=7, **overrides)
    path = tmp_path / "gguf" / f"tiny-{key}.gguf"
    path.parent.mkdir()
    ref_dir = write_moe_gguf(hf_dir, path, family, arch, qtype)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(ref_dir), dtype=torch.float32
    ).eval()

    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=1 << 22)
    config = llm.llm_engine.model_config
    assert config.architecture == type(ref).__name__
    prompts = random_prompts([5, 23, 40], ref.config.vocab_size, seed=4)
    runner = llm.llm_engine.engine_core.model_runner
    with torch.no_grad():
        for prompt, got in zip(prompts, all_logits(runner, prompts)):
            want = ref(torch.tensor([prompt])).logits[0]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, 8)


def test_quantized_experts_load_in_bf16_rounded_once(
    tmp_path, build_tiny_model, monkeypatch
) -> None:
    """CPU bf16 serving with packed experts off: Q8_0 experts are held dense in bf16 (no
    fp32 copy), each weight the `gguf` package's dequantized value rounded once — not
    recomputed with bf16 scales. (Packed experts: test_gguf_moe_packed.)"""
    monkeypatch.setattr(FusedMoE, "pack_gguf_experts", False)
    family, arch, qtype, overrides = CASES["qwen3moe-Q8_0"]
    build_tiny_model(tmp_path / "hf", family, seed=7, **overrides)
    path = tmp_path / "gguf" / "tiny.gguf"
    path.parent.mkdir()
    held = safetensors_torch.load_file(
        str(write_moe_gguf(tmp_path / "hf", path, family, arch, qtype) / "model.safetensors")
    )
    llm = LLM(str(path), dtype="bfloat16", kv_cache_memory_bytes=1 << 22)
    model = llm.llm_engine.engine_core.model_runner.model
    for i, layer in enumerate(model.layers):
        experts = layer.mlp.experts
        assert experts.w13_weight.dtype == experts.w2_weight.dtype == torch.bfloat16
        inter = experts.intermediate_size
        for j in range(experts.num_experts):
            p = f"model.layers.{i}.mlp.experts.{j}."
            want = torch.cat([held[p + "gate_proj.weight"], held[p + "up_proj.weight"]])
            assert torch.equal(experts.w13_weight[j], want.to(torch.bfloat16))
            assert torch.equal(experts.w2_weight[j], held[p + "down_proj.weight"].bfloat16())
            assert experts.w13_weight[j].shape[0] == 2 * inter


def test_qwen_moe_file_with_a_dense_layer_is_refused(tmp_path, build_tiny_model) -> None:
    """llama.cpp's qwen MoE architectures have no dense-MLP tensors: a file whose layer has
    no router cannot be what the converter wrote, and is refused, naming the layers."""
    family, arch, qtype, overrides = CASES["qwen3moe-F16"]
    build_tiny_model(tmp_path / "hf", family, seed=7, **overrides)
    path = tmp_path / "gguf" / "tiny.gguf"
    path.parent.mkdir()
    write_moe_gguf(tmp_path / "hf", path, family, arch, qtype)
    reader = gguf.GGUFReader(str(path))
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    assert config_from_gguf(Metadata(reader.fields, shapes, lambda n: None))["num_experts"] == 8
    del shapes["blk.1.ffn_gate_inp.weight"]
    with pytest.raises(ValueError, match=r"qwen3moe GGUF has layers without a router \(\[1\]\)"):
        config_from_gguf(Metadata(reader.fields, shapes, lambda n: None))


@pytest.mark.slow  # two worker processes
def test_moe_gguf_tp2_generates_like_transformers(
    tmp_path, build_tiny_model, random_prompts, hf_greedy
) -> None:
    """Under tensor parallelism the per-expert tensors read from the stacks are split by the
    experts' intermediate size like a safetensors checkpoint's (shared expert included)."""
    family, arch, qtype, overrides = CASES["qwen2moe-F32"]
    build_tiny_model(tmp_path / "hf", family, seed=7, **overrides)
    path = tmp_path / "gguf" / "tiny.gguf"
    path.parent.mkdir()
    ref_dir = write_moe_gguf(tmp_path / "hf", path, family, arch, qtype)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(ref_dir), dtype=torch.float32
    ).eval()
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, kv_cache_memory_bytes=1 << 22)
    try:
        prompts = random_prompts([7, 30], ref.config.vocab_size, seed=5)
        for prompt, out in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
            assert out.outputs[0].token_ids == hf_greedy(ref, prompt, 8)
    finally:
        llm.shutdown()
