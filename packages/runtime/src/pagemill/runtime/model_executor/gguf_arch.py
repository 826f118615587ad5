"""What llama.cpp's converter does to each architecture, and how to undo it.

`convert_hf_to_gguf.py` renames tensors (the `gguf` package's tensor name map, which the
reader uses as is) and, for some architectures, changes them or leaves facts out of the
file. One record per architecture (`GGUF_ARCHS`) says what, and `config_from_gguf` rebuilds
the Hugging Face config.json from the file's metadata and tensor table — transformers' own
GGUF config reader misses what pagemill needs (Gemma's soft-caps, query scale and local
RoPE base, Qwen3's head_dim, Phi-3's window and partial RoPE, llama3 RoPE scaling).

Per architecture:

- llama (Llama, Mistral — llama.cpp has no separate Mistral architecture): q/k rows (and
  biases) permuted for llama.cpp's interleaved RoPE; llama3 RoPE scaling stored only as a
  per-dimension `rope_freqs` tensor, from which the HF parameters are recovered and checked.
- qwen2, qwen3: tensors renamed only (NEOX RoPE, no permutation); Qwen3's q/k norms are
  `attn_q_norm` / `attn_k_norm`; head_dim is `attention.key_length`.
- phi3: fused `attn_qkv` ([q; k; v]) and `ffn_up` ([gate; up]) kept fused, as the model
  code computes; partial RoPE from `rope.dimension_count`; `attention.sliding_window` 0
  means none; longrope factors as `rope_factors_long/short` tensors.
- gemma2, gemma3: every `*norm.weight` stored as w + 1 (the model's `x * (1 + w)`); the
  embedding is stored unscaled (the model scales by sqrt(hidden) itself); the query scale
  is not stored — llama.cpp derives it from the size (head_dim, but hidden / heads for the
  27B models); Gemma 2 alternates windowed layers, Gemma 3 windows five in six with a
  fixed local RoPE base of 10k, unless the file says otherwise.
- granite: llama's conventions (the converter is llama's); its four multipliers are
  `attention.scale`, `embedding_scale`, `residual_scale` and `logit_scale`, each written
  only when the config sets it — without one llama.cpp scales scores by head_dim ** -0.5
  and leaves the rest unscaled. head_dim is always hidden / heads (the converter drops it).
- smollm3: llama's conventions; which layers skip RoPE is not stored — llama.cpp drops it
  from every fourth layer (layers 3, 7, ...), as SmolLM3's released configs do.
- llama with experts (Mixtral — llama.cpp writes it as llama): `expert_count` /
  `expert_used_count`, `feed_forward_length` each expert's; served as Mixtral.
- qwen2moe, qwen3moe, olmoe: `expert_count` / `expert_used_count`; Qwen's routed experts
  `expert_feed_forward_length` (`feed_forward_length` is the config's intermediate_size),
  Qwen2-MoE's shared expert `expert_shared_feed_forward_length`. Every layer is sparse (the
  format has no dense-MLP tensors for them: no `mlp_only_layers`). `norm_topk_prob` is not
  stored: llama.cpp renormalises the top-k weights for qwen3moe and Mixtral, not for
  qwen2moe or olmoe, whatever the original config said.
- every MoE: a layer's experts are stacked into one tensor per projection
  (`ffn_{gate,up,down}_exps`, [E, rows, in]), which `gguf_weights` hands out per expert.
- olmo2: tensors renamed only (NEOX RoPE; the converter is not llama's, nothing permuted);
  q/k norms over the whole projection are `attn_q_norm` / `attn_k_norm`, the post-norms
  `post_attention_norm` / `post_ffw_norm`. A window (`attention.sliding_window`) means
  the file was converted from OLMo 3, which is refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagemill.runtime.model_config import FULL, SLIDING
from pagemill.runtime.model_executor.quantization.formats import QuantizedRows, dequantize

# llama.cpp's defaults where a key is optional (llama_hparams / the per-arch loaders).
_GEMMA2_ATTN_SOFTCAP = 50.0
_GEMMA2_FINAL_SOFTCAP = 30.0
_GEMMA_LOCAL_ROPE_BASE = 10000.0
# llama.cpp's layer counts of the Gemma 27B models, whose query scale is hidden / heads.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Llama 3.1 / 3.2 / 3.3's llama3 RoPE parameters besides the factor; a `rope_freqs` tensor
# is matched against these and refused if it follows none.
_LLAMA3_CANDIDATES = ((1.0, 4.0, 8192),)
# llama.cpp's SmolLM3 graph: every n-th layer without RoPE, a constant, not a file key.
_SMOLLM3_NO_ROPE_STEP = 4


class Metadata:
    """A GGUF file's key/value metadata, read lazily (token lists are large), and its
    tensor table: name -> (GGUF shape, innermost first) plus readers for small tensors."""

    def __init__(
        self,
        fields: Mapping[str, Any],
        shapes: Mapping[str, tuple[int, ...]],
        read_tensor: Callable[[str], np.ndarray],
    ) -> None:
        self._fields = fields
        self.shapes = dict(shapes)
        self._read_tensor = read_tensor
        self.arch = str(self.get("general.architecture"))

    def get(self, key: str, default: Any = None) -> Any:
        f = self._fields.get(key)
        return default if f is None else f.contents()

    def arch_key(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{key}", default)

    def required(self, key: str) -> Any:
        value = self.arch_key(key)
        if value is None:
            raise ValueError(
                f"the GGUF lacks metadata key {self.arch}.{key}, which a {self.arch} model needs"
            )
        return value

    def tensor(self, name: str) -> np.ndarray:
        return self._read_tensor(name)


def _uniform(meta: Metadata, key: str, default: Any = None) -> Any:
    """A per-model value that some files store per layer (an array): one value, or an error."""
    value = meta.arch_key(key, default) if default is not None else meta.required(key)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(
                f"GGUF key {meta.arch}.{key} varies by layer ({sorted(set(value))}); pagemill "
                f"serves models whose layers share it"
            )
        value = value[0]
    return value


def _layer_types(meta: Metadata, layers: int, default_pattern: int) -> list[str]:
    """Windowed layers as llama.cpp sets them: `attention.sliding_window_pattern` (a period
    n — the last layer of every n is global — or one flag per layer) or the arch's period."""
    pattern = meta.arch_key("attention.sliding_window_pattern", default_pattern)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(
                f"{meta.arch}.attention.sliding_window_pattern has {len(pattern)} entries for "
                f"{layers} layers"
            )
        return [SLIDING if bool(p) else FULL for p in pattern]
    n = int(pattern)
    return [SLIDING if n == 0 or i % n < n - 1 else FULL for i in range(layers)]


def _rope_scaling(meta: Metadata) -> dict[str, Any]:
    """The HF rope parameters (without rope_theta) that `rope.scaling.*` keys state."""
    kind = str(meta.arch_key("rope.scaling.type", "none"))
    factor = meta.arch_key("rope.scaling.factor")
    orig = meta.arch_key("rope.scaling.original_context_length")
    if kind == "none" or (kind == "linear" and factor in (None, 1.0)):
        return {"rope_type": "default"}
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        out: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        if orig is not None:
            out["original_max_position_embeddings"] = int(orig)
        for key, hf in (
            ("rope.scaling.yarn_beta_fast", "beta_fast"),
            ("rope.scaling.yarn_beta_slow", "beta_slow"),
            ("rope.scaling.yarn_attn_factor", "attention_factor"),
        ):
            value = meta.arch_key(key)
            if value is not None:
                out[hf] = float(value)
        return out
    if kind == "longrope":  # its factors are tensors, which the architecture's hook reads
        return {"rope_type": "longrope"}
    raise ValueError(f"GGUF RoPE scaling type {kind!r} is not supported by pagemill")


def _llama3_from_rope_freqs(freqs: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    """llama.cpp stores llama3 scaling as the per-dimension divisor of each frequency;
    find the HF parameters that give exactly these divisors (convert_hf_to_gguf's rule)."""
    freqs = np.asarray(freqs, dtype=np.float64).reshape(-1)
    factor = float(freqs.max())
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / inv
    for low, high, orig in _LLAMA3_CANDIDATES:
        smooth = (orig / wavelen - low) / (high - low)
        expect = np.where(
            wavelen < orig / high,
            1.0,
            np.where(wavelen > orig / low, factor, 1.0 / ((1 - smooth) / factor + smooth)),
        )
        if expect.shape == freqs.shape and np.allclose(expect, freqs, rtol=1e-5, atol=0):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": orig,
            }
    raise ValueError(
        "the file's rope_freqs tensor is not llama3 RoPE scaling with the parameters of "
        "Llama 3.1-3.3 (low_freq_factor 1, high_freq_factor 4, 8192 original positions); "
        "pagemill cannot serve an arbitrary per-dimension RoPE table"
    )


def _gemma_scalar(meta: Metadata, cfg: dict[str, Any]) -> int:
    if cfg["num_hidden_layers"] == _GEMMA_27B_LAYERS[meta.arch]:
        return int(cfg["hidden_size"] // cfg["num_attention_heads"])
    return int(cfg["head_dim"])


def _llama(meta: Metadata, cfg: dict[str, Any]) -> None:
    cfg["attention_bias"] = "blk.0.attn_q.bias" in meta.shapes
    cfg["mlp_bias"] = "blk.0.ffn_up.bias" in meta.shapes
    if "rope_freqs.weight" in meta.shapes:
        if cfg["rope_parameters"]["rope_type"] != "default":
            raise ValueError("a GGUF with both rope_freqs and rope.scaling.type is not supported")
        scaling = _llama3_from_rope_freqs(
            meta.tensor("rope_freqs.weight"), cfg["rope_parameters"]["rope_theta"], cfg["head_dim"]
        )
        cfg["rope_parameters"].update(scaling)
    if int(meta.arch_key("expert_count", 0) or 0) > 0:  # Mixtral, written as llama
        cfg["architectures"] = ["MixtralForCausalLM"]
        cfg["model_type"] = "mixtral"
        _experts(meta, cfg, "num_local_experts", renormalize=True)
        cfg["sliding_window"] = None
        biases = cfg.pop("attention_bias"), cfg.pop("mlp_bias")
        if any(biases):
            raise ValueError("a llama GGUF with experts and biases is not Mixtral")


def _granite(meta: Metadata, cfg: dict[str, Any]) -> None:
    _llama(meta, cfg)
    attention = meta.arch_key("attention.scale")
    # HF's defaults are 1.0 everywhere, llama.cpp's (an absent key) 1/sqrt(head_dim) for the
    # scores: what the file leaves out is stated in config.json as llama.cpp serves it.
    cfg["attention_multiplier"] = float(attention) if attention else cfg["head_dim"] ** -0.5
    for key, hf in (
        ("embedding_scale", "embedding_multiplier"),
        ("residual_scale", "residual_multiplier"),
        ("logit_scale", "logits_scaling"),
    ):
        cfg[hf] = float(meta.arch_key(key) or 1.0)


def _smollm3(meta: Metadata, cfg: dict[str, Any]) -> None:
    _llama(meta, cfg)
    step = _SMOLLM3_NO_ROPE_STEP
    cfg["no_rope_layer_interval"] = step
    cfg["no_rope_layers"] = [int((i + 1) % step != 0) for i in range(cfg["num_hidden_layers"])]
    cfg["use_sliding_window"] = False  # llama.cpp's SmolLM3 has no window


def _olmo2(meta: Metadata, cfg: dict[str, Any]) -> None:
    if meta.arch_key("attention.sliding_window"):
        raise ValueError(
            "this olmo2 GGUF has a sliding window (it was converted from OLMo 3), which "
            "pagemill does not serve; OLMo 2 files have none"
        )
    cfg["attention_bias"] = "blk.0.attn_q.bias" in meta.shapes
    rope = cfg["rope_parameters"]
    attn = meta.arch_key("rope.scaling.attn_factor")  # the converter's key for OLMo's yarn
    if rope.get("rope_type") == "yarn" and attn is not None:
        rope.setdefault("attention_factor", float(attn))


def _experts(meta: Metadata, cfg: dict[str, Any], count_key: str, renormalize: bool) -> None:
    """The routing facts every MoE file states; `renormalize` is llama.cpp's fixed choice
    for the architecture (it keeps no `norm_topk_prob`)."""
    cfg[count_key] = int(meta.required("expert_count"))
    cfg["num_experts_per_tok"] = int(meta.required("expert_used_count"))
    cfg["norm_topk_prob"] = renormalize


def _expert_rows(meta: Metadata, tensor: str, key: str) -> int:
    """An expert size from its key, or else from the first layer's tensor that has it
    (GGUF shapes are innermost first: [in, rows, experts])."""
    value = meta.arch_key(key)
    if value is not None:
        return int(_uniform(meta, key))
    for name, shape in meta.shapes.items():
        if name.startswith("blk.") and name.endswith(f".{tensor}.weight"):
            return int(shape[1])
    raise ValueError(f"the GGUF has neither {meta.arch}.{key} nor {tensor} tensors")


def _qwen_moe(meta: Metadata, cfg: dict[str, Any]) -> None:
    qwen3 = meta.arch == "qwen3moe"
    _experts(meta, cfg, "num_experts", renormalize=qwen3)
    cfg["moe_intermediate_size"] = _expert_rows(meta, "ffn_gate_exps", "expert_feed_forward_length")
    dense = [
        i
        for i in range(cfg["num_hidden_layers"])
        if f"blk.{i}.ffn_gate_inp.weight" not in meta.shapes
    ]
    if dense:  # llama.cpp's qwen MoE architectures have no tensor for a dense MLP either
        raise ValueError(f"this {meta.arch} GGUF has layers without a router ({dense})")
    cfg["use_sliding_window"] = False
    if qwen3:
        cfg["attention_bias"] = "blk.0.attn_q.bias" in meta.shapes
    elif any(n.endswith(".ffn_gate_shexp.weight") for n in meta.shapes):
        cfg["shared_expert_intermediate_size"] = _expert_rows(
            meta, "ffn_gate_shexp", "expert_shared_feed_forward_length"
        )
    else:
        raise ValueError("this qwen2moe GGUF has no shared expert, which Qwen2-MoE always has")


def _olmoe(meta: Metadata, cfg: dict[str, Any]) -> None:
    _experts(meta, cfg, "num_experts", renormalize=False)
    cfg["attention_bias"] = "blk.0.attn_q.bias" in meta.shapes
    cfg["clip_qkv"] = None


def _qwen2(meta: Metadata, cfg: dict[str, Any]) -> None:
    cfg["use_sliding_window"] = False  # llama.cpp serves Qwen2 without a window


def _qwen3(meta: Metadata, cfg: dict[str, Any]) -> None:
    cfg["attention_bias"] = "blk.0.attn_q.bias" in meta.shapes
    cfg["use_sliding_window"] = False


def _phi3(meta: Metadata, cfg: dict[str, Any]) -> None:
    rope_dims = meta.arch_key("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != cfg["head_dim"]:
        cfg["partial_rotary_factor"] = int(rope_dims) / cfg["head_dim"]
        cfg["rope_parameters"]["partial_rotary_factor"] = cfg["partial_rotary_factor"]
    window = int(meta.arch_key("attention.sliding_window", 0) or 0)
    cfg["sliding_window"] = window or None
    orig = meta.arch_key("rope.scaling.original_context_length")
    if orig is not None:
        cfg["original_max_position_embeddings"] = int(orig)
    if "rope_factors_long.weight" in meta.shapes:
        cfg["rope_parameters"].update(
            {
                "rope_type": "longrope",
                "long_factor": meta.tensor("rope_factors_long.weight").astype(float).tolist(),
                "short_factor": meta.tensor("rope_factors_short.weight").astype(float).tolist(),
            }
        )
        if orig is not None:
            cfg["rope_parameters"]["original_max_position_embeddings"] = int(orig)
        # The converter always stores the attention factor; HF's default (the same formula)
        # is left implicit unless the file's differs.
        attn = meta.arch_key("rope.scaling.attn_factor")
        scale = cfg["max_position_embeddings"] / int(orig) if orig else 1.0
        default = math.sqrt(1 + math.log(scale) / math.log(int(orig))) if scale > 1 else 1.0
        if attn is not None and not math.isclose(float(attn), default, rel_tol=1e-6):
            cfg["rope_parameters"]["attention_factor"] = float(attn)


def _gemma2(meta: Metadata, cfg: dict[str, Any]) -> None:
    cfg["hidden_activation"] = "gelu_pytorch_tanh"
    cfg["query_pre_attn_scalar"] = _gemma_scalar(meta, cfg)
    cfg["attn_logit_softcapping"] = float(
        meta.arch_key("attn_logit_softcapping", _GEMMA2_ATTN_SOFTCAP)
    )
    cfg["final_logit_softcapping"] = float(
        meta.arch_key("final_logit_softcapping", _GEMMA2_FINAL_SOFTCAP)
    )
    cfg["sliding_window"] = int(meta.required("attention.sliding_window"))
    cfg["layer_types"] = _layer_types(meta, cfg["num_hidden_layers"], 2)


def _gemma3(meta: Metadata, cfg: dict[str, Any]) -> None:
    cfg["hidden_activation"] = "gelu_pytorch_tanh"
    cfg["query_pre_attn_scalar"] = _gemma_scalar(meta, cfg)
    cfg["attn_logit_softcapping"] = None
    softcap = meta.arch_key("final_logit_softcapping")
    cfg["final_logit_softcapping"] = float(softcap) if softcap else None
    window = int(meta.arch_key("attention.sliding_window", 0) or 0)
    layers = cfg["num_hidden_layers"]
    cfg["sliding_window"] = window or None
    cfg["layer_types"] = _layer_types(meta, layers, 6) if window else [FULL] * layers
    local = float(meta.arch_key("rope.freq_base_swa", _GEMMA_LOCAL_ROPE_BASE))
    cfg["rope_parameters"] = {
        FULL: cfg["rope_parameters"],
        SLIDING: {"rope_type": "default", "rope_theta": local},
    }


@dataclass(frozen=True)
class GGUFArch:
    """One llama.cpp architecture: the HF architecture serving it and what to undo."""

    name: str  # `general.architecture`
    hf_architecture: str
    model_type: str
    permuted_qk: bool = False  # q/k rows permuted for llama.cpp's rotary layout
    norm_offset: float = 0.0  # norms stored as w + offset
    configure: Callable[[Metadata, dict[str, Any]], None] = field(default=lambda m, c: None)

    def undo(
        self, gguf_name: str, value: torch.Tensor | QuantizedRows, config: Any
    ) -> torch.Tensor | QuantizedRows:
        """A tensor as the HF checkpoint held it, from its stored form (row permutations
        keep quantized rows exact; norms are never quantized by llama.cpp)."""
        if self.permuted_qk and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            heads = (
                config.num_attention_heads
                if ".attn_q." in gguf_name
                else config.num_key_value_heads
            )
            index = reverse_permute_index(value.shape[0], heads)
            return value[index] if isinstance(value, torch.Tensor) else value.index_rows(index)
        if self.norm_offset and gguf_name.endswith("norm.weight"):
            # In fp32, exactly what transformers' GGUF loader gives the same model.
            return dequantize(value, torch.float32) - self.norm_offset
        return value


GGUF_ARCHS: dict[str, GGUFArch] = {
    a.name: a
    for a in (
        GGUFArch("llama", "LlamaForCausalLM", "llama", permuted_qk=True, configure=_llama),
        GGUFArch("qwen2", "Qwen2ForCausalLM", "qwen2", configure=_qwen2),
        GGUFArch("qwen3", "Qwen3ForCausalLM", "qwen3", configure=_qwen3),
        GGUFArch("phi3", "Phi3ForCausalLM", "phi3", configure=_phi3),
        GGUFArch("gemma2", "Gemma2ForCausalLM", "gemma2", norm_offset=1.0, configure=_gemma2),
        GGUFArch("gemma3", "Gemma3ForCausalLM", "gemma3_text", norm_offset=1.0, configure=_gemma3),
        GGUFArch("granite", "GraniteForCausalLM", "granite", permuted_qk=True, configure=_granite),
        GGUFArch("smollm3", "SmolLM3ForCausalLM", "smollm3", permuted_qk=True, configure=_smollm3),
        GGUFArch("olmo2", "Olmo2ForCausalLM", "olmo2", configure=_olmo2),
        GGUFArch("qwen2moe", "Qwen2MoeForCausalLM", "qwen2_moe", configure=_qwen_moe),
        GGUFArch("qwen3moe", "Qwen3MoeForCausalLM", "qwen3_moe", configure=_qwen_moe),
        GGUFArch("olmoe", "OlmoeForCausalLM", "olmoe", configure=_olmoe),
    )
}


def reverse_permute_index(rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation (transformers' reverse_permute_weights)."""
    dim = rows // n_head // 2
    return torch.arange(rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(rows)


def config_from_gguf(meta: Metadata) -> dict[str, Any]:
    """config.json's content (transformers-5 spelling) for the model a GGUF describes."""
    arch = GGUF_ARCHS[meta.arch]
    if "token_embd.weight" not in meta.shapes:
        raise ValueError("the GGUF has no token_embd.weight tensor")
    hidden = int(meta.required("embedding_length"))
    heads = int(_uniform(meta, "attention.head_count"))
    kv_heads = int(_uniform(meta, "attention.head_count_kv", heads))
    head_dim = meta.arch_key("attention.key_length")
    if head_dim is None and arch.permuted_qk:  # llama's converter: RoPE over the whole head
        head_dim = meta.arch_key("rope.dimension_count")
    head_dim = int(head_dim) if head_dim is not None else hidden // heads
    layers = int(meta.required("block_count"))
    vocab = int(meta.shapes["token_embd.weight"][-1])  # GGUF shapes are innermost first
    cfg: dict[str, Any] = {
        "architectures": [arch.hf_architecture],
        "model_type": arch.model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(_uniform(meta, "feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(meta.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(meta.arch_key("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in meta.shapes,
        "rope_parameters": {
            "rope_theta": float(meta.arch_key("rope.freq_base", 10000.0)),
            **_rope_scaling(meta),
        },
        "dtype": "float32",  # what the file's tensors dequantize to
    }
    for key in ("bos", "eos", "padding"):
        token = meta.get(f"tokenizer.ggml.{key}_token_id")
        cfg["pad_token_id" if key == "padding" else f"{key}_token_id"] = (
            int(token) if token is not None and int(token) < vocab else None
        )
    arch.configure(meta, cfg)
    rope = cfg["rope_parameters"].get(FULL, cfg["rope_parameters"])
    if rope.get("rope_type") == "longrope" and "long_factor" not in rope:
        raise ValueError("the GGUF states longrope RoPE scaling but holds no rope_factors tensors")
    return cfg
