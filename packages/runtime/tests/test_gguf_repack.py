"""GGUF Q4_0 / Q4_1 / Q8_0 tensors load into the packed CPU formats without losing a bit.

A tiny Llama is written as a GGUF file with gguf's own writer and quantizers (q/k rows
permuted as llama.cpp's converter does), in a mix of types — fused projections even mix
Q4_1 with Q4_0 and Q8_0 — and read back three ways: transformers' dequantizing GGUF loader
(the reference), our reader's rows, and our packed layers evaluated on the identity matrix
(which returns exactly the weight the kernel computes with).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from pagemill.runtime import LLM, SamplingParams
from pagemill.runtime.config import ModelConfig
from pagemill.runtime.model_executor import loader as loader_module
from pagemill.runtime.model_executor.gguf_weights import GGUFCheckpoint
from pagemill.runtime.model_executor.layers import Linear
from pagemill.runtime.model_executor.models.llama import LlamaForCausalLM
from pagemill.runtime.model_executor.quantization import (
    Int4Groups,
    Int8Blocks,
    WeightPlan,
    WeightScheme,
)

gguf = pytest.importorskip("gguf")
QT = gguf.GGMLQuantizationType

# GGUF type per tensor: layer 0 mixes types inside the fused q/k/v and gate/up.
LAYER_TYPES = [
    {
        "attn_q": QT.Q4_1,
        "attn_k": QT.Q4_1,
        "attn_v": QT.Q4_0,
        "attn_output": QT.Q8_0,
        "ffn_gate": QT.Q4_1,
        "ffn_up": QT.Q8_0,
        "ffn_down": QT.Q4_0,
    },
    {
        "attn_q": QT.Q4_1,
        "attn_k": QT.Q4_1,
        "attn_v": QT.Q4_1,
        "attn_output": QT.Q4_1,
        "ffn_gate": QT.Q4_1,
        "ffn_up": QT.Q4_1,
        "ffn_down": QT.F16,
    },
]
HF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _add(writer, name: str, w: torch.Tensor, qtype) -> None:
    data = w.detach().float().numpy()
    if qtype == QT.F32:
        writer.add_tensor(name, data)
    elif qtype == QT.F16:
        writer.add_tensor(name, data.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)


def write_tiny_gguf(model: torch.nn.Module, path: Path, embed_type=QT.Q8_0) -> Path:
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
    sd = model.state_dict()
    _add(writer, "token_embd.weight", sd["model.embed_tokens.weight"], embed_type)
    _add(writer, "output_norm.weight", sd["model.norm.weight"], QT.F32)
    if not c.tie_word_embeddings:
        _add(writer, "output.weight", sd["lm_head.weight"], QT.Q8_0)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        _add(writer, f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"], QT.F32)
        _add(writer, f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"], QT.F32)
        for g, hf in HF_NAMES.items():
            w = sd[p + hf + ".weight"]
            if g == "attn_q":
                w = torch.from_numpy(_permute(w.numpy(), c.num_attention_heads))
            elif g == "attn_k":
                w = torch.from_numpy(_permute(w.numpy(), c.num_key_value_heads))
            _add(writer, f"blk.{i}.{g}.weight", w, LAYER_TYPES[i % len(LAYER_TYPES)][g])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, build_tiny_model):
    """(folder with the HF config + tokenizer, the GGUF file, transformers' dequantized model)."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("tiny-gguf")
    model = build_tiny_model(folder, "llama", seed=3, tie_word_embeddings=True)
    path = write_tiny_gguf(model, folder / "tiny.Q4_1.gguf")
    (folder / "model.safetensors").unlink()  # the GGUF is the only copy of the weights
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), gguf_file=path.name, dtype=torch.float32
    ).eval()
    return folder, path, ref


def _reference(ref: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in ref.state_dict().items()}


def test_reader_rows_dequantize_to_transformers_weights(tiny_gguf) -> None:
    folder, path, ref = tiny_gguf
    expected = _reference(ref)
    config = ModelConfig.from_pretrained(folder)
    seen = {}
    for name, value in GGUFCheckpoint(path).weights(expected.keys(), config):
        dense = (
            value.float() if isinstance(value, torch.Tensor) else value.dequantize(torch.float32)
        )
        assert torch.equal(dense, expected[name].float()), name  # bit-exact, q/k rows in HF order
        seen[name] = type(value).__name__
    assert seen["model.layers.0.self_attn.q_proj.weight"] == "Int4Groups"
    assert seen["model.layers.0.self_attn.o_proj.weight"] == "Int8Blocks"
    assert seen["model.embed_tokens.weight"] == "Int8Blocks"
    assert seen["model.layers.1.mlp.down_proj.weight"] == "Tensor"  # F16 stays dense


def _served_weight(layer: Linear) -> torch.Tensor:
    """The [out, in] weight the layer's packed kernel computes with: its output on I."""
    eye = torch.eye(layer.in_features, dtype=layer.scales_and_zeros.dtype)
    with torch.no_grad():
        return layer(eye).T


def test_packed_layers_are_lossless(tiny_gguf) -> None:
    """In fp32 kernels (kept for exactly this check; serving runs them in bf16) every packed
    layer computes with exactly the weights transformers dequantizes the file to."""
    folder, path, ref = tiny_gguf
    expected = _reference(ref)
    config = ModelConfig.from_pretrained(folder)
    model = LlamaForCausalLM(config, torch.float32, 512)
    exact = WeightScheme("native", kernel_dtype=torch.float32)
    WeightPlan(exact, exact).apply(model)
    model.load_weights(GGUFCheckpoint(path).weights(model._targets().keys(), config))
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        a, m = layer.self_attn, layer.mlp
        fused = {
            a.qkv_proj: ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
            a.o_proj: ["self_attn.o_proj"],
            m.gate_up_proj: ["mlp.gate_proj", "mlp.up_proj"],
            m.down_proj: ["mlp.down_proj"],
        }
        for proj, names in fused.items():
            want = torch.cat([expected[p + n + ".weight"] for n in names])
            if proj.format == "dense":
                assert torch.equal(proj.weight, want)
                continue
            assert proj.weight is None  # fp32: no dense copy is kept
            assert torch.equal(_served_weight(proj), want), (i, names)
    formats = {
        (i, n): getattr(getattr(layer, n.split(".")[0]), n.split(".")[1]).weight_format
        for i, layer in enumerate(model.layers)
        for n in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    }
    assert formats[(0, "self_attn.qkv_proj")] == "int4"  # Q4_1 + Q4_0 rows: one plane
    assert formats[(0, "self_attn.o_proj")] == "int4x2"  # Q8_0: two planes, exact
    assert formats[(0, "mlp.gate_up_proj")] == "int4x2"  # Q4_1 + Q8_0 rows
    assert formats[(1, "mlp.down_proj")] == "dense"  # F16
    # The tied LM head: Q8_0 packed exactly; the embedding (dequantized) is its dense copy.
    head = model.logits_proj
    assert head is not None and head.weight_format == "int4x2"
    assert head.weight is model.embed_tokens
    assert torch.equal(model.embed_tokens, expected["model.embed_tokens.weight"])
    head.packed_max_tokens = 1 << 30  # force the packed path for the identity batch
    assert torch.equal(_served_weight(head), expected["model.embed_tokens.weight"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gguf_model_generates_like_transformers(
    tiny_gguf, monkeypatch, random_prompts, hf_greedy, dtype
) -> None:
    """Through the engine vs transformers on the dequantized GGUF: fp32 serves the rows
    dequantized (exactly), bf16 serves them packed."""
    folder, path, ref = tiny_gguf
    monkeypatch.setattr(loader_module, "gguf_for_folder", lambda folder: path)
    llm = LLM(str(folder), dtype=dtype, enforce_eager=True, kv_cache_memory_bytes=1 << 20)
    model = llm.llm_engine.engine_core.model_runner.model
    packed = dtype == "bfloat16"
    assert (model.logits_proj is not None) == packed
    assert model.layers[0].self_attn.qkv_proj.weight_format == ("int4" if packed else "dense")
    prompts = random_prompts([3, 17, 40], ref.config.vocab_size, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, 8)


def test_mlp_applies_silu_inside_the_amx_gate_up_product(tiny_gguf, monkeypatch) -> None:
    """In bf16 the all-Q4_1 gate | up of layer 1 runs its large batches on the AMX tiles with
    silu(gate) * up in the product's epilogue: the activation within a bf16 step of the
    unfused one, the MLP's output as close; layer 0 (Q4_1 + Q8_0 rows: two planes) keeps the
    unfused path, to the bit."""
    from pagemill.kernels import cpu_native, gemv_q4_cpu

    if not (gemv_q4_cpu.amx_available() and cpu_native.load_gemv_ops()):
        pytest.skip("no AMX or no C++ operators here")
    monkeypatch.setattr(Linear, "amx_packed", True)
    monkeypatch.setattr(Linear, "int8_activations", 2)
    folder, path, _ = tiny_gguf
    config = ModelConfig.from_pretrained(folder)
    model = LlamaForCausalLM(config, torch.bfloat16, 512)
    plan = WeightScheme("native")
    WeightPlan(plan, plan).apply(model)
    model.load_weights(GGUFCheckpoint(path).weights(model._targets().keys(), config))
    fused_mlp, plain_mlp = model.layers[1].mlp, model.layers[0].mlp
    assert fused_mlp.fused_act == "silu" and fused_mlp.gate_up_proj.amx_large_rows
    assert not plain_mlp.gate_up_proj.amx_large_rows
    rows = fused_mlp.gate_up_proj.packed_max_tokens + 24
    x = torch.randn(rows, config.hidden_size, generator=torch.Generator().manual_seed(0))
    x = x.to(torch.bfloat16)
    with torch.no_grad():
        act = fused_mlp.gate_up_proj.act_and_mul_forward(x, "silu")
        want = gemv_q4_cpu.silu_mul_reference(fused_mlp.gate_up_proj(x))
        fused = [m(x) for m in (fused_mlp, plain_mlp)]
        for m in (fused_mlp, plain_mlp):
            monkeypatch.setattr(m, "fused_act", None)
        unfused = [m(x) for m in (fused_mlp, plain_mlp)]
    step = torch.exp2(torch.floor(torch.log2(want.float().abs().clamp_min(1e-30))) - 7)
    assert ((act.float() - want.float()).abs() <= step).all()
    # The MLP: what the compiled graph's unfused loop gives (one rounding) to a bf16 step;
    # eager torch (silu rounded first) differs in the activation by a step at most, which the
    # down projection (F16 rows: dense) spreads by at most |W_down| times that step.
    with torch.no_grad():
        graph = fused_mlp.down_proj(want)
        eager_act = fused_mlp.act_and_mul(fused_mlp.gate_up_proj(x))
    out_step = torch.exp2(torch.floor(torch.log2(graph.float().abs().clamp_min(1e-30))) - 7)
    assert ((fused[0].float() - graph.float()).abs() <= out_step).all()
    w_down = fused_mlp.down_proj.weight
    assert w_down is not None
    act_step = torch.exp2(torch.floor(torch.log2(eager_act.float().abs().clamp_min(1e-30))) - 7)
    bound = act_step @ w_down.float().abs().T + 2 * out_step
    assert ((fused[0].float() - unfused[0].float()).abs() <= bound).all()
    assert torch.equal(fused[1], unfused[1])


def test_q8_0_two_planes_and_q4_rows_roundtrip() -> None:
    """Row formats dequantize as ggml does, on hand-made rows with extreme values."""
    g = torch.Generator().manual_seed(0)
    q8 = torch.randint(-128, 128, (16, 64), generator=g, dtype=torch.int8)
    q8[0, :32] = -128
    q8[1, :32] = 127
    d = torch.rand(16, 2, generator=g).half().float()
    rows = Int8Blocks(q8, d, 32)
    lin = Linear(64, 16, False, torch.float32)
    lin.scheme = WeightScheme("native", kernel_dtype=torch.float32)
    lin.load_rows(0, rows)
    assert lin.weight_format == "int4x2"
    assert torch.equal(_served_weight(lin), q8.float() * d.repeat_interleave(32, 1))
    q4 = torch.randint(0, 16, (16, 64), generator=g, dtype=torch.uint8)
    scales, mins = (
        torch.rand(16, 2, generator=g).half().float(),
        -torch.rand(16, 2, generator=g).half().float(),
    )
    rows4 = Int4Groups(q4, scales, mins + 8 * scales, 32, "Q4_1")
    want = q4.float() * scales.repeat_interleave(32, 1) + mins.repeat_interleave(32, 1)
    assert torch.equal(rows4.dequantize(torch.float32), want)
    lin4 = Linear(64, 16, False, torch.float32)
    lin4.scheme = WeightScheme("int4", kernel_dtype=torch.float32)
    lin4.load_rows(0, rows4)
    assert lin4.weight_format == "int4"
    assert torch.equal(_served_weight(lin4), want)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
    reason="needs a CUDA device and compiled (not interpreted) Triton",
)
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_gguf_model_on_gpu_runs_the_triton_int4_gemm(
    tiny_gguf, monkeypatch, random_prompts, hf_greedy, enforce_eager
) -> None:
    """On CUDA the Q4_0/Q4_1 rows stay packed for the Triton dequant-GEMM (Q8_0 and F16
    rows are dequantized): greedy tokens as transformers' dequantized model, eager and
    with CUDA graphs (the GEMM is an opaque op inside the captured step)."""
    from pagemill.runtime.worker.compilation import ENFORCE_EAGER_ENV

    folder, path, ref = tiny_gguf
    monkeypatch.setattr(loader_module, "gguf_for_folder", lambda folder: path)
    monkeypatch.delenv(ENFORCE_EAGER_ENV, raising=False)
    llm = LLM(
        str(folder),
        device="cuda",
        dtype="float16",  # more mantissa than bf16: no greedy ties flipped by rounding
        enforce_eager=enforce_eager,
        kv_cache_memory_bytes=16 << 20,
    )
    model = llm.llm_engine.engine_core.model_runner.model
    layer0 = model.layers[0]
    assert layer0.self_attn.qkv_proj.weight_format == "triton_int4"  # Q4_1 + Q4_0 rows
    assert layer0.self_attn.o_proj.weight_format == "dense"  # Q8_0
    assert layer0.self_attn.qkv_proj.qweight.is_cuda
    prompts = random_prompts([3, 17, 40], ref.config.vocab_size, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, 8)


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_int4_dequantization_is_the_fused_multiply_add(scale_dtype: torch.dtype) -> None:
    # The dense copies and the kernel's reference: fma(q - 8, scale, zero) in fp32, one
    # rounding, whether computed in place (scales of 16 bits or fewer) or by the fma.
    from pagemill.runtime.model_executor.quantization.formats import Int4Groups, _int4_fp32

    torch.manual_seed(0)
    n, k, g = 48, 256, 32
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales = torch.randn(n, k // g) * 0.01
    zeros = torch.randn(n, k // g) * 0.1
    s = scales.to(scale_dtype).float().repeat_interleave(g, dim=1)
    z = zeros.to(scale_dtype).float().repeat_interleave(g, dim=1)
    expected = torch.addcmul(z, q.float() - 8, s)
    assert torch.equal(_int4_fp32(q, scales, zeros, g, scale_dtype), expected)
    rows = Int4Groups(q, scales, zeros, g)
    perm = torch.randperm(n)
    moved = rows.index_rows(perm)
    assert torch.equal(moved.q, q[perm]) and torch.equal(moved.scales, scales[perm])
    assert torch.equal(moved.zeros, zeros[perm])
