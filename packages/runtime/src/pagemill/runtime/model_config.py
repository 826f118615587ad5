"""The model facts read from a Hugging Face `config.json`, and the one table of dtype names.

Torch-free on purpose: the capacity planner and the simulator parse config.json and name
dtypes exactly as the runtime does, without paying for (or even having) torch. The runtime
turns a canonical name into a torch dtype at the last moment (`config.torch_dtype`).

`ModelConfig` is what the model code, the KV pool and the engine need, read once from
config.json so that nothing downstream has to know which transformers config class (or
version) a model came from.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagemill.blockpool.sizing import DTYPE_ALIASES as _ALL_ALIASES
from pagemill.blockpool.sizing import DTYPE_BYTES

logger = logging.getLogger(__name__)

# Architectures pagemill serves (the modules are in `pagemill.runtime.model_executor.models`):
# the Llama module serves Llama, Mistral and Qwen2 (they differ only in config values); Qwen3,
# Phi-3, SmolLM3 (layers without RoPE) and Granite (scaled embeddings, residuals and logits)
# extend it; Gemma 2, Gemma 3 (text) and OLMo 2 have their own layer.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "SmolLM3ForCausalLM",
    "Olmo2ForCausalLM",
    "GraniteForCausalLM",
    # Mixture-of-experts (the sparse MLP: `model_executor.layers.fused_moe`).
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
    "GptOssForCausalLM",
)
_ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "granite": "GraniteForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
SLIDING, FULL = "sliding_attention", "full_attention"
# RoPE scalings the kernels build tables for (`pagemill.kernels.rotary`), checked here so an
# unknown one is refused with the config, before any weight moves.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")

# The dtypes the engine computes in: canonical name -> bytes per element. The byte counts
# come from the block pool's sizing table so the pool and the planner can never disagree.
DTYPES: dict[str, int] = {name: DTYPE_BYTES[name] for name in ("float32", "float16", "bfloat16")}

# The spellings of the compute dtypes, from the one table (blockpool's sizing).
DTYPE_ALIASES: dict[str, str] = {k: v for k, v in _ALL_ALIASES.items() if v in DTYPES}


def canonical_dtype(name: str) -> str:
    """'torch.bfloat16', 'bf16', 'half', ... -> a key of `DTYPES`."""
    key = str(name).strip().lower().removeprefix("torch.")
    key = DTYPE_ALIASES.get(key, key)
    if key not in DTYPES:
        spellings = ", ".join([*DTYPES, *DTYPE_ALIASES])
        raise ValueError(f"unsupported dtype {name!r}; expected one of {spellings}")
    return key


def _config_dtype(raw: dict[str, Any]) -> str | None:
    """The checkpoint's own dtype, or None when it names none (or one we do not compute in)."""
    value = raw.get("dtype") or raw.get("torch_dtype")
    if value is None:
        return None
    try:
        return canonical_dtype(str(value))
    except ValueError:
        return None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _sliding_window(raw: dict[str, Any]) -> int | None:
    window = raw.get("sliding_window")
    # Qwen2/3 and SmolLM3 configs carry a window used only when use_sliding_window is set.
    gated = ("qwen2", "qwen3", "smollm3", "qwen2_moe", "qwen3_moe")
    if raw.get("model_type") in gated and not raw.get("use_sliding_window", False):
        return None
    return int(window) if isinstance(window, int) and window > 0 else None


def smollm3_rope_layers(raw: dict[str, Any], num_layers: int) -> list[bool]:
    """Whether each SmolLM3 layer applies RoPE: ``no_rope_layers`` (1 = RoPE, 0 = none), or,
    without the list, RoPE dropped from every ``no_rope_layer_interval``-th layer (4), as
    transformers fills it."""
    given = raw.get("no_rope_layers")
    if given is not None:
        if len(given) != num_layers:
            raise ValueError(f"no_rope_layers has {len(given)} entries for {num_layers} layers")
        return [bool(v) for v in given]
    interval = int(raw.get("no_rope_layer_interval") or 4)
    return [(i + 1) % interval != 0 for i in range(num_layers)]


