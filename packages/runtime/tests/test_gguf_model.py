"""A `.gguf` file is a model: config, tokenizer and chat template come from the file alone.

Tiny random transformers models are written as self-contained GGUF files with gguf's own
writer (metadata, the BPE tokenizer, a chat template; q/k rows permuted for llama as
llama.cpp's converter does), in F32, Q8_0 and Q5_0, and served by path. The reference is
transformers loading the same file (it dequantizes exactly as ggml does) in fp32.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from pagemill.runtime import LLM, SamplingParams
from pagemill.runtime.model_executor.gguf_model import (
    GGUF_ARCHITECTURES,
    gguf_file_for_folder,
)
from pagemill.runtime.model_executor.model_source import resolve_model

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
QT = gguf.GGMLQuantizationType

# Not the tiny tokenizer's own template: what the engine renders with must be the file's.
GGUF_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(
    model: torch.nn.Module,
    tokenizer_dir: Path,
    path: Path,
    qtype=QT.F32,
    arch: str = "llama",
    chat_template: str | None = GGUF_TEMPLATE,
) -> Path:
    """`model` (a tiny HF llama / qwen2) as one GGUF file; 2-D weights in `qtype`."""
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = {t: i for t, i in tok["model"]["vocab"].items()}
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["id"] for a in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(
        [
            gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
            for i in range(len(tokens))
        ]
    )
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_eos_token_id(c.eos_token_id)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    names = gguf.get_tensor_name_map(
        {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], c.num_hidden_layers
    )
    for hf, t in model.state_dict().items():
        if hf == "lm_head.weight" and c.tie_word_embeddings:
            continue
        name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        data = t.detach().float().numpy()
        if arch == "llama" and ".attn_q." in name:
            data = _permute(data, c.num_attention_heads)
        elif arch == "llama" and ".attn_k." in name:
            data = _permute(data, c.num_key_value_heads)
        if data.ndim == 2 and qtype != QT.F32:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _reference(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


_FILES = {
    "llama-F32": ("llama", QT.F32, 11, {}),
    "llama-Q8_0": ("llama", QT.Q8_0, 12, {}),
    "qwen2-F32": ("qwen2", QT.F32, 13, {"tie_word_embeddings": True}),
    "llama-Q5_0": ("llama", QT.Q5_0, 14, {}),
}


class _Files(dict):
    """GGUF files made on first use (the HF folders they came from are not used again)."""

    def __init__(self, factory, build) -> None:
        super().__init__()
        self.factory, self.build = factory, build

    def __missing__(self, key: str) -> Path:
        arch, qtype, seed, extra = _FILES[key]
        hf_dir = self.factory.mktemp(f"hf-{key}")
        model = self.build(hf_dir, arch, seed=seed, **extra)
        files = self.factory.mktemp(f"gguf-{key}")
        self[key] = write_gguf(model, hf_dir, files / f"tiny-{key}.gguf", qtype, arch)
        return self[key]


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory, build_tiny_model) -> dict[str, Path]:
    return _Files(tmp_path_factory, build_tiny_model)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PAGEMILL_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("key", ["llama-F32", "llama-Q8_0", "qwen2-F32", "llama-Q5_0"])
def test_gguf_file_generates_like_transformers(tiny_ggufs, key, random_prompts, hf_greedy) -> None:
    path = tiny_ggufs[key]
    ref = _reference(path)
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=1 << 20)
    engine = llm.llm_engine
    assert engine.model_config.architecture == GGUF_ARCHITECTURES[key.split("-")[0]]
    prompts = random_prompts([3, 17, 40], ref.config.vocab_size, seed=7)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, 8)
    # Every type is read from the file itself: no dense copy is written next to the config.
    assert not (engine.model_path / "model.safetensors").exists()


def test_tokenizer_and_chat_template_come_from_the_file(tiny_ggufs, tmp_path) -> None:
    path = tiny_ggufs["llama-F32"]
    source = resolve_model(str(path))
    assert source.kind == "gguf" and source.gguf == path
    assert resolve_model(str(path)).folder == source.folder  # extracted once, then reused
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(path.read_bytes())
    first = resolve_model(str(copy)).folder
    os.utime(copy, ns=(1, 1))  # the file changed: its old folder is not trusted any more
    with pytest.raises(RuntimeError, match=r"changed .* since"):
        gguf_file_for_folder(first)
    assert resolve_model(str(copy)).folder != first
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=1 << 20)
    tok = llm.get_tokenizer()
    assert tok.chat_template == GGUF_TEMPLATE
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = "hello world, héllo 中文 😀"
    assert tok.encode(text) == hf_tok.encode(text)
    messages = [{"role": "user", "content": "hello engine"}]
    [out] = llm.chat(messages, GREEDY, use_tqdm=False)
    assert out.prompt_token_ids == tok.encode(
        "[user] hello engine\n[assistant] ", add_special_tokens=False
    )


def _q8_0_format() -> str:
    from pagemill.kernels import gemv_q8_cpu
    from pagemill.runtime.model_executor.layers.linear import Linear

    return "q8_0" if Linear.int8_activations and gemv_q8_cpu.available() else "int4x2"


def test_q8_0_stays_packed_in_bf16(tiny_ggufs) -> None:
    llm = LLM(str(tiny_ggufs["llama-Q8_0"]), dtype="bfloat16", kv_cache_memory_bytes=1 << 20)
    model = llm.llm_engine.engine_core.model_runner.model
    # Q8_0 as int8 blocks for `gemv_q8` (int8 activations, the CPU default), else two int4
    # planes for PyTorch's kernel.
    assert model.layers[0].self_attn.qkv_proj.weight_format == _q8_0_format()
    [out] = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 8


def _minimal_gguf(path: Path, arch: str, tensor: np.ndarray) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_gguf_architecture_and_type_say_what_is_supported(tmp_path) -> None:
    bloom = _minimal_gguf(tmp_path / "b.gguf", "bloom", np.zeros((4, 32), np.float32))
    with pytest.raises(
        ValueError, match=r"GGUF architecture 'bloom'.*not supported.*llama, qwen2, qwen3, phi3"
    ):
        resolve_model(str(bloom))
    ints = _minimal_gguf(tmp_path / "i.gguf", "llama", np.zeros((4, 32), np.int8))
    with pytest.raises(ValueError, match=r"GGML type\(s\) I8.*supported: Q4_0.*Q4_K.*F32"):
        resolve_model(str(ints))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        resolve_model(str(junk))


def test_hub_gguf_repo_with_quant_suffix(
    tiny_ggufs, tmp_path, monkeypatch, random_prompts, hf_greedy
) -> None:
    """`org/name:Q8_0` (vLLM's spelling) serves that one file of a GGUF repository in the
    Hub cache (a snapshot file linking to its blob, as huggingface_hub stores it)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    src = tiny_ggufs["llama-Q8_0"]
    repo = tmp_path / "hf" / "hub" / "models--tiny-org--tiny-GGUF"
    snapshot = repo / "snapshots" / ("d" * 40)
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    blob = repo / "blobs" / ("e" * 64)
    blob.write_bytes(src.read_bytes())
    (snapshot / "tiny-llama.Q8_0.gguf").symlink_to(blob)
    (snapshot / "tiny-llama.F16.gguf").symlink_to(blob)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("d" * 40)
    llm = LLM("tiny-org/tiny-GGUF:Q8_0", dtype="float32", kv_cache_memory_bytes=1 << 20)
    assert llm.llm_engine.model_path.name.startswith("tiny-llama.Q8_0-")
    ref = _reference(src)
    prompts = random_prompts([5, 12], ref.config.vocab_size, seed=9)
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, 8)
    with pytest.raises(
        ValueError,
        match=r"exactly one \.gguf file \(or one split set\) of quantization .Q4_K_M.*none",
    ):
        resolve_model("tiny-org/tiny-GGUF:Q4_K_M")
    with pytest.raises(ValueError, match=r"no config\.json.*'tiny-org/tiny-GGUF:QUANT'"):
        resolve_model("tiny-org/tiny-GGUF")


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_auto_fp32_keeps_a_gguf_packed_where_bf16_is_emulated(tiny_ggufs, monkeypatch, dtype):
    """On a CPU without bf16 arithmetic, auto serves fp32: a GGUF's rows stay packed for
    few-row steps (dense fp32 copies above), where an explicit float32 is dense and exact."""
    import pagemill.runtime.config as config_module

    monkeypatch.setattr(config_module, "cpu_has_native_bf16", lambda: False)
    llm = LLM(str(tiny_ggufs["llama-Q8_0"]), dtype=dtype, kv_cache_memory_bytes=1 << 20)
    core = llm.llm_engine.engine_core
    assert core.dtype == torch.float32
    qkv = core.model_runner.model.layers[0].self_attn.qkv_proj
    if dtype == "float32":
        assert qkv.weight_format == "dense"
    else:
        assert qkv.weight_format != "dense" and qkv.has_dense_fallback
        assert qkv.weight is not None and qkv.weight.dtype == torch.float32
        x = torch.randn(3, qkv.in_features, generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            packed, dense = qkv._packed(x), qkv._dense(x)
        assert packed.dtype == torch.float32
        # int8 activations against the exact dequantized weight
        torch.testing.assert_close(packed, dense, rtol=0.05, atol=0.05 * dense.abs().max().item())
    [out] = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 8
