"""Model shapes and GPU datasheets, the only inputs of the capacity arithmetic.

The well-known entries ship as JSON (``data/models.json``, ``data/gpus.json``) so a user can
read and correct them without touching code; any Hugging Face ``config.json`` works as a model
and any JSON file with the GPU fields works as a GPU. Parameter counts are derived from the
shape rather than stored, so a planner number can always be traced back to the config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from pagemill.runtime.model_config import DTYPE_ALIASES, DTYPES, ModelConfig, canonical_dtype
from pagemill.runtime.moe_config import MOE_MODEL_TYPES, moe_spec

# Weight formats the planner projects but the runtime does not compute in: bytes per element.
# int4 counts half a byte: group scales are ignored, they add ~3%. The dtypes the runtime does
# compute in (and their spellings) come from its own table, `DTYPES`.
QUANTIZED_WEIGHT_BYTES: dict[str, float] = {"fp8": 1.0, "int8": 1.0, "int4": 0.5}


def weight_dtype_bytes(dtype: str) -> float:
    """Element size of a weight dtype name; a clear error names the accepted spellings."""
    key = str(dtype).strip().lower().removeprefix("torch.")
    if key in QUANTIZED_WEIGHT_BYTES:
        return QUANTIZED_WEIGHT_BYTES[key]
    try:
        return float(DTYPES[canonical_dtype(key)])
    except ValueError:
        accepted = ", ".join([*DTYPES, *DTYPE_ALIASES, *QUANTIZED_WEIGHT_BYTES])
        raise ValueError(f"unknown weight dtype {dtype!r}; expected one of {accepted}") from None


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer (Llama family layout: GQA attention + gated MLP, or a
    mixture of experts in place of the MLP)."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    max_position_embeddings: int = 4096
    # Mixture of experts (0 experts: dense). ``num_sparse_layers`` of the layers hold
    # ``num_experts`` experts of ``moe_intermediate_size`` (a token reads its top
    # ``num_experts_per_tok``) and a shared expert when its size is set; the rest a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    num_sparse_layers: int = 0

    def __post_init__(self) -> None:
        for field in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(
                    f"model {self.name!r}: {field} must be a positive int, got {value!r}"
                )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model {self.name!r}: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def params_per_layer(self) -> int:
        q = self.hidden_size * self.num_heads * self.head_dim
        kv = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        o = self.num_heads * self.head_dim * self.hidden_size
        bias = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim if self.qkv_bias else 0
        mlp = 3 * self.hidden_size * self.intermediate_size
        norms = 2 * self.hidden_size
        return q + kv + o + bias + mlp + norms

    def sparse_mlp_params(self, experts: float) -> float:
        """One sparse layer's MLP with `experts` of its routed experts counted (+ the router
        and the shared expert, which every token reads)."""
        h = self.hidden_size
        shared = 3 * h * self.shared_expert_intermediate_size
        shared += h if self.shared_expert_intermediate_size else 0
        return experts * 3 * h * self.moe_intermediate_size + h * self.num_experts + shared

    def _params(self, experts: float) -> int:
        embed = self.vocab_size * self.hidden_size
        lm_head = 0 if self.tie_word_embeddings else embed
        sparse = self.num_sparse_layers if self.num_experts else 0
        dense_mlp = 3 * self.hidden_size * self.intermediate_size
        layers = self.num_layers * self.params_per_layer + sparse * (
            self.sparse_mlp_params(experts) - dense_mlp
        )
        return round(embed + layers + self.hidden_size + lm_head)

    @property
    def num_params(self) -> int:
        """Every weight the model holds (all experts)."""
        return self._params(self.num_experts)

    @property
    def active_params(self) -> int:
        """The weights one token reads: its top-k experts only (= num_params when dense)."""
        return self._params(self.num_experts_per_tok) if self.num_experts else self.num_params

    def streamed_params(self, num_tokens: int) -> int:
        """The weights a step of `num_tokens` tokens reads once each: every expert some token
        picked, expected under uniform routing — E * (1 - (1 - k/E)^T)."""
        if not self.num_experts or num_tokens <= 0:
            return self.num_params
        e, k = self.num_experts, self.num_experts_per_tok
        return self._params(e * (1 - (1 - k / e) ** num_tokens))

    def attention_flops(self, num_queries: int, context_len: int) -> float:
        """FLOPs of QK^T and PV for a chunk of ``num_queries`` tokens ending at ``context_len``.

        Causal: query at position p sees p + 1 keys, so the chunk sees
        q * c - q * (q - 1) / 2 key positions; each costs 2 matmul FLOPs for QK and 2 for PV
        per head dimension, on every query head of every layer.
        """
        q, c = num_queries, context_len
        keys = q * c - q * (q - 1) / 2
        return 4.0 * self.num_layers * self.num_heads * self.head_dim * keys


@dataclass(frozen=True)
class GPUSpec:
    """What a roofline needs of a card: memory size, memory bandwidth, dense BF16 tensor rate;
    and, for tensor parallelism, its GPU-to-GPU link: one direction's bandwidth and the
    latency of one step of a ring all-reduce (None: unknown, so no tensor-parallel plan)."""

    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    bf16_flops: float
    link_bandwidth_bytes_per_s: float | None = None
    link_latency_s: float | None = None

    def __post_init__(self) -> None:
        for field in (
            "memory_bytes",
            "bandwidth_bytes_per_s",
            "bf16_flops",
            "link_bandwidth_bytes_per_s",
            "link_latency_s",
        ):
            value = getattr(self, field)
            if value is None and field.startswith("link_"):
                continue
            if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                raise ValueError(
                    f"GPU {self.name!r}: {field} must be a positive number, got {value!r}"
                )


@cache
def _load_data(filename: str) -> dict[str, dict[str, Any]]:
    text = resources.files("pagemill.server.sim").joinpath("data", filename).read_text("utf-8")
    raw = json.loads(text)
    return {k: v for k, v in raw.items() if not k.startswith("_")}


def known_models() -> list[str]:
    return sorted(_load_data("models.json"))


def known_gpus() -> list[str]:
    return sorted(_load_data("gpus.json"))


def _normalize(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def _model_from_entry(entry: dict[str, Any]) -> ModelSpec:
    fields = {k: v for k, v in entry.items() if k != "display_name"}
    return ModelSpec(name=entry.get("display_name", "model"), **fields)


def model_from_hf_config(config: dict[str, Any], name: str = "custom") -> ModelSpec:
    """Read a Hugging Face ``config.json`` (Llama, Mistral, Qwen2, ... layout) the way the
    runtime does (`ModelConfig.from_dict`), without requiring an architecture it can run."""
    moe = moe_spec(config) if "num_hidden_layers" in config else None
    if moe is None and (
        config.get("num_local_experts")
        or config.get("num_experts")
        or config.get("n_routed_experts")
    ):
        raise ValueError(
            f"{name}: mixture-of-experts configs other than "
            f"{', '.join(MOE_MODEL_TYPES)} are not supported by the planner"
        )
    text_config = config.get("text_config")
    if isinstance(text_config, dict) and "hidden_size" not in config:
        config = text_config  # a multimodal checkpoint: size its language model
    try:
        parsed = ModelConfig.from_dict(config, require_supported=False)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc} (not a decoder-only LM?)") from exc
    return ModelSpec(
        name=name,
        hidden_size=parsed.hidden_size,
        num_layers=parsed.num_hidden_layers,
        num_heads=parsed.num_attention_heads,
        num_kv_heads=parsed.num_key_value_heads,
        head_dim=parsed.head_dim,
        intermediate_size=parsed.intermediate_size,
        vocab_size=parsed.vocab_size,
        tie_word_embeddings=parsed.tie_word_embeddings,
        qkv_bias=parsed.attention_bias,
        max_position_embeddings=parsed.max_position_embeddings,
        **(
            {}
            if moe is None
            else dict(
                num_experts=moe.num_experts,
                num_experts_per_tok=moe.top_k,
                moe_intermediate_size=moe.intermediate_size,
                shared_expert_intermediate_size=moe.shared_intermediate_size,
                num_sparse_layers=sum(moe.sparse_layers),
            )
        ),
    )


def load_model(name_or_path: str | Path) -> ModelSpec:
    """A shipped model by name (case and ``_``/``-`` insensitive), or a path to a config.json
    (or to a folder holding one)."""
    key = _normalize(str(name_or_path))
    models = _load_data("models.json")
    if key in models:
        return _model_from_entry(models[key])
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            config = json.loads(path.read_text("utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from exc
        if not isinstance(config, dict):
            raise ValueError(f"{path}: expected a JSON object")
        return model_from_hf_config(config, name=path.parent.name or path.stem)
    raise ValueError(
        f"unknown model {str(name_or_path)!r}: not one of {known_models()} "
        "and not a path to a Hugging Face config.json"
    )


def load_gpu(name_or_path: str | Path) -> GPUSpec:
    """A shipped GPU by name, or a JSON file with ``memory_bytes``, ``bandwidth_bytes_per_s``
    and ``bf16_flops`` (and, for tensor parallelism, ``link_bandwidth_bytes_per_s`` and
    ``link_latency_s``)."""
    key = _normalize(str(name_or_path))
    gpus = _load_data("gpus.json")
    aliases = {
        "a100": "a100-80g",
        "a100-80gb": "a100-80g",
        "4090": "rtx-4090",
        "rtx4090": "rtx-4090",
    }
    key = aliases.get(key, key)
    if key in gpus:
        entry = dict(gpus[key])
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise ValueError(
                f"unknown GPU {str(name_or_path)!r}: not one of {known_gpus()} and not a JSON file"
            )
        try:
            entry = json.loads(path.read_text("utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from exc
        if not isinstance(entry, dict):
            raise ValueError(f"{path}: expected a JSON object")
        entry.setdefault("display_name", path.stem)
    missing = [k for k in ("memory_bytes", "bandwidth_bytes_per_s", "bf16_flops") if k not in entry]
    if missing:
        raise ValueError(f"GPU {str(name_or_path)!r} lacks {', '.join(missing)}")
    return GPUSpec(
        name=str(entry.get("display_name", key)),
        memory_bytes=int(entry["memory_bytes"]),
        bandwidth_bytes_per_s=float(entry["bandwidth_bytes_per_s"]),
        bf16_flops=float(entry["bf16_flops"]),
        link_bandwidth_bytes_per_s=_optional_float(entry.get("link_bandwidth_bytes_per_s")),
        link_latency_s=_optional_float(entry.get("link_latency_s")),
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
