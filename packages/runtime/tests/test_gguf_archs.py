"""GGUF files of every architecture pagemill serves, written as llama.cpp's converter writes
them, generate like the model they came from; split files load from any shard.

Each case is a tiny random transformers model (fp32) written with `gguf.GGUFWriter` the way
`convert_hf_to_gguf.py` does for its architecture: the same metadata keys, q/k rows permuted
for llama and the converter's LlamaModel subclasses Granite and SmolLM3 (Mistral is written
as llama, as llama.cpp has no Mistral architecture; OLMo 2's converter permutes nothing), Gemma's
norms stored as w + 1 and its LM head left out, Phi-3's fused qkv / gate_up kept fused, llama3
RoPE scaling as a `rope_freqs` tensor, 2-D tensors in the case's type and norms in F32.

References, none of them pagemill's code:
- transformers' own GGUF reader (`from_pretrained(gguf_file=...)`, which dequantizes and
  undoes the conventions) must give the weights the file was written from — this checks
  the writer here against an independent reading of llama.cpp's conventions;
- the original transformers model with those weights (each 2-D tensor through the `gguf`
  package's quantize/dequantize) is the reference for logits at every prompt position and
  for greedy tokens; for llama, Mistral and Qwen3, whose configs transformers reads from a
  GGUF correctly, transformers' GGUF model itself must generate the same tokens too
  (for Gemma and Phi-3 it drops soft-caps, the query scale, the window and partial RoPE);
- transformers has no GGUF reader for Granite, SmolLM3 or OLMo 2: those files are checked
  against the original model (logits, greedy tokens) and its own tokenizer only.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pagemill.runtime import LLM, SamplingParams
from pagemill.runtime.model_config import FULL, SLIDING
from pagemill.runtime.model_executor.model_source import resolve_model

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
QT = gguf.GGMLQuantizationType

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 10000.0,
}

# case -> (HF family, GGUF architecture, tensor type, overrides of the tiny config)
CASES: dict[str, tuple[str, str, Any, dict[str, Any]]] = {
    "llama3-F16": ("llama", "llama", QT.F16, {"rope_parameters": LLAMA3}),
    "mistral-F32": ("mistral", "llama", QT.F32, {}),
    "qwen3-Q8_0": ("qwen3", "qwen3", QT.Q8_0, {"tie_word_embeddings": True}),
    "phi3-F16": ("phi3", "phi3", QT.F16, {"sliding_window": 12, "partial_rotary_factor": 0.5}),
    "gemma2-Q8_0": (
        "gemma2",
        "gemma2",
        QT.Q8_0,
        dict(
            head_dim=16,
            sliding_window=10,
            query_pre_attn_scalar=16,  # llama.cpp's rule below 27B: head_dim
            attn_logit_softcapping=2.0,
            final_logit_softcapping=5.0,
            tie_word_embeddings=True,
        ),
    ),
    "gemma3-Q4_0": (
        "gemma3",
        "gemma3",
        QT.Q4_0,
        dict(
            head_dim=16,
            num_hidden_layers=6,  # llama.cpp's fixed pattern: five windowed layers, one global
            sliding_window=9,
            query_pre_attn_scalar=16,
            final_logit_softcapping=5.0,
            tie_word_embeddings=True,
            rope_parameters={
                FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                SLIDING: {"rope_type": "default", "rope_theta": 10000.0},  # llama.cpp's fixed
            },
        ),
    ),
}
CASES.update(
    {
        "granite-F16": (
            "granite",
            "granite",
            QT.F16,
            dict(
                embedding_multiplier=3.0,
                residual_multiplier=0.5,
                attention_multiplier=0.2,
                logits_scaling=2.5,
            ),
        ),
        # Four layers: llama.cpp drops RoPE from layer 3 (its fixed step), as this config does.
        "smollm3-Q4_0": ("smollm3", "smollm3", QT.Q4_0, dict(num_hidden_layers=4)),
        "olmo2-Q8_0": ("olmo2", "olmo2", QT.Q8_0, {}),
        "olmo2-F32": ("olmo2", "olmo2", QT.F32, {"tie_word_embeddings": True}),
    }
)
# Q5_0 goes through the one-time dense copy (transformers' GGUF loader) for now.
CASES["gemma2-Q5_0"] = ("gemma2", "gemma2", QT.Q5_0, CASES["gemma2-Q8_0"][3])
TRANSFORMERS_READS_CONFIG = ("llama", "mistral", "qwen3")
# Written with llama's q/k row permutation: the architectures convert_hf_to_gguf converts
# with its LlamaModel (GraniteModel and SmolLM3Model subclass it; Olmo2Model does not).
LLAMA_CONVERTER = ("llama", "granite", "smollm3")


def _transformers_reads(arch: str) -> bool:
    """Whether transformers' own GGUF loader knows the architecture (it has no Granite,
    SmolLM3 or OLMo 2 reader: those cases compare with the original model and tokenizer)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    return arch in GGUF_CONFIG_MAPPING


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _llama3_rope_freqs(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.generate_extra_tensors for llama3 scaling."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _roundtrip(data: np.ndarray, qtype: Any) -> np.ndarray:
    if qtype == QT.F32:
        return data
    if qtype == QT.F16:
        return data.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype)


