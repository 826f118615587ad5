"""Engine options and the model facts derived from a Hugging Face config.

`EngineConfig` is what users pass (vLLM's names); `ModelConfig` is what the model code,
the KV pool and the engine need, read once from `config.json` so that nothing downstream
has to know which transformers config class (or version) a model came from.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

# Architectures the Llama module serves: they differ only in config values (rope scaling,
# q/k/v biases, tied embeddings), not in the shape of the computation.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

_POLICIES = ("fcfs", "priority")
_LOAD_FORMATS = ("auto", "safetensors", "dummy")


@dataclass
class EngineConfig:
    """Everything `LLMEngine` needs to start; checked at construction.

    `kv_cache_memory_bytes` fixes the KV pool size (required for an exact budget on CPU;
    on CUDA it overrides profiling). `max_model_len=None` takes the model's own limit.
    """

    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    seed: int = 0
    load_format: str = "auto"
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"EngineConfig.{name} {rule}, got {getattr(self, name)!r}")

        if not isinstance(self.model, str) or not self.model:
            raise bad("model", "must be a non-empty model name or folder path")
        if not isinstance(self.dtype, str) or (self.dtype != "auto" and self.dtype not in _DTYPES):
            raise bad("dtype", f"must be 'auto' or one of {sorted(set(_DTYPES))}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(name, "must be a positive integer")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 2
        ):
            raise bad("max_model_len", "must be None or an integer >= 2")
        if self.kv_cache_memory_bytes is not None and (
            not isinstance(self.kv_cache_memory_bytes, int) or self.kv_cache_memory_bytes <= 0
        ):
            raise bad("kv_cache_memory_bytes", "must be None or a positive number of bytes")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise bad("gpu_memory_utilization", "must be in (0, 1]")
        if self.long_prefill_token_threshold < 0:
            raise bad("long_prefill_token_threshold", "must be >= 0 (0 = off)")
        if self.scheduling_policy not in _POLICIES:
            raise bad("scheduling_policy", f"must be one of {_POLICIES}")
        if self.load_format not in _LOAD_FORMATS:
            raise bad("load_format", f"must be one of {_LOAD_FORMATS}")

    def resolve_device(self) -> torch.device:
        """'auto' means the GPU when there is one: the engine is built for it."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"EngineConfig.device={self.device!r} but no CUDA device is available")
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"EngineConfig.device must be 'auto', 'cpu' or 'cuda[:i]', got {self.device!r}")
        return device


def resolve_dtype(requested: str, config_dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
    """Pick the compute dtype.

    'auto' keeps a half-precision checkpoint's dtype on the GPU and serves fp32 checkpoints
    in bf16 there (fp32 wastes half the bandwidth for no visible quality); on CPU it uses
    fp32, where half-precision matmuls are slow and would only cost accuracy.
    """
    if requested != "auto":
        return _DTYPES[requested]
    if device.type == "cpu":
        return torch.float32
    if config_dtype in (torch.float16, torch.bfloat16):
        return config_dtype
    return torch.bfloat16


def _config_dtype(raw: dict[str, Any]) -> torch.dtype | None:
    name = raw.get("dtype") or raw.get("torch_dtype")
    if isinstance(name, str):
        return _DTYPES.get(name.removeprefix("torch."))
    return None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _sliding_window(raw: dict[str, Any]) -> int | None:
    window = raw.get("sliding_window")
    # Qwen2 configs carry a window that is only used when use_sliding_window is set.
    if raw.get("model_type") == "qwen2" and not raw.get("use_sliding_window", False):
        return None
    return int(window) if isinstance(window, int) and window > 0 else None


def _rope_params(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either transformers-5 `rope_parameters` or the older keys.

    Checkpoints on disk use both spellings; the kernels take theta plus a scaling dict in
    the HF layout (with "rope_type"), and None for plain RoPE.
    """
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params:
        theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(raw.get("rope_theta", 10000.0))
        scaling = dict(raw.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, scaling


def _with_hf_defaults(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """Fill the keys a checkpoint leaves to its transformers config class's defaults.

    Reading through the config class (rather than trusting the JSON alone) gives the same
    defaults, legacy-key upgrades and rope normalisation that transformers itself applies,
    which is what greedy equality with transformers depends on.
    """
    try:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(str(path))
    except Exception as e:  # an unknown model_type: from_dict names the problem
        logger.debug("transformers could not read %s (%s); using config.json as is", path, e)
        return raw
    merged = hf.to_dict()
    merged.setdefault("architectures", raw.get("architectures"))
    return merged


@dataclass
class ModelConfig:
    """The shape of a Llama-family model, as the runtime needs it."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    eos_token_ids: list[int] = field(default_factory=list)
    # Mistral-style local attention; None when every layer attends to the whole context.
    sliding_window: int | None = None
    bos_token_id: int | None = None
    config_dtype: torch.dtype | None = None
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
        """Build from a parsed config.json; errors name what is missing or unsupported."""
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            model_type = raw.get("model_type")
            by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
            arch = by_type.get(model_type or "")
        if arch is None:
            raise ValueError(
                f"unsupported model architecture {archs or raw.get('model_type')!r}; "
                f"pagemill serves {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in raw]
        if missing:
            raise ValueError(f"config.json lacks required field(s): {', '.join(missing)}")
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or raw["hidden_size"] // heads)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        theta, scaling = _rope_params(raw)
        qwen2 = arch == "Qwen2ForCausalLM"
        eos = _as_id_list(raw.get("eos_token_id"))
        for t in _as_id_list((generation_config or {}).get("eos_token_id")):
            if t not in eos:
                eos.append(t)
        return cls(
            architecture=arch,
            model_type=str(raw.get("model_type", "llama")),
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            # Qwen2's config class defaults to untied, Llama's too; an explicit key wins.
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases (its config has no switch for them).
            attention_bias=qwen2 or bool(raw.get("attention_bias", False)),
            o_proj_bias=not qwen2 and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            eos_token_ids=eos,
            sliding_window=_sliding_window(raw),
            bos_token_id=raw.get("bos_token_id"),
            config_dtype=_config_dtype(raw),
            hf_config=raw,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"model folder {str(path)!r} has no config.json")
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_file} is not valid JSON: {e}") from e
        raw = _with_hf_defaults(raw, path)
        gen_file = path / "generation_config.json"
        gen = None
        if gen_file.is_file():
            try:
                gen = json.loads(gen_file.read_text())
            except json.JSONDecodeError:
                logger.warning("ignoring unreadable %s", gen_file)
        return cls.from_dict(raw, gen)

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim
