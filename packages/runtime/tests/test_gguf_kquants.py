"""Every GGUF quant type is read from the file's blocks and served packed, checked against
the `gguf` package's own dequantization.

Any bytes form valid GGML blocks as long as their fp16 scales are finite, so the tests make
random blocks (scales set to small finite values) rather than quantizing anything: per type,
the rows our reader makes must dequantize to exactly what `gguf.quants.dequantize` gives
(Q6_K and Q2_K, which no packed format holds exactly, within their requantization bound),
and a packed `Linear` must compute with those weights. A tiny Llama written as a GGUF of
mixed K-quant types then gives transformers' logits (transformers dequantizes the file).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from pagemill.runtime.config import ModelConfig
from pagemill.runtime.model_executor import loader as loader_module
from pagemill.runtime.model_executor.gguf_weights import GGUFCheckpoint, read_gguf_tensor
from pagemill.runtime.model_executor.layers import Linear
from pagemill.runtime.model_executor.loader import load_model
from pagemill.runtime.model_executor.quantization import (
    Int4Groups,
    Int8Blocks,
    RequantError,
    WeightScheme,
    weight_report,
)
from pagemill.runtime.worker.model_runner import ModelRunner

gguf = pytest.importorskip("gguf")
QT = gguf.GGMLQuantizationType

# Byte offsets of each type's fp16 fields inside a block (llama.cpp's block structs).
FP16_FIELDS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "IQ4_NL": [0],
    "Q2_K": [80, 82],
    "Q3_K": [108],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
    "IQ4_XS": [0],
    "IQ2_XXS": [0],
}
EXACT = {
    "Q4_0": Int4Groups,
    "Q4_1": Int4Groups,
    "Q4_K": Int4Groups,
    "Q5_0": Int8Blocks,
    "Q5_1": Int8Blocks,
    "Q8_0": Int8Blocks,
    "IQ4_NL": Int8Blocks,
    "Q3_K": Int8Blocks,
    "Q5_K": Int8Blocks,
    "IQ4_XS": Int8Blocks,
}


def random_blocks(name: str, rows: int, k: int, rng: np.random.Generator, scale: float = 0.01):
    """[rows, bytes per row] of random `name` blocks whose fp16 fields are N(0, scale)."""
    block, type_size = gguf.GGML_QUANT_SIZES[QT[name]]
    raw = rng.integers(0, 256, (rows, k // block, type_size), dtype=np.uint8)
    for at in FP16_FIELDS[name]:
        values = (rng.standard_normal((rows, k // block, 1)) * scale).astype(np.float16)
        raw[..., at : at + 2] = values.view(np.uint8)
    return raw.reshape(rows, -1)


def gguf_dequantized(name: str, raw: np.ndarray, rows: int, k: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, QT[name]).astype(np.float32)).reshape(
        rows, k
    )


def _served_weight(layer: Linear) -> torch.Tensor:
    """The [out, in] weight the layer's packed kernel computes with: its output on I (a
    unit row reaches `gemv_q4`'s int8 activations exactly, up to its scale's rounding)."""
    dtype = layer.dtype if layer.scales_and_zeros is None else layer.scales_and_zeros.dtype
    eye = torch.eye(layer.in_features, dtype=dtype)
    with torch.no_grad():
        return layer(eye).T.float()


def _packed_layer(rows, k: int, n: int, kernel_dtype: torch.dtype) -> Linear:
    layer = Linear(k, n, False, kernel_dtype)
    layer.scheme = WeightScheme("native", kernel_dtype=kernel_dtype)
    layer.load_rows(0, rows)
    return layer


def _assert_fp32_exact(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to fp32's rounding of a zero point: a min folded into a zero point
    (Q4_1/Q4_K/Q5_1/Q5_K: w = (q - 8) * s + (8s - m)) can round once more than ggml's
    d * q - m, by an ulp of the group's magnitude."""
    err = (got - want).abs().reshape(want.shape[0], -1, 32).amax(-1)
    scale = want.abs().reshape(want.shape[0], -1, 32).amax(-1)
    assert bool((err <= scale * 2**-22).all()), float((err / scale).max())