def _write_tokenizer(w: Any, tokenizer_dir: Path, eos: int) -> None:
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
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
    w.add_eos_token_id(eos)
    w.add_pad_token_id(eos)  # as real files have one (transformers' Phi-3 default is 32000)
    w.add_chat_template(TEMPLATE)


def _write_params(w: Any, family: str, arch: str, c: Any) -> None:
    """The metadata convert_hf_to_gguf writes for `arch` (TextModel's common keys first)."""
    rope = c.rope_parameters.get(FULL, c.rope_parameters)
    w.add_name(f"tiny {family}")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if arch in ("qwen3", "gemma2", "gemma3"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") == "yarn" and arch == "olmo2":  # Olmo2Model's own keys
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_attn_factors(rope["attention_factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("attention_factor") is not None:
            w.add_rope_scaling_yarn_attn_factor(rope["attention_factor"])
        if rope.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if rope.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if arch in LLAMA_CONVERTER:
        w.add_vocab_size(c.vocab_size)
        w.add_rope_dimension_count(head_dim)
    if arch == "granite":  # GraniteModel: each multiplier only where the config sets it
        for value, add in (
            (c.attention_multiplier, w.add_attention_scale),
            (c.embedding_multiplier, w.add_embedding_scale),
            (c.residual_multiplier, w.add_residual_scale),
            (c.logits_scaling, w.add_logit_scale),
        ):
            if value:
                add(value)
    elif arch == "phi3":
        w.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
        if rope.get("rope_type") == "longrope":
            w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
            scale = c.max_position_embeddings / c.original_max_position_embeddings
            w.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(c.original_max_position_embeddings))
            )
        rot_pct = getattr(c, "partial_rotary_factor", None) or rope.get(
            "partial_rotary_factor", 1.0
        )
        w.add_rope_dimension_count(int(rot_pct * c.hidden_size) // c.num_attention_heads)
        w.add_sliding_window(c.sliding_window or 0)
    elif arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
        w.add_sliding_window(c.sliding_window)
    elif arch == "gemma3":
        if c.final_logit_softcapping:
            w.add_final_logit_softcapping(c.final_logit_softcapping)
        w.add_sliding_window(c.sliding_window)


def write_llamacpp_gguf(
    model: torch.nn.Module,
    tokenizer_dir: Path,
    path: Path,
    family: str,
    arch: str,
    qtype: Any,
    split_max_tensors: int = 0,
    write_tokenizer: Any = None,
) -> dict[str, torch.Tensor]:
    """Write `model` as llama.cpp would; returns the HF state dict the file holds (2-D
    tensors through the type's quantize/dequantize), the reference's weights."""
    c = model.config
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    _write_params(w, family, arch, c)
    if write_tokenizer is None:
        _write_tokenizer(w, tokenizer_dir, c.eos_token_id)
    else:
        write_tokenizer(w)
    names = gguf.get_tensor_name_map(
        {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], c.num_hidden_layers
    )
    held: dict[str, torch.Tensor] = {}
    for hf, t in model.state_dict().items():
        if hf == "lm_head.weight" and (c.tie_word_embeddings or arch.startswith("gemma")):
            continue
        name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf
        data = t.detach().float().numpy()
        stored_type = qtype if data.ndim == 2 else QT.F32  # llama.cpp keeps 1-D tensors F32
        held[hf] = torch.from_numpy(_roundtrip(data, stored_type).copy())
        if arch in LLAMA_CONVERTER and ".attn_q." in name:
            data = _permute(data, c.num_attention_heads)
        elif arch in LLAMA_CONVERTER and ".attn_k." in name:
            data = _permute(data, c.num_key_value_heads)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1
        if stored_type in (QT.F32, QT.F16):
            w.add_tensor(name, data.astype(np.float16 if stored_type == QT.F16 else np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(data, stored_type), raw_dtype=stored_type)
    rope = c.rope_parameters
    if arch == "phi3" and rope.get("rope_type") == "longrope":
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    if arch in LLAMA_CONVERTER and rope.get("rope_type") == "llama3":
        w.add_tensor(
            "rope_freqs.weight", _llama3_rope_freqs(rope, c.hidden_size // c.num_attention_heads)
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


class _Files(dict):
    """(GGUF file, reference model) per case, made on first use."""

    def __init__(self, factory: Any, build: Any) -> None:
        super().__init__()
        self.factory, self.build = factory, build
        self.hf_dirs: dict[str, Path] = {}

    def __missing__(self, key: str) -> tuple[Path, torch.nn.Module]:
        family, arch, qtype, overrides = CASES[key]
        hf_dir = self.factory.mktemp(f"hf-{key}")
        model = self.build(hf_dir, family, seed=21, **overrides)
        path = self.factory.mktemp(f"gguf-{key}") / f"tiny-{key}.gguf"
        held = write_llamacpp_gguf(model, hf_dir, path, family, arch, qtype)
        model.load_state_dict(held, strict=False)  # strict=False: a tied head is the embedding
        self.hf_dirs[key] = hf_dir
        self[key] = (path, model.eval())
        return self[key]


@pytest.fixture(scope="module")
def files(tmp_path_factory, build_tiny_model) -> _Files:
    return _Files(tmp_path_factory, build_tiny_model)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PAGEMILL_CACHE_DIR", str(tmp_path / "cache"))


def _transformers_gguf(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


@pytest.mark.parametrize("key", list(CASES))
def test_gguf_architecture_generates_like_transformers(
    files, key, random_prompts, hf_greedy, all_logits
) -> None:
    family, arch = CASES[key][:2]
    path, ref = files[key]
    theirs = None
    if _transformers_reads(arch):
        # The writer follows the conventions transformers' GGUF reader undoes.
        theirs = _transformers_gguf(path)
        their_weights = theirs.state_dict()
        for name, value in ref.state_dict().items():
            if name in their_weights and not name.endswith("inv_freq"):
                torch.testing.assert_close(their_weights[name], value, rtol=0, atol=1e-6, msg=name)

    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=1 << 22)
    assert llm.llm_engine.model_config.architecture == type(ref).__name__.replace(
        "Mistral", "Llama"
    )
    prompts = random_prompts([5, 23, 40], ref.config.vocab_size, seed=4)
    runner = llm.llm_engine.engine_core.model_runner
    with torch.no_grad():
        for prompt, got in zip(prompts, all_logits(runner, prompts)):
            want = ref(torch.tensor([prompt])).logits[0]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, 8)
        if theirs is not None and family in TRANSFORMERS_READS_CONFIG:
            assert out.outputs[0].token_ids == hf_greedy(theirs, prompt, 8)

    # Tokenizer and chat template from the file, as transformers reads them (or, for the
    # architectures its GGUF reader lacks, as the original tokenizer the file was made of).
    tok = llm.get_tokenizer()
    if theirs is not None:
        hf_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    else:
        hf_tok = transformers.AutoTokenizer.from_pretrained(str(files.hf_dirs[key]))
    assert tok.chat_template == TEMPLATE
    for text in ("hello world, héllo 中文 😀", "the quick brown fox<eos> jumps"):
        assert tok.encode(text) == hf_tok.encode(text)


def test_split_gguf_loads_from_any_shard_or_its_folder(
    tmp_path_factory, build_tiny_model, random_prompts, hf_greedy
) -> None:
    hf_dir = tmp_path_factory.mktemp("hf-split")
    model = build_tiny_model(hf_dir, "qwen3", seed=5, tie_word_embeddings=True)
    folder = tmp_path_factory.mktemp("split")
    held = write_llamacpp_gguf(
        model, hf_dir, folder / "tiny.gguf", "qwen3", "qwen3", QT.Q8_0, split_max_tensors=8
    )
    model.load_state_dict(held, strict=False)
    shards = sorted(folder.glob("*.gguf"))
    n = len(shards)
    assert n >= 3 and [p.name for p in shards] == [
        f"tiny-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)
    ]

    first = resolve_model(str(shards[0]))
    assert first.kind == "gguf" and first.gguf == shards[0]
    assert resolve_model(str(shards[2])).folder == first.folder  # any shard names the model
    assert resolve_model(str(folder)).folder == first.folder  # so does the folder
    llm = LLM(str(shards[1]), dtype="float32", kv_cache_memory_bytes=1 << 22)
    prompts = random_prompts([6, 30], model.config.vocab_size, seed=8)
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert out.outputs[0].token_ids == hf_greedy(model.eval(), prompt, 8)
    assert llm.get_tokenizer().chat_template == TEMPLATE  # the first shard's metadata

    (folder / "other.gguf").write_bytes(shards[0].read_bytes())
    with pytest.raises(ValueError, match=r"several GGUF models \(other\.gguf, tiny-\*-of-"):
        resolve_model(str(folder))
    shards[2].rename(folder / "elsewhere.bin")
    gone = rf"missing.*tiny-00003-of-{n:05d}\.gguf"
    with pytest.raises(ValueError, match=gone):
        resolve_model(str(shards[0]))
    with pytest.raises(ValueError, match=gone):
        resolve_model(str(shards[1]))


def test_split_shard_of_another_model_is_refused(tmp_path, build_tiny_model) -> None:
    model = build_tiny_model(tmp_path / "hf", "llama", seed=6)
    for name, layers in (("a", 8), ("b", 5)):
        (tmp_path / name).mkdir()
        write_llamacpp_gguf(
            model, tmp_path / "hf", tmp_path / name / "m.gguf", "llama", "llama", QT.F32, layers
        )
    a, b = sorted((tmp_path / "a").glob("*.gguf")), sorted((tmp_path / "b").glob("*.gguf"))
    assert len(a) != len(b)
    a[1].write_bytes(b[1].read_bytes())  # shard 2 of a split into another number of files
    with pytest.raises(ValueError, match=r"m-00002-of-0000\d\.gguf is not shard 2 of"):
        resolve_model(str(a[0]))


def _sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """A small sentencepiece vocabulary as llama.cpp stores one (`tokenizer.ggml.model`
    "llama"): specials, the 256 byte-fallback tokens, pieces with "▁" for spaces."""
    tt = gguf.TokenType
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [tt.UNKNOWN, tt.CONTROL, tt.CONTROL] + [tt.BYTE] * 256
    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyz,"]
    pieces += ["▁t", "th", "he", "▁th", "▁the", "ll", "lo", "llo", "▁h", "▁he", "▁hel"]
    pieces += ["▁hello", "▁w", "or", "▁wor", "ld", "▁world", "▁q", "ui", "▁qui", "ck", "▁quick"]
    tokens += pieces
    types += [tt.NORMAL] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, scores, [int(t) for t in types]


@pytest.mark.parametrize(
    "family,arch", [("llama", "llama"), ("phi3", "phi3"), ("gemma2", "gemma2")]
)
def test_sentencepiece_tokenizer_from_the_file(tmp_path, build_tiny_model, family, arch) -> None:
    """A sentencepiece vocabulary (what Llama 2, Mistral, Phi-3 and Gemma files hold), which
    transformers builds per architecture: pagemill's tokenizer encodes as transformers' GGUF
    tokenizer does, byte fallback and BOS included, and keeps the file's chat template."""
    from pagemill.runtime.model_executor.loader import load_tokenizer

    tokens, scores, types = _sentencepiece_vocab()

    def write(w: Any) -> None:
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_chat_template(TEMPLATE)

    extra = {"head_dim": 16, "query_pre_attn_scalar": 16} if arch == "gemma2" else {}
    model = build_tiny_model(
        tmp_path / "hf", family, seed=1, vocab_size=len(tokens), eos_token_id=2, **extra
    )
    path = tmp_path / "spm.gguf"
    write_llamacpp_gguf(model, tmp_path / "hf", path, family, arch, QT.F16, write_tokenizer=write)
    tok = load_tokenizer(str(resolve_model(str(path)).folder))
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert tok is not None and tok.chat_template == TEMPLATE
    for text in ("hello world", "the quick, héllo 中文 😀", "  two  spaces", "</s>hello"):
        assert tok.encode(text) == hf_tok.encode(text), text
        assert tok.decode(tok.encode(text)) == hf_tok.decode(hf_tok.encode(text))


def test_hub_quant_that_is_a_split_set(tmp_path, monkeypatch, build_tiny_model) -> None:
    """`org/name-GGUF:Q8_0` where that quantization is split (as large Hub GGUFs are, in a
    folder of their own): the set is the model, named by its first shard."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = build_tiny_model(tmp_path / "model", "llama", seed=2)
    written = tmp_path / "written"
    written.mkdir()
    write_llamacpp_gguf(
        model, tmp_path / "model", written / "tiny-Q8_0.gguf", "llama", "llama", QT.Q8_0, 7
    )
    repo = tmp_path / "hf" / "hub" / "models--tiny-org--tiny-GGUF"
    snapshot = repo / "snapshots" / ("a" * 40)
    (snapshot / "Q8_0").mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, shard in enumerate(sorted(written.glob("*.gguf"))):
        blob = repo / "blobs" / f"{i:064x}"
        blob.write_bytes(shard.read_bytes())
        (snapshot / "Q8_0" / shard.name).symlink_to(blob)  # as huggingface_hub stores files
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    source = resolve_model("tiny-org/tiny-GGUF:Q8_0")
    assert source.gguf is not None and source.gguf.name.startswith("tiny-Q8_0-00001-of-")
    assert json.loads((source.folder / "config.json").read_text())["num_hidden_layers"] == 2


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
        {
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 256,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "attention_factor": 1.2,
        },
    ],
)
def test_yarn_scaling_is_read_back(tmp_path, build_tiny_model, rope) -> None:
    """Qwen3's long-context YaRN as convert_hf_to_gguf stores it: the config built from the
    file has the RoPE the original config.json has (serving it is the RoPE table's)."""
    rope = {**rope, "rope_theta": 100000.0}
    model = build_tiny_model(tmp_path / "hf", "qwen3", seed=3, rope_parameters=rope)
    _check_rope_read_back(tmp_path, model, "qwen3")


def test_olmo2_yarn_is_read_back(tmp_path, build_tiny_model) -> None:
    """OLMo 2's converter stores yarn's attention factor under `rope.scaling.attn_factor`."""
    rope = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "attention_factor": 1.25,
        "rope_theta": 100000.0,
    }
    model = build_tiny_model(tmp_path / "hf", "olmo2", seed=3, rope_parameters=rope)
    _check_rope_read_back(tmp_path, model, "olmo2")


def test_phi3_longrope_is_read_back(tmp_path, build_tiny_model) -> None:
    """Phi-3 128k's longrope: factors as rope_factors_long/short tensors, the attention
    factor llama.cpp computes, the original context length."""
    g = np.random.default_rng(0)
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": (1 + g.random(8)).round(3).tolist(),
        "long_factor": (2 + 10 * g.random(8)).round(3).tolist(),
    }
    model = build_tiny_model(
        tmp_path / "hf",
        "phi3",
        seed=3,
        rope_parameters=rope,
        original_max_position_embeddings=128,
    )
    _check_rope_read_back(tmp_path, model, "phi3")


def _check_rope_read_back(tmp_path: Path, model: torch.nn.Module, arch: str) -> None:
    from pagemill.runtime.model_config import ModelConfig

    path = tmp_path / "rope.gguf"
    write_llamacpp_gguf(model, tmp_path / "hf", path, arch, arch, QT.F32)
    ours = ModelConfig.from_pretrained(resolve_model(str(path)).folder)
    original = ModelConfig.from_pretrained(tmp_path / "hf")
    assert ours.rope_theta == original.rope_theta
    assert ours.rope_scaling is not None and original.rope_scaling is not None
    assert ours.rope_scaling.keys() == original.rope_scaling.keys()
    for key, value in original.rope_scaling.items():  # GGUF stores floats as float32
        assert ours.rope_scaling[key] == (value if isinstance(value, str) else pytest.approx(value))
    for key in ("original_max_position_embeddings", "max_position_embeddings"):
        assert ours.hf_config.get(key) == original.hf_config.get(key)


def test_granite_without_multipliers_reads_as_llamacpp_serves_it(
    tmp_path, build_tiny_model
) -> None:
    """GraniteModel writes each multiplier only where the config sets one; llama.cpp then
    scores with 1/sqrt(head_dim) (its `kq_scale` default) and scales nothing else."""
    from pagemill.runtime.model_config import ModelConfig

    model = build_tiny_model(tmp_path / "hf", "granite", seed=3)
    for key in ("attention_multiplier", "embedding_multiplier", "residual_multiplier"):
        setattr(model.config, key, 0.0)
    model.config.logits_scaling = 0.0
    path = tmp_path / "granite.gguf"
    write_llamacpp_gguf(model, tmp_path / "hf", path, "granite", "granite", QT.F32)
    raw = ModelConfig.from_pretrained(resolve_model(str(path)).folder).hf_config
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    assert raw["attention_multiplier"] == pytest.approx(head_dim**-0.5)
    assert [raw[k] for k in ("embedding_multiplier", "residual_multiplier", "logits_scaling")] == [
        1.0,
        1.0,
        1.0,
    ]


def test_olmo2_file_with_a_window_is_refused(tmp_path, build_tiny_model) -> None:
    """convert_hf_to_gguf writes OLMo 3 as `olmo2` plus a sliding window and pattern;
    pagemill serves OLMo 2, so such a file is refused rather than served without it."""
    model = build_tiny_model(tmp_path / "hf", "olmo2", seed=3)

    def write(w: Any) -> None:
        _write_tokenizer(w, tmp_path / "hf", model.config.eos_token_id)
        w.add_sliding_window(16)
        w.add_sliding_window_pattern([True, False])

    path = tmp_path / "olmo3.gguf"
    write_llamacpp_gguf(
        model, tmp_path / "hf", path, "olmo2", "olmo2", QT.F32, write_tokenizer=write
    )
    with pytest.raises(ValueError, match=r"sliding window.*OLMo 3"):
        resolve_model(str(path))
