"""Quantized Hugging Face checkpoints (AWQ, GPTQ, compressed-tensors, FP8) load as the dense
model they mean; anything else is refused.

The checkpoints are written here from each format's published layout.

Written from the formats' documentation and their reference packers (AutoAWQ's
`WQLinear_GEMM.from_linear`, AutoGPTQ/GPTQModel's `QuantLinear.pack`, compressed-tensors'
`pack_to_int32`, DeepSeek/Qwen's FP8 block scales), with plain per-element loops and bit
operations — deliberately not sharing code with pagemill's readers. Each writer returns the
tensors to save and the dense weight the format means (dequantized here, in fp32), which
the tests load into transformers as the reference.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from pagemill.runtime import LLM, SamplingParams
from pagemill.runtime.config import ModelConfig
from pagemill.runtime.model_executor.layers import Linear
from pagemill.runtime.model_executor.models.llama import LlamaForCausalLM
from pagemill.runtime.model_executor.quantization import Int4Groups, WeightPlan, WeightScheme
from pagemill.runtime.model_executor.quantization.fp8 import Fp8Config
from pagemill.runtime.model_executor.quantization.hf_config import (
    QuantizationConfig,
    checkpoint_names,
    get_quantization_config,
    quantized_weights,
)
from pagemill.runtime.model_executor.weights import iterate_weights

F32 = torch.float32

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def to_int32(words: np.ndarray) -> torch.Tensor:
    """uint32 bit patterns as the int32 tensors the checkpoints hold."""
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())


def quantize_groups(
    w: torch.Tensor, bits: int, group_of: np.ndarray, n_groups: int, sym: bool, min_zero: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Min/max quantization of w [N, K]: (q [N, K], z [N, G], s [N, G] fp16-representable),
    column k in group group_of[k]; w ~ (q - z) * s."""
    wn = w.detach().double().numpy()
    n, k = wn.shape
    top = (1 << bits) - 1
    q = np.zeros((n, k), dtype=np.int64)
    z = np.zeros((n, n_groups), dtype=np.int64)
    s = np.zeros((n, n_groups), dtype=np.float64)
    for g in range(n_groups):
        cols = np.nonzero(group_of == g)[0]
        block = wn[:, cols]
        for r in range(n):
            lo, hi = min(block[r].min(), 0.0), max(block[r].max(), 0.0)
            if sym:
                scale = max(abs(lo), abs(hi)) / (top // 2) or 1.0
                zero = 1 << (bits - 1)
            else:
                scale = (hi - lo) / top or 1.0
                zero = int(np.clip(round(-lo / scale), min_zero, top))
            scale = float(np.float16(scale))
            s[r, g], z[r, g] = scale, zero
            for c in cols:
                q[r, c] = int(np.clip(round(wn[r, c] / scale) + zero, 0, top))
    return q, z, s


def dequant(q: np.ndarray, z: np.ndarray, s: np.ndarray, group_of: np.ndarray) -> torch.Tensor:
    n, k = q.shape
    out = np.zeros((n, k), dtype=np.float32)
    for c in range(k):
        g = group_of[c]
        out[:, c] = ((q[:, c] - z[:, g]).astype(np.float32)) * s[:, g].astype(np.float32)
    return torch.from_numpy(out)


def pack_awq(w: torch.Tensor, group_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """AutoAWQ GEMM: qweight [K, N/8], qzeros [K/g, N/8] in AWQ's order, scales [K/g, N]."""
    n, k = w.shape
    group_of = np.arange(k) // group_size
    q, z, s = quantize_groups(w, 4, group_of, k // group_size, sym=False)
    int_w, int_z = q.T, z.T  # [K, N], [G, N]
    qweight = np.zeros((k, n // 8), dtype=np.uint64)
    qzeros = np.zeros((k // group_size, n // 8), dtype=np.uint64)
    for col in range(n // 8):
        for i in range(8):
            qweight[:, col] |= int_w[:, col * 8 + AWQ_ORDER[i]].astype(np.uint64) << (4 * i)
            qzeros[:, col] |= int_z[:, col * 8 + AWQ_ORDER[i]].astype(np.uint64) << (4 * i)
    tensors = {
        "qweight": to_int32(qweight),
        "qzeros": to_int32(qzeros),
        "scales": torch.from_numpy(s.T.astype(np.float16).copy()),
    }
    return tensors, dequant(q, z, s, group_of)


def pack_gptq(
    w: torch.Tensor,
    bits: int,
    group_size: int,
    sym: bool,
    v2: bool,
    act_order_seed: int | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """GPTQ: qweight [K*b/32, N] packed along K, qzeros [G, N*b/32] (v1: z - 1), scales
    [G, N], g_idx [K] (act-order: a permutation's groups)."""
    n, k = w.shape
    g = k if group_size == -1 else group_size
    n_groups = k // g
    if act_order_seed is None:
        group_of = np.arange(k) // g
    else:
        perm = np.random.default_rng(act_order_seed).permutation(k)
        group_of = np.zeros(k, dtype=np.int64)
        for i, col in enumerate(perm):
            group_of[col] = i // g
    # v1 cannot store a zero of 0 (it stores z - 1): GPTQ's quantizers avoid it likewise.
    q, z, s = quantize_groups(w, bits, group_of, n_groups, sym, min_zero=0 if v2 else 1)
    per = 32 // bits
    stored_z = z if v2 else z - 1
    qweight = np.zeros((k // per, n), dtype=np.uint64)
    for row in range(k // per):
        for j in range(per):
            qweight[row] |= q[:, row * per + j].astype(np.uint64) << (bits * j)
    qzeros = np.zeros((n_groups, n // per), dtype=np.uint64)
    zt = stored_z.T  # [G, N]
    for col in range(n // per):
        for j in range(per):
            qzeros[:, col] |= zt[:, col * per + j].astype(np.uint64) << (bits * j)
    tensors = {
        "qweight": to_int32(qweight),
        "qzeros": to_int32(qzeros),
        "scales": torch.from_numpy(s.T.astype(np.float16).copy()),
        "g_idx": torch.from_numpy(group_of.astype(np.int32)),
    }
    return tensors, dequant(q, z, s, group_of)


def pack_compressed(
    w: torch.Tensor, bits: int, group_size: int, sym: bool
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors pack-quantized: signed values + 2^(b-1) packed along K into
    weight_packed [N, K*b/32]; weight_scale [N, G]; asymmetric zero points (signed +
    2^(b-1)) packed along N into weight_zero_point [N*b/32, G]; weight_shape."""
    n, k = w.shape
    g = k if group_size == -1 else group_size
    group_of = np.arange(k) // g
    q, z, s = quantize_groups(w, bits, group_of, k // g, sym)
    offset = 1 << (bits - 1)
    signed_q, signed_z = q - offset, z - offset  # what compressed-tensors quantizes to
    per = 32 // bits
    packed = np.zeros((n, k // per), dtype=np.uint64)
    for col in range(k // per):
        for j in range(per):
            packed[:, col] |= (signed_q[:, col * per + j] + offset).astype(np.uint64) << (bits * j)
    tensors = {
        "weight_packed": to_int32(packed),
        "weight_scale": torch.from_numpy(s.astype(np.float32)).to(torch.bfloat16),
        "weight_shape": torch.tensor([n, k]),
    }
    # Scales are stored in bf16 here: the reference must use what the file holds.
    s = tensors["weight_scale"].double().numpy()
    if not sym:
        zp = np.zeros((n // per, k // g), dtype=np.uint64)
        for row in range(n // per):
            for j in range(per):
                zp[row] |= (signed_z[row * per + j] + offset).astype(np.uint64) << (bits * j)
        tensors["weight_zero_point"] = to_int32(zp)
    return tensors, dequant(q, z, s, group_of)


def quantize_fp8(
    w: torch.Tensor, block: tuple[int, int] | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, scale (scalar, or [ceil(N/bn), ceil(K/bk)] block scales), the fp32
    dense weight it means)."""
    n, k = w.shape
    w = w.detach().float()
    if block is None:
        scale = (w.abs().max() / 448.0).reshape(())
        q = (w / scale).to(torch.float8_e4m3fn)
        return q, scale, q.float() * scale
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    scale = torch.zeros(rows, cols)
    q = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
    dense = torch.zeros(n, k)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
            sc = float(tile.abs().max()) / 448.0 or 1.0
            scale[i, j] = sc
            qt = (tile / sc).to(torch.float8_e4m3fn)
            q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = qt
            dense[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = qt.float() * scale[i, j]
    return q, scale, dense


# ---- checkpoints -----------------------------------------------------------------------------

PROJ = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
FUSED = {
    "self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
    "self_attn.o_proj": ["self_attn.o_proj"],
    "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
    "mlp.down_proj": ["mlp.down_proj"],
}


def write_checkpoint(
    base: Path, folder: Path, hf_model: torch.nn.Module, quant_config: dict, pack
) -> dict[str, torch.Tensor]:
    """Copy `base` (config, tokenizer) to `folder` with every projection of every layer
    written by `pack(name, weight) -> {leaf: tensor}, dense`; returns the reference state
    dict (the dense weights the format means)."""
    folder.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, folder / f.name)
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = quant_config
    (folder / "config.json").write_text(json.dumps(config))
    state = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    tensors: dict[str, torch.Tensor] = {}
    reference = dict(state)
    for name, value in state.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.split("layers.")[-1].split(".", 1)[-1] in PROJ:
            parts, dense = pack(module, value)
            for leaf, t in parts.items():
                tensors[f"{module}.{leaf}"] = t.contiguous()
            reference[name] = dense
        else:
            tensors[name] = value.contiguous()
    safetensors.torch.save_file(tensors, str(folder / "model.safetensors"))
    return reference


def reference_model(hf_model: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    ref = copy.deepcopy(hf_model)
    ref.load_state_dict(state)
    return ref.eval()


CASES = {
    "awq": (
        {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
        lambda name, w: pack_awq(w, 32),
    ),
    "gptq-v1-sym-act-order": (
        {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": 32,
            "sym": True,
            "desc_act": True,
            "checkpoint_format": "gptq",
        },
        lambda name, w: pack_gptq(w, 4, 32, sym=True, v2=False, act_order_seed=len(name)),
    ),
    "gptq-v1-asym": (
        {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": False},
        lambda name, w: pack_gptq(w, 4, 32, sym=False, v2=False),
    ),
    "gptq-v2-per-channel": (
        {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": -1,
            "sym": False,
            "checkpoint_format": "gptq_v2",
        },
        lambda name, w: pack_gptq(w, 4, -1, sym=False, v2=True),
    ),
    "gptq-8bit": (
        {"quant_method": "gptq", "bits": 8, "group_size": 32, "sym": True},
        lambda name, w: pack_gptq(w, 8, 32, sym=True, v2=False),
    ),
    "ct-w4a16-asym": (
        {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4,
                        "type": "int",
                        "symmetric": False,
                        "strategy": "group",
                        "group_size": 32,
                    },
                    "input_activations": None,
                }
            },
            "ignore": ["lm_head"],
        },
        lambda name, w: pack_compressed(w, 4, 32, sym=False),
    ),
    "ct-w8a16-channel": (
        {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 8,
                        "type": "int",
                        "symmetric": True,
                        "strategy": "channel",
                    },
                }
            },
        },
        lambda name, w: pack_compressed(w, 8, -1, sym=True),
    ),
}


def _ct_library_pack(bits: int, sym: bool, strategy: str, group_size: int | None):
    """compressed-tensors' own compressor writes the module and its own decompressor gives the
    dense weight: the layout and the reference come from the library, not from this file."""

    def pack(name, w):
        ct = pytest.importorskip("compressed_tensors")
        from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
        from compressed_tensors.quantization.utils import calculate_qparams

        args = ct.quantization.QuantizationArgs(
            num_bits=bits, type="int", symmetric=sym, strategy=strategy, group_size=group_size
        )
        scheme = ct.quantization.QuantizationScheme(targets=["Linear"], weights=args)
        w = w.detach().float()
        groups = w.reshape(w.shape[0], -1, group_size or w.shape[1])
        scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        # Scales a bf16 checkpoint could hold: (q - z) * s is then exact in fp32 both ways.
        scale = scale.to(torch.bfloat16).float()
        state = {"weight": w, "weight_scale": scale, "weight_zero_point": zero_point}
        packed = PackedQuantizationCompressor.compress(state, scheme)
        dense = PackedQuantizationCompressor.decompress(dict(packed), scheme)["weight"]
        return packed, dense

    return pack


def _ct_config(bits: int, sym: bool, strategy: str, group_size: int | None) -> dict:
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": strategy}
    if group_size:
        weights["group_size"] = group_size
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": ["lm_head"],
    }


CASES["ct-library-w4a16-asym"] = (
    _ct_config(4, False, "group", 32),
    _ct_library_pack(4, False, "group", 32),
)
CASES["ct-library-w8a16-channel"] = (
    _ct_config(8, True, "channel", None),
    _ct_library_pack(8, True, "channel", None),
)


def _fp8_pack(block):
    def pack(name, w):
        q, scale, dense = quantize_fp8(w, block)
        return {"weight": q, "weight_scale" if block is None else "weight_scale_inv": scale}, dense

    return pack


def _ct_fp8_pack(name, w):
    q, scale, dense = quantize_fp8(w, None)
    return {"weight": q, "weight_scale": scale.reshape(1), "input_scale": torch.ones(1)}, dense


CASES["fp8-per-tensor"] = (
    {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"},
    _fp8_pack(None),
)
CASES["fp8-block"] = (
    {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]},
    _fp8_pack((32, 32)),
)
CASES["ct-fp8"] = (
    {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
                "input_activations": {"num_bits": 8, "type": "float", "dynamic": False},
            }
        },
    },
    _ct_fp8_pack,
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_llama):
    """case -> (folder, reference state dict), written lazily."""
    base, hf_model = tiny_llama
    made: dict[str, tuple[Path, dict[str, torch.Tensor]]] = {}

    def get(case: str) -> tuple[Path, dict[str, torch.Tensor]]:
        if case not in made:
            folder = tmp_path_factory.mktemp(case)
            config, pack = CASES[case]
            made[case] = (folder, write_checkpoint(base, folder, hf_model, config, pack))
        return made[case]

    return get


def _served_weight(layer: Linear) -> torch.Tensor:
    """The [out, in] weight a layer computes with: its output on the identity."""
    dtype = layer.scales_and_zeros.dtype if layer.format == "int4" else layer.dtype
    eye = torch.eye(layer.in_features, dtype=dtype)
    layer.packed_max_tokens = 1 << 30  # the packed kernel even for the identity's rows
    with torch.no_grad():
        return layer(eye).T.float()


@pytest.mark.parametrize("case", list(CASES))
def test_served_weights_are_the_formats_dequantization(checkpoints, case) -> None:
    """Packed int4 / two-plane int8 layers (fp32 kernels, kept for this check) compute with
    exactly the dense weights the format means; dense-served layers hold them exactly."""
    folder, reference = checkpoints(case)
    config = ModelConfig.from_pretrained(folder)
    quant = get_quantization_config(folder, torch.float32)
    assert quant is not None
    model = LlamaForCausalLM(config, torch.float32, 512)
    exact = WeightScheme("native", kernel_dtype=torch.float32)
    WeightPlan(exact, None).apply(model)
    names = checkpoint_names([folder / "model.safetensors"])
    model.load_weights(quantized_weights(quant, names, iterate_weights(folder)))
    formats = set()
    for i, layer in enumerate(model.layers):
        for fused, parts in FUSED.items():
            owner, attr = fused.split(".")
            proj = getattr(getattr(layer, owner), attr)
            want = torch.cat([reference[f"model.layers.{i}.{p}.weight"] for p in parts])
            got = _served_weight(proj) if proj.format != "dense" else proj.weight
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{case} layer {i} {fused}")
            formats.add(proj.weight_format)
    expected = {
        "awq": {"int4"},
        "gptq-v1-asym": {"int4"},
        "gptq-v2-per-channel": {"int4"},  # one group per row, split into groups of 64 / 128
        "gptq-8bit": {"int4x2"},  # symmetric 8-bit: Int8Blocks, exact in two int4 planes
        "ct-w4a16-asym": {"int4"},
        "ct-w8a16-channel": {"int4x2"},
        "ct-library-w4a16-asym": {"int4"},
        "ct-library-w8a16-channel": {"int4x2"},
    }.get(case, {"dense"})  # act-order GPTQ and fp8: dequantized
    assert formats == expected


@pytest.mark.parametrize(
    ("case", "dtype"),
    [
        ("awq", "bfloat16"),
        ("awq", "float32"),
        ("gptq-v1-sym-act-order", "float32"),
        ("ct-w4a16-asym", "float32"),
        ("ct-library-w4a16-asym", "float32"),
        ("fp8-block", "float32"),
    ],
)
def test_engine_matches_transformers_on_the_dequantized_model(
    checkpoints, tiny_llama, random_prompts, hf_greedy, all_logits, case, dtype
) -> None:
    """Through the engine: in fp32 (rows served exactly) logits and greedy tokens equal
    transformers running the dense model the checkpoint means; in bf16 (int4 kept packed, the
    kernel's scales in bf16) the logits are as close as transformers' own bf16 run is."""
    folder, reference = checkpoints(case)
    ref = reference_model(tiny_llama[1], reference)
    if case == "fp8-block":
        # transformers dequantizes block-scaled fp8 itself: the reference is its model, and
        # it agrees with the dequantization written here.
        transformers = pytest.importorskip("transformers")
        fp8 = transformers.FineGrainedFP8Config(weight_block_size=(32, 32), dequantize=True)
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=torch.float32, quantization_config=fp8
        ).eval()
        for name, value in ref.state_dict().items():
            assert torch.equal(value, reference[name]), name
    llm = LLM(str(folder), dtype=dtype, enforce_eager=True, kv_cache_memory_bytes=1 << 20)
    runner = llm.llm_engine.engine_core.model_runner
    prompts = random_prompts([5, 23], ref.config.vocab_size, seed=7)
    ours = all_logits(runner, prompts)
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            want = ref(torch.tensor([prompt])).logits[0]
        if dtype == "float32":
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max().item())
        else:
            with torch.no_grad():
                hf_bf16 = ref.to(torch.bfloat16)(torch.tensor([prompt])).logits[0].float()
            ref.float()
            bf16_error = (hf_bf16 - want).abs().max().item()
            assert (got.float() - want).abs().max().item() <= 2 * bf16_error
    if dtype == "bfloat16":
        assert runner.model.layers[0].self_attn.qkv_proj.weight_format == "int4"  # kept packed
        return  # greedy ties flip in bf16 for transformers too: compared in fp32 only
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, 6)


def test_fp8_to_bf16_rounding_is_bounded_and_logged(checkpoints, caplog) -> None:
    """bf16 holds the fp8 x scale product to its unit roundoff (2^-8 relative), and the load
    log says how large the rounding was."""
    folder, reference = checkpoints("fp8-per-tensor")
    config = ModelConfig.from_pretrained(folder)
    quant = get_quantization_config(folder, torch.bfloat16)
    model = LlamaForCausalLM(config, torch.bfloat16, 512)
    names = checkpoint_names([folder / "model.safetensors"])
    with caplog.at_level(logging.INFO):
        model.load_weights(quantized_weights(quant, names, iterate_weights(folder)))
    proj = model.layers[1].mlp.down_proj
    want = reference["model.layers.1.mlp.down_proj.weight"]
    err = (proj.weight.float() - want).abs()
    assert bool((err <= want.abs() * 2.0**-8).all())
    assert bool((err > 0).any())  # bf16 does round some products: the bound is not vacuous
    assert "largest relative rounding" in caplog.text


def test_fp8_block_scales_with_partial_blocks() -> None:
    """128 x 128 block scales (as Qwen3 / Llama FP8 checkpoints ship them) over a weight whose
    sides are not multiples of 128: every element uses its own block's scale."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=g) * torch.linspace(0.1, 3.0, 300)
    q, scale, dense = quantize_fp8(w, (128, 128))
    assert scale.shape == (2, 3)
    quant = Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [128, 128]}, F32)
    got = quant.convert("m", {"weight": q, "weight_scale_inv": scale})
    assert isinstance(got, torch.Tensor)
    assert torch.equal(got, dense)
    # Per-row and per-group scales (compressed-tensors' channel / group strategies).
    for cols in (1, 3):
        scale = torch.rand(200, cols, generator=g) + 0.5
        want = q.float() * scale.repeat_interleave(300 // cols, dim=1)
        got = quant.rounding.dequantize("m", q, scale, None, torch.float32)
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("quant_config", "named"),
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
        ({"quant_method": "hqq", "nbits": 4}, "'hqq'"),
        ({"quant_method": "exl2"}, "'exl2'"),
        ({"quant_method": "some-new-method"}, "'some-new-method'"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version='gemv'"),
        ({"quant_method": "awq", "bits": 4, "version": "marlin"}, "version='marlin'"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits=3"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "marlin"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "nvfp4-pack-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float"}}},
            },
            "nvfp4-pack-quantized",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}},
                "sparsity_config": {"format": "sparse-24-bitmask"},
            },
            "sparse-24-bitmask",
        ),
    ],
)
def test_unsupported_quantization_is_refused_at_start(tiny_llama, tmp_path, quant_config, named):
    """The engine refuses before loading anything, naming the method or option."""
    base, hf_model = tiny_llama
    folder = tmp_path / "q"
    write_checkpoint(base, folder, hf_model, quant_config, lambda name, w: ({"weight": w}, w))
    with pytest.raises(ValueError, match=re.escape(named)):
        LLM(str(folder), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=1 << 20)


def test_quantized_tensors_never_load_as_plain_weights() -> None:
    """The guard behind the readers: int or fp8 values reaching a Linear raise."""
    for value in (
        torch.zeros(16, 32, dtype=torch.float8_e4m3fn),
        torch.zeros(16, 32, dtype=torch.int8),
        torch.zeros(16, 32, dtype=torch.int32),
    ):
        lin = Linear(32, 16, False, torch.float32)
        with pytest.raises(TypeError, match="quantization_config"):
            lin.load_rows(0, value)


def test_fp8_weights_without_a_quantization_config_are_refused(tiny_llama, tmp_path) -> None:
    """An fp8 checkpoint whose config lost its quantization_config must not load its fp8
    values as if they were the weights (the guard in Linear.load_rows)."""
    base, hf_model = tiny_llama
    folder = tmp_path / "fp8"
    write_checkpoint(base, folder, hf_model, {}, _fp8_pack(None))
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        LLM(str(folder), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=1 << 20)


def test_module_split_across_shards_and_old_gptq_config_file(checkpoints, tmp_path) -> None:
    """A module's tensors in two safetensors shards are gathered before converting; an
    AutoGPTQ export with quantize_config.json (no quantization_config) is read as GPTQ."""
    folder, reference = checkpoints("gptq-v1-asym")
    split = tmp_path / "split"
    shutil.copytree(folder, split)
    config = json.loads((split / "config.json").read_text())
    (split / "quantize_config.json").write_text(json.dumps(config.pop("quantization_config")))
    (split / "config.json").write_text(json.dumps(config))
    tensors = safetensors.torch.load_file(str(split / "model.safetensors"))
    (split / "model.safetensors").unlink()
    second = {n for n in tensors if n.endswith((".scales", ".g_idx")) or "layers.1." in n}
    shards = {
        "model-00001-of-00002.safetensors": {n: t for n, t in tensors.items() if n not in second},
        "model-00002-of-00002.safetensors": {n: t for n, t in tensors.items() if n in second},
    }
    for name, part in shards.items():
        safetensors.torch.save_file(part, str(split / name))
    weight_map = {n: f for f, part in shards.items() for n in part}
    (split / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    quant = get_quantization_config(split, F32)
    assert quant is not None and quant.quant_method == "gptq"
    model = LlamaForCausalLM(ModelConfig.from_pretrained(split), F32, 512)
    files = sorted(split.glob("*.safetensors"))
    model.load_weights(quantized_weights(quant, checkpoint_names(files), iterate_weights(split)))
    got = model.layers[0].self_attn.o_proj.weight  # fp32: dense, dequantized exactly
    assert torch.equal(got, reference["model.layers.0.self_attn.o_proj.weight"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", ["awq", "gptq-8bit", "fp8-block"])
def test_quantized_checkpoints_on_gpu(
    checkpoints, tiny_llama, random_prompts, hf_greedy, case
) -> None:
    """On a GPU the rows are dequantized into dense weights: fp32 logits equal the reference."""
    folder, reference = checkpoints(case)
    ref = reference_model(tiny_llama[1], reference)
    llm = LLM(
        str(folder),
        dtype="float32",
        device="cuda",
        enforce_eager=True,
        kv_cache_memory_bytes=1 << 20,
    )
    prompts = random_prompts([5, 23], ref.config.vocab_size, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, 6)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
    reason="needs a CUDA device and compiled (not interpreted) Triton",
)
def test_awq_on_gpu_runs_the_triton_int4_gemm(
    checkpoints, tiny_llama, random_prompts, all_logits
) -> None:
    """bf16 on a GPU: the AWQ rows stay packed for the Triton dequant-GEMM, and the logits
    are as close to the dense fp32 model as transformers' own bf16 run is."""
    folder, reference = checkpoints("awq")
    ref = reference_model(tiny_llama[1], reference)
    llm = LLM(
        str(folder),
        dtype="bfloat16",
        device="cuda",
        enforce_eager=True,
        kv_cache_memory_bytes=1 << 20,
    )
    runner = llm.llm_engine.engine_core.model_runner
    assert runner.model.layers[0].self_attn.qkv_proj.weight_format == "triton_int4"
    prompts = random_prompts([5, 23], ref.config.vocab_size, seed=7)
    for prompt, got in zip(prompts, all_logits(runner, prompts)):
        with torch.no_grad():
            want = ref(torch.tensor([prompt])).logits[0]
            hf_bf16 = ref.to(torch.bfloat16)(torch.tensor([prompt])).logits[0].float()
        ref.float()
        bf16_error = (hf_bf16 - want).abs().max().item()
        assert (got.float().cpu() - want).abs().max().item() <= 2 * bf16_error


def test_vllm_quantization_names_check_the_checkpoint(checkpoints, tiny_llama) -> None:
    """`--quantization awq` (vLLM's spelling) on an AWQ checkpoint loads it; a name the
    checkpoint does not match — or fp8 on an unquantized one — is refused, naming both."""
    folder, _ = checkpoints("awq")
    kw = dict(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=1 << 20)
    llm = LLM(str(folder), quantization="awq", **kw)
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match=r"quantization='gptq'.*quantized with 'awq'"):
        LLM(str(folder), quantization="gptq", **kw)
    with pytest.raises(ValueError, match=r"quantization='fp8'.*not quantized"):
        LLM(str(tiny_llama[0]), quantization="fp8", **kw)


@pytest.mark.parametrize("case", ["awq", "gptq-v2-per-channel", "ct-w4a16-asym"])
def test_rows_feed_the_gpu_int4_gemm(case) -> None:
    """The rows a reader makes are what the kernels' int4-group GEMM (the GPU path for these
    formats) takes: packed for it, they compute x @ Wᵀ with W the format's dequantization
    rounded to the activation dtype (here through its torch path, the kernel's reference)."""
    from pagemill.kernels import int4_group_gemm_torch, pack_int4_groups

    config, pack = CASES[case]
    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(3)) * 0.1
    parts, dense = pack("m", w)
    quant = _reader(config)
    rows = quant.convert("m", dict(parts))
    assert isinstance(rows, Int4Groups)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    qweight, s, z = pack_int4_groups(rows.q, rows.scales, rows.zeros, torch.float32)
    got = int4_group_gemm_torch(x, qweight, s, z, rows.group_size)
    want = (x.float() @ dense.to(torch.bfloat16).float().T).to(torch.bfloat16)
    assert torch.equal(got, want)


def _reader(config: dict) -> QuantizationConfig:
    from pagemill.runtime.model_executor.quantization.awq import AWQConfig
    from pagemill.runtime.model_executor.quantization.compressed_tensors import (
        CompressedTensorsConfig,
    )
    from pagemill.runtime.model_executor.quantization.gptq import GPTQConfig

    cls = {"awq": AWQConfig, "gptq": GPTQConfig, "compressed-tensors": CompressedTensorsConfig}
    return cls[config["quant_method"]].from_config(config, F32)


@pytest.mark.slow  # two worker processes: about half a minute on two shared cores
def test_quantized_checkpoint_under_tensor_parallelism(
    checkpoints, tiny_llama, random_prompts, hf_greedy
) -> None:
    """Each rank reads the checkpoint's rows and takes its shard of them, dequantized."""
    folder, reference = checkpoints("gptq-v1-sym-act-order")
    ref = reference_model(tiny_llama[1], reference)
    llm = LLM(
        str(folder),
        tensor_parallel_size=2,
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=1 << 20,
    )
    prompts = random_prompts([5, 23], ref.config.vocab_size, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, 6)
    llm.shutdown()