def _layer_types(
    raw: dict[str, Any], window: int | None, num_layers: int, strict: bool = True
) -> list[str]:
    """Which layers attend through the sliding window, as transformers decides it.

    transformers-5 configs list ``layer_types``; older ones imply them: Gemma 2 and gpt-oss
    alternate (sliding first), Gemma 3 has one global layer in every ``sliding_window_pattern`` (6),
    Qwen2/3 window the layers from ``max_window_layers`` on, SmolLM3 its layers without
    RoPE, Mistral and Phi-3 all layers.
    """
    if window is None:
        return [FULL] * num_layers
    given = raw.get("layer_types")
    if isinstance(given, list) and len(given) == num_layers:
        if strict and any(t not in (SLIDING, FULL) for t in given):
            raise ValueError(
                f"unsupported layer_types {sorted(set(given))}: pagemill serves "
                f"{SLIDING!r} and {FULL!r} layers"
            )
        return [str(t) for t in given]
    model_type = raw.get("model_type")
    if model_type in ("gemma2", "gpt_oss"):
        return [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]
    if model_type == "gemma3_text":
        pattern = int(raw.get("sliding_window_pattern") or 6)
        return [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        first = int(raw.get("max_window_layers", num_layers))
        return [SLIDING if i >= first else FULL for i in range(num_layers)]
    if model_type == "smollm3":  # the layers without RoPE are the windowed ones
        return [FULL if rope else SLIDING for rope in smollm3_rope_layers(raw, num_layers)]
    return [SLIDING] * num_layers


def _rope_params(
    raw: dict[str, Any], max_position_embeddings: int = 2048
) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either transformers-5 `rope_parameters` or the older keys.

    Checkpoints on disk use both spellings; the kernels take theta plus a scaling dict in
    the HF layout (with "rope_type"), and None for plain RoPE. The keys transformers fills
    from the rest of the config are filled here too, so the table needs nothing else:
    ``original_max_position_embeddings`` (Phi-3 keeps it beside the RoPE keys, and it wins
    there, as in transformers; else ``max_position_embeddings``), yarn's and longrope's
    ``factor`` (their ratio) and dynamic NTK's ``max_position_embeddings``.
    """
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(FULL), dict):
        # Per layer type (Gemma 3): the global layers' RoPE is the model's; see rope_for.
        params = params[FULL]
    if isinstance(params, dict) and params:
        theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = {
            k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")
        }
    else:
        theta = float(raw.get("rope_theta", 10000.0))
        scaling = dict(raw.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    rope_type = scaling.get("rope_type") or "default"
    if rope_type == "default":
        return theta, None
    if rope_type == "su":  # the first Phi-3 128k configs' name for longrope
        rope_type = scaling["rope_type"] = "longrope"
    if rope_type in ("llama3", "yarn", "longrope"):
        if raw.get("original_max_position_embeddings"):
            scaling["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
        scaling.setdefault("original_max_position_embeddings", max_position_embeddings)
    if rope_type in ("yarn", "longrope") and scaling.get("factor") is None:
        scaling["factor"] = max_position_embeddings / scaling["original_max_position_embeddings"]
    if rope_type == "dynamic":
        scaling["max_position_embeddings"] = max_position_embeddings
    return theta, scaling


def _architecture(raw: dict[str, Any], *, require_supported: bool) -> str:
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        arch = _ARCHITECTURE_BY_MODEL_TYPE.get(raw.get("model_type") or "")
    if arch is not None:
        return arch
    if require_supported:
        raise ValueError(
            f"unsupported model architecture {archs or raw.get('model_type')!r}; "
            f"pagemill serves {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return str(archs[0]) if archs else str(raw.get("model_type") or "unknown")


def _with_hf_defaults(raw: dict[str, Any], path: Path, text: str = "") -> dict[str, Any]:
    """Fill the keys a checkpoint leaves to its transformers config class's defaults.

    Reading through the config class (rather than trusting the JSON alone) gives the same
    defaults, legacy-key upgrades and rope normalisation that transformers itself applies,
    which is what greedy equality with transformers depends on. Imported here, not at the
    top, so that parsing a dict never needs transformers. The result is kept in the cache
    folder, keyed by config.json's text (`text`) and transformers' version: importing the
    config classes is seconds of an engine process's start, which then needs no
    transformers at all.
    """
    cache = _hf_defaults_file(text) if text else None
    if cache is not None and cache.is_file():
        try:
            return _from_json(cache.read_text())
        except (OSError, ValueError, AttributeError):  # a broken entry is written again
            pass
    try:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(str(path))
    except Exception as e:  # an unknown model_type: from_dict names the problem
        logger.debug("transformers could not read %s (%s); using config.json as is", path, e)
        return raw
    merged = hf.to_dict()
    merged.setdefault("architectures", raw.get("architectures"))
    if cache is not None:
        _save_hf_defaults(cache, merged)
    return merged


# Bump when what `_with_hf_defaults` keeps changes.
_HF_DEFAULTS_VERSION = 1


def _hf_defaults_file(text: str) -> Path | None:
    """Where the filled config of this config.json text is kept; None without transformers
    or with PAGEMILL_HF_CONFIG_CACHE=0."""
    import hashlib
    import importlib.metadata

    if os.environ.get("PAGEMILL_HF_CONFIG_CACHE", "1").strip().lower() in ("0", "false", "no"):
        return None
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None
    from pagemill.runtime.model_executor.default_model import cache_dir

    key = hashlib.sha256(f"{_HF_DEFAULTS_VERSION}\0{version}\0{text}".encode()).hexdigest()
    return cache_dir() / "hf-configs" / f"{key[:32]}.json"


def _from_json(text: str) -> dict[str, Any]:
    """A kept config as `to_dict()` gave it: JSON makes id2label's int keys strings, and
    transformers' own config classes turn them back the same way."""
    merged: dict[str, Any] = json.loads(text)
    if isinstance(merged.get("id2label"), dict):
        merged["id2label"] = {int(k): v for k, v in merged["id2label"].items()}
    return merged


def _save_hf_defaults(cache: Path, merged: dict[str, Any]) -> None:
    """Kept only when it reads back as exactly the same dict (no tuples, say), so a cached
    read never differs from transformers' own; a folder that cannot be written to only
    costs the next start the transformers import."""
    try:
        text = json.dumps(merged)
        if _from_json(text) != merged:
            logger.debug("not keeping the filled config: JSON does not give it back")
            return
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(cache)
    except (OSError, TypeError, ValueError) as e:
        logger.debug("could not keep the filled config in %s: %s", cache, e)


@dataclass
class ModelConfig:
    """The shape of a Llama-family model, as the runtime (and the planner) needs it."""

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
    # Local attention's window (None: every layer attends to the whole context), and which
    # layers use it ("sliding_attention") or not ("full_attention"); see `layer_window`.
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)
    # Phi-3 style partial RoPE: the first head_dim * factor dimensions rotate.
    partial_rotary_factor: float = 1.0
    bos_token_id: int | None = None
    # The checkpoint's dtype as a canonical name (a key of DTYPES), None when it names none.
    config_dtype: str | None = None
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(
        cls,
        raw: dict[str, Any],
        generation_config: dict[str, Any] | None = None,
        *,
        require_supported: bool = True,
    ) -> ModelConfig:
        """Build from a parsed config.json; errors name what is missing or unsupported.

        Pure (no transformers, no files). `require_supported=False` is for the planner, which
        sizes any dense Llama-layout decoder whether or not the runtime can run it.
        """
        arch = _architecture(raw, require_supported=require_supported)
        required = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        missing = [k for k in required if k not in raw]
        if missing:
            raise ValueError(f"config.json lacks required field(s): {', '.join(missing)}")
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // heads)
        if heads % kv_heads:
            raise ValueError(
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        max_pos = int(raw.get("max_position_embeddings") or 2048)
        theta, scaling = _rope_params(raw, max_pos)
        rope_type = (scaling or {}).get("rope_type", "default")
        if require_supported and rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_type {rope_type!r}: pagemill supports "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        model_type = str(raw.get("model_type") or "llama")
        # Qwen2 always has q/k/v biases (its config has no switch for them); transformers
        # picks the config class, hence the layout, from model_type.
        qwen2 = arch == "Qwen2ForCausalLM" or model_type == "qwen2"
        # Qwen2-MoE: the same biases, behind its config's qkv_bias (True unless set).
        qwen2 = qwen2 or (model_type == "qwen2_moe" and bool(raw.get("qkv_bias", True)))
        eos = _as_id_list(raw.get("eos_token_id"))
        for t in _as_id_list((generation_config or {}).get("eos_token_id")):
            if t not in eos:
                eos.append(t)
        return cls(
            architecture=arch,
            model_type=model_type,
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
            # LlamaConfig's default, which is what transformers fills for a Llama checkpoint.
            max_position_embeddings=max_pos,
            # Qwen2's config class defaults to untied, Llama's too; an explicit key wins.
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=qwen2 or bool(raw.get("attention_bias", False)),
            o_proj_bias=not qwen2 and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            eos_token_ids=eos,
            sliding_window=_sliding_window(raw),
            layer_types=_layer_types(
                raw, _sliding_window(raw), int(raw["num_hidden_layers"]), strict=require_supported
            ),
            partial_rotary_factor=float(
                raw.get("partial_rotary_factor")
                or (raw.get("rope_parameters") or {}).get("partial_rotary_factor")
                or 1.0
            ),
            bos_token_id=raw.get("bos_token_id"),
            config_dtype=_config_dtype(raw),
            hf_config=raw,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read a model folder: config.json with transformers' defaults filled in, plus the
        extra EOS ids of generation_config.json."""
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"model folder {str(path)!r} has no config.json")
        text = config_file.read_text()
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_file} is not valid JSON: {e}") from e
        raw = _with_hf_defaults(raw, path, text)
        gen_file = path / "generation_config.json"
        gen = None
        if gen_file.is_file():
            try:
                gen = json.loads(gen_file.read_text())
            except json.JSONDecodeError:
                logger.warning("ignoring unreadable %s", gen_file)
        return cls.from_dict(raw, gen)

    def layer_window(self, layer: int) -> int:
        """The sliding window of ``layer`` in keys (transformers' ``sliding_window``: a query
        sees itself and the ``window - 1`` positions before it); 0 for a global layer."""
        if self.sliding_window is None or not self.layer_types:
            return 0
        return self.sliding_window if self.layer_types[layer] == SLIDING else 0

    def rope_for(self, layer_type: str) -> tuple[float, dict[str, Any] | None]:
        """(theta, scaling) of the layers of ``layer_type``: Gemma 3 gives its sliding
        layers their own (local) RoPE base; every other model has one RoPE."""
        params = self.hf_config.get("rope_parameters")
        if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
            return _rope_params(
                {"rope_parameters": params[layer_type]}, self.max_position_embeddings
            )
        if layer_type == SLIDING and "rope_local_base_freq" in self.hf_config:
            return float(self.hf_config["rope_local_base_freq"]), None
        return self.rope_theta, self.rope_scaling

    @property
    def max_model_len_limit(self) -> int:
        """The longest context the model serves: ``max_position_embeddings``, or what a
        context-extending RoPE reaches beyond it, as vLLM derives it (yarn: the original
        context times ``factor``; dynamic NTK: ``max_position_embeddings`` times it)."""
        limit = self.max_position_embeddings
        scaling = self.rope_scaling or {}
        rope_type = scaling.get("rope_type")
        if rope_type == "yarn":
            reach = float(scaling["original_max_position_embeddings"]) * float(scaling["factor"])
            limit = max(limit, int(reach))
        elif rope_type == "dynamic":
            limit = max(limit, int(limit * float(scaling["factor"])))
        return limit

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim
