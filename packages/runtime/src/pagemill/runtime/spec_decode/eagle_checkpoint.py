"""The formats EAGLE heads ship in, read into one view: a Llama-shaped config dict and
canonical tensor names.

- **vLLM's layout**: config.json with `architectures` (`EagleLlamaForCausalLM`,
  `Eagle3LlamaForCausalLM`, or the EAGLE repos' `LlamaForCausalLM` / `LlamaForCausalLMEagle3`)
  and the head's fields at the top level, weights in safetensors.
- **The `speculators` library's format** (what vLLM reads through
  `transformers_utils/configs/speculators`): config.json has `speculators_model_type`
  ("eagle" or "eagle3"), the decoder layer's shape under `transformer_layer_config`, the
  EAGLE-3 fields (`draft_vocab_size`, `target_hidden_size`, `norm_before_residual`, which
  defaults to true there, `eagle_aux_hidden_state_layer_ids`) at the top level, and the
  proposal settings under `speculators_config`. Its EAGLE-1 heads name the fusion layer
  `fusion_fc` and the decoder layer `transformer`; `layernorms` marks a HASS head.
- **The original EAGLE repos' `pytorch_model.bin`** (sharded or not), read with
  `torch.load(weights_only=True)`, so a pickle cannot run code.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import safe_open

from pagemill.runtime.model_config import ModelConfig

SPECULATORS_TYPES = ("eagle", "eagle3")
_BIN_SINGLE = "pytorch_model.bin"
_BIN_INDEX = "pytorch_model.bin.index.json"


def _config_json(folder: Path) -> dict[str, Any]:
    return cast(dict[str, Any], json.loads((folder / "config.json").read_text()))


def is_speculators(raw: dict[str, Any]) -> bool:
    return "speculators_model_type" in raw


def read_head_config(folder: Path) -> dict[str, Any]:
    """The head's config as vLLM's layout spells it (a speculators config flattened)."""
    raw = _config_json(folder)
    if not is_speculators(raw):
        return raw
    kind = raw["speculators_model_type"]
    if kind not in SPECULATORS_TYPES:
        raise ValueError(
            f"speculative_config.model: speculators_model_type {kind!r} is not an EAGLE "
            f"head; pagemill reads {', '.join(SPECULATORS_TYPES)}"
        )
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(
            "speculative_config.model: a speculators config needs a transformer_layer_config "
            "object (the head's decoder layer)"
        )
    flat = dict(layer)
    flat.setdefault("model_type", "llama")
    if kind == "eagle3":
        flat["architectures"] = ["Eagle3LlamaForCausalLM"]
        for key in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids"):
            if raw.get(key) is not None:
                flat[key] = raw[key]
        flat["norm_before_residual"] = bool(raw.get("norm_before_residual", True))
    else:
        flat["architectures"] = ["EagleLlamaForCausalLM"]
        if raw.get("layernorms"):
            flat["add_para_norm"] = True
    return flat


def head_config(folder: Path) -> ModelConfig:
    """The head's config (a Llama layer's shape) whatever format and architecture name
    it carries, with transformers' Llama defaults filled in."""
    raw = _config_json(folder)
    if not is_speculators(raw):
        return ModelConfig.from_pretrained(folder)
    from transformers import LlamaConfig

    flat = read_head_config(folder)
    filled = LlamaConfig(**flat).to_dict()
    filled["architectures"] = flat["architectures"]
    return ModelConfig.from_dict(filled)


def canonical_name(name: str) -> str:
    """A head tensor's name as vLLM's layout spells it (the EAGLE-3 repos' `midlayer.` is
    the EAGLE-3 head's own affair)."""
    if name.startswith("model."):
        name = name[len("model.") :]
    if name.startswith("fusion_fc."):  # speculators' EAGLE-1
        return "fc." + name[len("fusion_fc.") :]
    if name.startswith("transformer."):  # speculators' EAGLE-1 decoder layer
        return "layers.0." + name[len("transformer.") :]
    return name


def head_weight_files(folder: Path) -> list[Path]:
    """The head's weight files: safetensors when there are any, else pytorch_model.bin
    (or the shards its index lists)."""
    from pagemill.runtime.model_executor.weights import INDEX_FILE, safetensors_files

    if (folder / INDEX_FILE).is_file() or any(folder.glob("*.safetensors")):
        return safetensors_files(folder)
    index = folder / _BIN_INDEX
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    if (folder / _BIN_SINGLE).is_file():
        return [folder / _BIN_SINGLE]
    return safetensors_files(folder)  # raises, naming what the folder holds


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # a pickle that needs more than tensors is refused, not run
        raise ValueError(
            f"speculative_config.model: {path.name} does not load as plain tensors "
            f"(torch.load with weights_only=True): {e}"
        ) from e
    if not isinstance(state, dict):
        raise ValueError(f"speculative_config.model: {path.name} holds no state dict")
    return cast(dict[str, torch.Tensor], state)


def iterate_head_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(canonical name, tensor) over every weight file of the head."""
    for path in head_weight_files(folder):
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open objects are not iterable
                    yield canonical_name(name), f.get_tensor(name)
        else:
            for name, tensor in _load_bin(path).items():
                yield canonical_name(name), tensor


def head_tensor_names(folder: Path) -> set[str]:
    """The head's canonical tensor names (safetensors are read for their index only)."""
    names: set[str] = set()
    for path in head_weight_files(folder):
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt", device="cpu") as f:
                names.update(f.keys())
        else:
            names.update(_load_bin(path))
    return {canonical_name(n) for n in names}


def head_weight_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in head_weight_files(folder))