@pytest.mark.parametrize("name", list(EXACT))
def test_exact_types_repack_to_ggufs_values(name) -> None:
    rows, k = 32, 512
    raw = random_blocks(name, rows, k, np.random.default_rng(len(name)))
    want = gguf_dequantized(name, raw, rows, k)
    value = read_gguf_tensor(int(QT[name]), (k, rows), raw)  # GGUF shapes are innermost first
    assert isinstance(value, EXACT[name]) and value.source == name
    got = value.dequantize(torch.float32)
    _assert_fp32_exact(got, want)
    if name in ("Q4_0", "Q8_0", "Q5_0", "IQ4_NL", "Q3_K", "IQ4_XS"):  # no min: bit for bit
        assert torch.equal(got, want)
        # A layer served dense in bf16 gets gguf's values rounded once to bf16.
        dense = Linear(k, rows, False, torch.bfloat16)
        dense.load_rows(0, value)  # the default scheme: dense
        assert dense.weight is not None
        assert torch.equal(dense.weight, want.to(torch.bfloat16))
    # The packed kernel in fp32 computes with these weights.
    layer = _packed_layer(value, k, rows, torch.float32)
    assert layer.weight_format == ("int4" if EXACT[name] is Int4Groups else "int4x2")
    assert layer.weight is None
    _assert_fp32_exact(_served_weight(layer), want)
    # In bf16 (serving) the scales round to bf16: off by at most a few bf16 ulps per group.
    layer16 = _packed_layer(value, k, rows, torch.bfloat16)
    err = (_served_weight(layer16) - want).abs().reshape(rows, -1, 32).amax(-1)
    scale = want.abs().reshape(rows, -1, 32).amax(-1)
    assert bool((err <= scale * 2**-6 + 1e-6).all()), float((err / scale).max())


@pytest.mark.parametrize(
    ("name", "levels"),
    [("Q6_K", 127), ("Q2_K", 255 / 2)],  # int8 per 32: symmetric; min/max with a zero
)
def test_requantized_types_stay_within_their_bound(name, levels) -> None:
    rows, k = 32, 512
    raw = random_blocks(name, rows, k, np.random.default_rng(7))
    want = gguf_dequantized(name, raw, rows, k)
    errors: dict[str, RequantError] = {}
    value = read_gguf_tensor(int(QT[name]), (k, rows), raw, errors=errors)
    got = value.dequantize(torch.float32)
    groups = want.reshape(rows, -1, 32)
    span = groups.abs().amax(-1) if name == "Q6_K" else (groups.amax(-1) - groups.amin(-1)) / 2
    err = (got - want).abs().reshape(rows, -1, 32).amax(-1)
    assert bool((err <= span / levels / 2 * (1 + 1e-5) + 1e-7).all())
    assert float(err.max()) > 0  # random blocks: not representable exactly
    report = errors[name]
    assert report.max_abs == pytest.approx(float((got - want).abs().max()))
    assert report.mean_abs == pytest.approx(float((got - want).abs().mean()), rel=1e-4)
    assert report.count == rows * k
    layer = _packed_layer(value, k, rows, torch.float32)
    assert layer.weight_format in ("int4", "int4x2")
    _assert_fp32_exact(_served_weight(layer), got)


@pytest.mark.parametrize("name", ["Q6_K", "Q2_K", "IQ2_XXS"])
def test_dense_reads_are_gguf_exact_in_the_compute_dtype(name) -> None:
    """Not requantized (fp32 or GPU compute, the embedding) and types without a packed form:
    gguf's dequantization, cast once to the compute dtype — never an fp32 copy in bf16."""
    rows, k = 16, 256
    raw = random_blocks(name, rows, k, np.random.default_rng(3))
    want = gguf_dequantized(name, raw, rows, k)
    for dtype in (torch.float32, torch.bfloat16):
        value = read_gguf_tensor(int(QT[name]), (k, rows), raw, requantize=False, dense_dtype=dtype)
        assert isinstance(value, torch.Tensor) and value.dtype == dtype
        assert torch.equal(value, want.to(dtype))


# ---- a tiny Llama as a GGUF of mixed types ---------------------------------------------------

HF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Every type at least once; fused q/k/v and gate/up mix int4 and int8 rows.
LAYER_TYPES = [
    {
        "attn_q": "Q4_K",
        "attn_k": "Q6_K",
        "attn_v": "Q5_K",
        "attn_output": "Q3_K",
        "ffn_gate": "Q2_K",
        "ffn_up": "Q5_0",
        "ffn_down": "IQ4_XS",
    },
    {
        "attn_q": "Q5_1",
        "attn_k": "IQ4_NL",
        "attn_v": "Q8_0",
        "attn_output": "Q4_K",
        "ffn_gate": "Q4_K",
        "ffn_up": "Q6_K",
        "ffn_down": "Q5_K",
    },
]
TARGET_STD = 0.05


