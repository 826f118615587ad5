"""Reading a PEFT LoRA adapter folder, refusing what the batched layers cannot serve.

A PEFT adapter is ``adapter_config.json`` (rank ``r``, ``lora_alpha``, ``use_rslora``, ...)
and ``adapter_model.safetensors`` holding ``...layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight``
[r, in] and ``lora_B.weight`` [out, r] per adapted projection. The delta a projection adds is
``scaling * x Aᵀ Bᵀ`` with ``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)`` under
rsLoRA); the scaling is folded into B here, once, so the step multiplies nothing extra.

Served: q/k/v/o/gate/up/down projections of the decoder layers, any rank up to
``max_lora_rank``. Refused, each with a message naming it: DoRA, ``modules_to_save``,
trained biases, per-module rank or alpha patterns, other target modules (embeddings,
the LM head), ``fan_in_fan_out``, pickled ``adapter_model.bin`` files.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

# PEFT's module names -> (our fused layer, its slice).
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
SUPPORTED = tuple(TARGETS)

_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)


class LoRAError(ValueError):
    """An adapter that cannot be served, with why (the request naming it fails alone)."""


@dataclass
class LoRAAdapter:
    """One adapter's weights on the host:
    ``weights[(layer, module)] = (A [r, in], B times its scaling [out, r])``."""

    name: str
    lora_int_id: int
    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_adapter_config(folder: Path, max_lora_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a PEFT LoRA folder, after every check its config and file list
    allow (the weights' own checks need the model: `load_peft_adapter`); raises
    `LoRAError`. Cheap: the front end runs it when an adapter is registered."""
    if not folder.is_dir():
        raise LoRAError(f"LoRA adapter folder {str(folder)!r} does not exist")
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise LoRAError(f"{folder}: no adapter_config.json (a PEFT LoRA adapter folder is needed)")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise LoRAError(f"{path}: cannot read it: {exc}") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"{path}: not a JSON object")
    kind = str(cfg.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise LoRAError(f"{folder}: peft_type {kind!r} is not supported (LoRA adapters only)")
    refused = {
        "use_dora": "DoRA adapters (use_dora) are not supported",
        "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
        "rank_pattern": "per-module ranks (rank_pattern) are not supported",
        "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
        "fan_in_fan_out": "fan_in_fan_out weights are not supported",
    }
    for key, why in refused.items():
        if cfg.get(key):
            raise LoRAError(f"{folder}: {why}")
    if cfg.get("bias", "none") not in ("none", None):
        raise LoRAError(f"{folder}: trained biases (bias={cfg['bias']!r}) are not supported")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        other = sorted(set(targets) - set(SUPPORTED))
        if other:
            raise LoRAError(
                f"{folder}: target module(s) {other} are not supported "
                f"(LoRA on {', '.join(SUPPORTED)} only)"
            )
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise LoRAError(f"{folder}: adapter_config.json has no valid rank r (got {r!r})")
    if r > max_lora_rank:
        raise LoRAError(
            f"{folder}: rank {r} exceeds max_lora_rank={max_lora_rank} (raise --max-lora-rank)"
        )
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise LoRAError(f"{folder}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    if not (folder / "adapter_model.safetensors").is_file():
        also = (
            " (adapter_model.bin is not read: pickles can run code)"
            if (folder / "adapter_model.bin").is_file()
            else ""
        )
        raise LoRAError(f"{folder}: no adapter_model.safetensors{also}")
    return r, float(scaling)


def load_peft_adapter(
    name: str,
    lora_int_id: int,
    path: str,
    shapes: dict[tuple[int, str], tuple[int, int]],
    max_lora_rank: int,
    dtype: torch.dtype,
) -> LoRAAdapter:
    """Read and check one adapter; ``shapes[(layer, peft module)] = (in, out)`` is what the
    model serves. Raises `LoRAError` naming what is wrong."""
    from safetensors import safe_open

    folder = Path(path)
    rank, scaling = read_adapter_config(folder, max_lora_rank)
    file = folder / "adapter_model.safetensors"
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(file), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            m = _KEY.search(key)
            if m is None:
                raise LoRAError(
                    f"{folder}: tensor {key!r} is not a LoRA weight of "
                    f"{', '.join(SUPPORTED)} (DoRA, embeddings, the LM head and "
                    "modules_to_save are not supported)"
                )
            layer, module, half = int(m.group(1)), m.group(2), m.group(3)
            if module not in TARGETS:
                raise LoRAError(
                    f"{folder}: LoRA on {module!r} is not supported "
                    f"(LoRA on {', '.join(SUPPORTED)} only)"
                )
            halves.setdefault((layer, module), {})[half] = f.get_tensor(key)
    if not halves:
        raise LoRAError(f"{folder}: adapter_model.safetensors holds no LoRA weights")
    adapter = LoRAAdapter(name, lora_int_id, path, rank, scaling)
    for where, pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"{folder}: layer {where[0]} {where[1]} lacks lora_A or lora_B")
        if where not in shapes:
            raise LoRAError(
                f"{folder}: layer {where[0]} {where[1]} does not exist in this model "
                "(an adapter for another base model?)"
            )
        a, b = pair["A"], pair["B"]
        fan_in, fan_out = shapes[where]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoRAError(
                f"{folder}: layer {where[0]} {where[1]}: lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)} are not a low-rank pair"
            )
        if a.shape[0] > max_lora_rank:
            raise LoRAError(
                f"{folder}: rank {a.shape[0]} exceeds max_lora_rank={max_lora_rank} "
                "(raise --max-lora-rank)"
            )
        if a.shape[1] != fan_in or b.shape[0] != fan_out:
            raise LoRAError(
                f"{folder}: layer {where[0]} {where[1]}: lora_A {tuple(a.shape)} / lora_B "
                f"{tuple(b.shape)} do not fit the model's [{fan_out}, {fan_in}] projection "
                "(an adapter for another base model?)"
            )
        # Scaled in fp32, then rounded once to the compute dtype.
        adapter.weights[where] = (
            a.to(torch.float32).to(dtype).contiguous(),
            (b.to(torch.float32) * scaling).to(dtype).contiguous(),
        )
    return adapter
