"""K/V cache scales stored in a checkpoint, for an fp8 KV cache.

fp8 checkpoints calibrated by ModelOpt, llm-compressor / compressed-tensors or the older
AutoFP8 carry one K and one V scale per attention layer, under names that differ by tool
(vLLM accepts the same set and remaps them onto its attention layer):

    model.layers.N.self_attn.k_scale / v_scale          llm-compressor, compressed-tensors
    model.layers.N.self_attn.attn.k_scale / v_scale     vLLM's own module path
    model.layers.N.self_attn.k_proj.k_scale             ModelOpt
    model.layers.N.self_attn.v_proj.v_scale             ModelOpt
    model.layers.N.self_attn.k_proj.output_scale        compressed-tensors output activations
    model.layers.N.self_attn.v_proj.output_scale
    model.layers.N.self_attn.kv_scale                   legacy: one scale for both K and V

Only their names are scanned (the safetensors headers), and only the matching tensors are
read, so this costs nothing for a checkpoint without them. A scale is per tensor (one
element) or per KV head (``num_kv_heads`` elements: ``[num_kv_heads]``, or with unit axes
after it as llm-compressor's ``strategy: "attn_head"`` may store them, as vLLM accepts);
any other shape (per channel, per query head) is refused by name rather than read as
something it is not. One per-head scale in the checkpoint makes the whole cache per head
(`configure_kv_scale_granularity`, before the model is compiled or captured); a per-tensor
scale beside it then fills every head of its layer.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

from pagemill.blockpool import CacheConfig
from pagemill.runtime.model_executor.weights import safetensors_files

if TYPE_CHECKING:
    from pagemill.runtime.worker.kv_cache import KVCache

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")

# The part of a name after "layers.N." -> which scale it holds ("kv": both, legacy).
SCALE_NAMES: dict[str, str] = {
    "self_attn.k_scale": "k",
    "self_attn.v_scale": "v",
    "self_attn.attn.k_scale": "k",
    "self_attn.attn.v_scale": "v",
    "self_attn.k_proj.k_scale": "k",
    "self_attn.v_proj.v_scale": "v",
    "self_attn.k_proj.output_scale": "k",
    "self_attn.v_proj.output_scale": "v",
    "self_attn.kv_scale": "kv",
    "self_attn.attn.kv_scale": "kv",
}


# A layer's scale: one value, or one per KV head.
Scale = float | list[float]


@dataclass
class CheckpointKVScales:
    """Per-layer scales found in a checkpoint (None: that layer has none)."""

    k: list[Scale | None]
    v: list[Scale | None]
    names: list[str] = field(default_factory=list)

    @property
    def per_head(self) -> bool:
        return any(isinstance(s, list) for s in (*self.k, *self.v))

    @property
    def num_layers_with_scales(self) -> int:
        return sum(k is not None or v is not None for k, v in zip(self.k, self.v))


def kv_scale_names(folder: str | Path) -> list[str]:
    """Names of the checkpoint's K/V cache scale tensors (from the headers only)."""
    try:
        files = safetensors_files(folder)
    except (FileNotFoundError, ValueError):
        return []
    names = []
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names += [n for n in f.keys() if _which(n) is not None]  # noqa: SIM118
    return names


def _which(name: str) -> tuple[int, str] | None:
    m = _LAYER.search(name)
    which = SCALE_NAMES.get(m.group(2)) if m else None
    return None if m is None or which is None else (int(m.group(1)), which)


def _per_head(name: str, shape: tuple[int, ...], num_kv_heads: int | None) -> bool:
    """Whether a scale of ``shape`` is per KV head (else per tensor); refuses other shapes."""
    if math.prod(shape) == 1:
        return False
    if (
        num_kv_heads is not None
        and len(shape) >= 1
        and shape[0] == num_kv_heads
        and math.prod(shape[1:]) == 1
    ):
        return True
    heads = "" if num_kv_heads is None else f" or [num_kv_heads={num_kv_heads}]"
    raise ValueError(
        f"checkpoint tensor {name} has shape {shape}: KV cache scales are served per tensor "
        f"(one value per layer){heads}; per-channel or other scales are not supported"
    )


def checkpoint_has_per_head_kv_scales(folder: str | Path, num_kv_heads: int) -> bool:
    """Whether any K/V cache scale of the checkpoint is per KV head (headers only)."""
    try:
        files = safetensors_files(folder)
    except (FileNotFoundError, ValueError):
        return False
    found = False
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open objects are not iterable
                if _which(name) is not None:
                    shape = tuple(f.get_slice(name).get_shape())
                    found = _per_head(name, shape, num_kv_heads) or found
    return found


def read_kv_scales(
    folder: str | Path, num_layers: int, num_kv_heads: int | None = None
) -> CheckpointKVScales | None:
    """The checkpoint's K/V cache scales, or None when it has none (or no safetensors).
    With ``num_kv_heads``, a scale of that many elements is read as one per KV head."""
    try:
        files = safetensors_files(folder)
    except (FileNotFoundError, ValueError):
        return None
    k: list[Scale | None] = [None] * num_layers
    v: list[Scale | None] = [None] * num_layers
    legacy: list[Scale | None] = [None] * num_layers
    names: list[str] = []
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open objects are not iterable
                found = _which(name)
                if found is None:
                    continue
                layer, which = found
                if layer >= num_layers:
                    raise ValueError(
                        f"checkpoint tensor {name} is a KV cache scale of layer {layer}, "
                        f"but the model has {num_layers} layers"
                    )
                shape = tuple(f.get_slice(name).get_shape())
                values = [float(x) for x in f.get_tensor(name).float().reshape(-1).tolist()]
                bad = [x for x in values if not math.isfinite(x) or x <= 0]
                if bad:
                    raise ValueError(
                        f"checkpoint tensor {name} holds {bad[0]}: a KV cache scale must be "
                        "a positive finite number"
                    )
                value: Scale = values if _per_head(name, shape, num_kv_heads) else values[0]
                names.append(name)
                target = {"k": k, "v": v, "kv": legacy}[which]
                target[layer] = value
    if not names:
        return None
    # The legacy single scale stands for whichever of K and V has no scale of its own.
    for i, s in enumerate(legacy):
        if s is not None:
            k[i] = s if k[i] is None else k[i]
            v[i] = s if v[i] is None else v[i]
    return CheckpointKVScales(k, v, names)


def configure_kv_scale_granularity(
    kv_cache: KVCache | None, folder: str | Path | None, cache: CacheConfig, num_kv_heads: int
) -> bool:
    """Make ``kv_cache``'s scales per KV head where asked (``kv_scales_per_head``) or where
    the checkpoint's scales, which this cache will use, are per head; True if so. Called
    before the model is compiled or its CUDA graphs captured: they read these tensors."""
    if kv_cache is None or cache.kv_cache_dtype == "auto":
        return False
    per_head = cache.kv_scales_per_head
    if not per_head and folder is not None and _uses_checkpoint_scales(cache):
        per_head = checkpoint_has_per_head_kv_scales(folder, num_kv_heads)
        if per_head:
            logger.info("the checkpoint's KV cache scales are per KV head: the cache's too")
    if per_head:
        kv_cache.use_per_head_scales(num_kv_heads)
    return per_head


def _uses_checkpoint_scales(cache: CacheConfig) -> bool:
    return cache.kv_cache_dtype.startswith("fp8") and not cache.calculate_kv_scales


def apply_checkpoint_kv_scales(
    kv_cache: KVCache | None,
    folder: str | Path,
    cache: CacheConfig,
    num_layers: int,
    num_kv_heads: int | None = None,
) -> CheckpointKVScales | None:
    """Load the checkpoint's scales into ``kv_cache`` (a `worker.kv_cache.KVCache`) where
    they apply: an fp8 cache without ``calculate_kv_scales``. Elsewhere they are left
    unused with a log line saying so (a float cache needs none; calculated scales, and
    int8's, come from the first prefill)."""
    names = kv_scale_names(folder)
    if not names:
        return None
    # Where they go unused they are not read either: a shape we could not serve is no error.
    found = f"{len(names)} KV cache scale tensors (e.g. {names[0]})"
    if cache.kv_cache_dtype == "auto":
        logger.info(
            "checkpoint has %s; not used: kv_cache_dtype is auto (set --kv-cache-dtype fp8 "
            "to use them)",
            found,
        )
        return None
    if cache.calculate_kv_scales:
        logger.info(
            "checkpoint has %s; not used: --calculate-kv-scales sets the scales from the "
            "first prefill",
            found,
        )
        return None
    if not cache.kv_cache_dtype.startswith("fp8"):
        logger.info("checkpoint has %s; not used by a %s cache", found, cache.kv_cache_dtype)
        return None
    scales = read_kv_scales(folder, num_layers, num_kv_heads)
    if kv_cache is None or scales is None:
        return None
    kv_cache.load_scales(scales.k, scales.v)
    n = scales.num_layers_with_scales
    logger.info("KV cache scales from the checkpoint: %d of %d layers (%s)", n, num_layers, found)
    if n < num_layers:
        logger.warning("%d layers have no KV cache scale in the checkpoint: 1.0", num_layers - n)
    return scales