def _calibrated_blocks(name: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks whose weights have about TARGET_STD (w is linear in the fp16 fields)."""
    probe = random_blocks(name, 8, k, np.random.default_rng(0), 1.0)
    std = float(gguf_dequantized(name, probe, 8, k).std())
    return random_blocks(name, rows, k, rng, TARGET_STD / std)


def write_mixed_gguf(model: torch.nn.Module, path: Path) -> Path:
    c = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    writer.add_vocab_size(c.vocab_size)
    rng = np.random.default_rng(11)
    sd = model.state_dict()

    def quantized(name: str, hf: str, qtype: str) -> None:
        rows, k = sd[hf].shape
        raw = _calibrated_blocks(qtype, rows, k, rng)
        writer.add_tensor(name, raw, raw_dtype=QT[qtype])

    quantized("token_embd.weight", "model.embed_tokens.weight", "Q6_K")
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"].numpy())
    quantized("output.weight", "lm_head.weight", "Q6_K")
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        writer.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"].numpy())
        writer.add_tensor(
            f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"].numpy()
        )
        for g, hf in HF_NAMES.items():
            quantized(f"blk.{i}.{g}.weight", p + hf + ".weight", LAYER_TYPES[i][g])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory, build_tiny_model):
    """(folder with the HF config + tokenizer, the GGUF file, transformers' model of it)."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("kquant-gguf")
    model = build_tiny_model(
        folder, "llama", seed=5, hidden_size=256, intermediate_size=512, num_attention_heads=4
    )
    path = write_mixed_gguf(model, folder / "tiny.Q4_K_M.gguf")
    (folder / "model.safetensors").unlink()  # the GGUF is the only copy of the weights
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), gguf_file=path.name, dtype=torch.float32
    ).eval()
    return folder, path, ref


def _runner(folder: Path, dtype: torch.dtype, **kwargs) -> ModelRunner:
    config = ModelConfig.from_pretrained(folder)
    model = load_model(folder, config, dtype, torch.device("cpu"), 512, **kwargs)
    runner = ModelRunner(model, config, torch.device("cpu"), dtype, 16, 8, 512, 512)
    runner.init_kv_cache(64)
    return runner


def _hf_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


def test_mixed_k_quant_gguf_fp32_matches_transformers(
    mixed_gguf, monkeypatch, random_prompts, all_logits
) -> None:
    """fp32 compute: every row dequantized exactly (Q6_K/Q2_K not requantized)."""
    folder, path, ref = mixed_gguf
    monkeypatch.setattr(loader_module, "gguf_for_folder", lambda folder: path)
    runner = _runner(folder, torch.float32)
    prompts = random_prompts([5, 23], ref.config.vocab_size, seed=3)
    for prompt, got in zip(prompts, all_logits(runner, prompts)):
        torch.testing.assert_close(got, _hf_logits(ref, prompt), rtol=1e-4, atol=1e-4)


def test_mixed_k_quant_gguf_served_packed_in_bf16(
    mixed_gguf, monkeypatch, random_prompts, all_logits
) -> None:
    """bf16: every projection packed (no dense copy with never); against transformers' fp32
    logits it errs within a small multiple of what transformers itself errs in bf16 (the
    int8 requantization of Q6_K errs up to 1/254 of a group's largest weight, about twice
    bf16's rounding of each weight); requantized types are reported."""
    folder, path, ref = mixed_gguf
    monkeypatch.setattr(loader_module, "gguf_for_folder", lambda folder: path)
    runner = _runner(folder, torch.bfloat16, cpu_dense_weights="never")
    model = runner.model
    for i, layer in enumerate(model.layers):
        for proj in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        ):
            assert proj.weight_format in ("int4", "int4x2"), (i, proj.source)
            assert proj.weight is None  # never: packed weights only
    assert model.layers[0].self_attn.o_proj.source == "Q3_K"
    assert model.layers[1].self_attn.o_proj.weight_format == "int4"  # Q4_K: one int4 plane
    head = model.logits_proj
    assert head is not None and head.weight_format == "int4x2" and head.source == "Q6_K"
    # The embedding is looked up dense: never requantized, gguf's values rounded to bf16.
    want_embed = ref.model.embed_tokens.weight.detach().to(torch.bfloat16)
    assert torch.equal(model.embed_tokens, want_embed)
    checkpoint = GGUFCheckpoint(path)
    list(checkpoint.weights(model._targets().keys(), runner.model_config))
    assert sorted(checkpoint.requant_errors) == ["Q2_K", "Q6_K"]
    report = weight_report(model, checkpoint.requant_errors)
    assert sorted(report.requantized) == ["Q2_K", "Q6_K"] and "Q6_K requantized" in (
        report.summary()
    )
    prompts = random_prompts([5, 23], ref.config.vocab_size, seed=3)
    ref16 = copy.deepcopy(ref).to(torch.bfloat16)
    ours, theirs = [], []
    for prompt, got in zip(prompts, all_logits(runner, prompts)):
        want = _hf_logits(ref, prompt)
        ours.append(float((got.float() - want).abs().max()))
        theirs.append(float((_hf_logits(ref16, prompt).float() - want).abs().max()))
    assert max(ours) <= 2.5 * max(theirs), (ours, theirs)
