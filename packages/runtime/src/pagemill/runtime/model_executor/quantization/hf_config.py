"""Quantized Hugging Face checkpoints: which `quant_method` a folder uses, and its tensors
turned into the rows a `Linear` takes.

A quantized checkpoint stores each quantized projection as several tensors under the
module's name (`qweight`/`qzeros`/`scales` for AWQ and GPTQ, `weight_packed`/`weight_scale`
for compressed-tensors, an fp8 `weight` with its scale for FP8) and no `.weight` at all —
or, worse for FP8, a `.weight` whose values mean nothing without their scale. So the
`quantization_config` in config.json is read before anything loads, and a method (or an
option of one) that is not understood here is refused at start-up, naming it: loading such
a checkpoint as plain weights would serve garbage.

Each method (`awq`, `gptq`, `compressed_tensors`, `fp8`) says which tensors make up one
quantized module and converts them (`QuantizationConfig.convert`); `quantized_weights`
streams the checkpoint, gathers each module's tensors as they come (a module may span two
safetensors shards) and yields `<module>.weight` as `Int4Groups` / `Int8Blocks` (kept packed
where the plan says so) or, where no packed format is exact, a dense tensor in the model's
dtype (the loader logs which).
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pagemill.runtime.model_executor.quantization.formats import QuantizedRows

logger = logging.getLogger(__name__)

# What the loader reads; everything else named in a quantization_config is refused.
SUPPORTED = (
    "awq (version gemm), gptq, compressed-tensors (pack-quantized, float-quantized), fp8, "
    "mxfp4 (gpt-oss experts, dequantized)"
)


class UnsupportedQuantization(ValueError):
    """A quantization_config (or one of its options) pagemill cannot load correctly."""


class QuantizationConfig(ABC):
    """One checkpoint's quantization method: which tensors form a quantized module, and how
    they become a `Linear`'s rows."""

    quant_method: str
    # Tensor leaf names (after the module prefix) that belong to a quantized module.
    parts: frozenset[str]
    # Leaves (anywhere) read but not used: activation / KV-cache scales for kernels that
    # quantize activations; pagemill computes activations in the model dtype.
    unused: frozenset[str] = frozenset()

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.served: Counter[str] = Counter()  # "int4 groups of 128" -> modules, for the log

    @classmethod
    @abstractmethod
    def from_config(cls, q: dict[str, Any], dtype: torch.dtype) -> QuantizationConfig:
        """The method's reader for `quantization_config` `q`; raises on what it cannot read."""

    @abstractmethod
    def is_quantized_module(self, prefix: str, names: set[str]) -> bool:
        """Whether the module `prefix` holds quantized tensors (given every tensor name)."""

    @abstractmethod
    def convert(
        self, prefix: str, tensors: dict[str, torch.Tensor]
    ) -> torch.Tensor | QuantizedRows:
        """The module's [out, in] weight rows from its tensors (leaf name -> tensor)."""

    def describe(self) -> str:
        return self.quant_method

    def notes(self) -> list[str]:
        """What the log should say once everything is converted (e.g. rounding measured)."""
        return []

    def rewrite(
        self, names: set[str], weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedRows]] | None:
        """The whole stream converted by the method itself, for one whose tensors are not
        per-module rows (MXFP4's stacked experts); None: `convert` per module."""
        return None

    def module_parts(self, names: set[str]) -> dict[str, set[str]]:
        """Quantized module prefix -> the full names of its tensors present in the checkpoint."""
        prefixes = {n.rsplit(".", 1)[0] for n in names if "." in n}
        out: dict[str, set[str]] = {}
        for p in prefixes:
            if self.is_quantized_module(p, names):
                out[p] = {f"{p}.{leaf}" for leaf in self.parts if f"{p}.{leaf}" in names}
        return out


def read_quantization_config(folder: Path) -> dict[str, Any] | None:
    """config.json's `quantization_config` (older exports: `compression_config`, or a GPTQ
    `quantize_config.json` beside it), or None for an unquantized checkpoint."""
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    q = config.get("quantization_config") or config.get("compression_config")
    if q is None and (folder / "quantize_config.json").is_file():
        q = json.loads((folder / "quantize_config.json").read_text())
        q.setdefault("quant_method", "gptq")  # AutoGPTQ's file predates the key
    if q is not None and not isinstance(q, dict):
        raise UnsupportedQuantization(f"quantization_config in {config_file} is not an object")
    return q


def get_quantization_config(folder: Path, dtype: torch.dtype) -> QuantizationConfig | None:
    """The checkpoint's method, or None when it is not quantized; raises
    `UnsupportedQuantization` naming the method (and option) pagemill cannot load."""
    q = read_quantization_config(folder)
    if q is None:
        return None
    method = str(q.get("quant_method", "")).lower().replace("_", "-")
    from pagemill.runtime.model_executor.quantization.awq import AWQConfig
    from pagemill.runtime.model_executor.quantization.compressed_tensors import (
        CompressedTensorsConfig,
    )
    from pagemill.runtime.model_executor.quantization.fp8 import Fp8Config
    from pagemill.runtime.model_executor.quantization.gptq import GPTQConfig
    from pagemill.runtime.model_executor.quantization.mxfp4 import Mxfp4Config

    methods: dict[str, type[QuantizationConfig]] = {
        "awq": AWQConfig,
        "gptq": GPTQConfig,
        "compressed-tensors": CompressedTensorsConfig,
        "fp8": Fp8Config,
        "mxfp4": Mxfp4Config,
    }
    cls = methods.get(method)
    if cls is None:
        raise UnsupportedQuantization(
            f"{folder}: quantization_config has quant_method "
            f"{q.get('quant_method')!r}, which pagemill cannot load (its tensors are not plain "
            f"weights); supported: {SUPPORTED}"
        )
    return cls.from_config(q, dtype)


def declared_quantization(
    quantization: str | None, quant: QuantizationConfig | None, folder: Path
) -> str | None:
    """`quantization` as the weight plan takes it: vLLM's name of the checkpoint's own method
    (`--quantization awq`) is checked against the checkpoint and then means nothing more."""
    from pagemill.runtime.config import CHECKPOINT_QUANTIZATIONS

    if quantization not in CHECKPOINT_QUANTIZATIONS:
        return quantization
    declared = None if quant is None else quant.quant_method
    if declared != quantization:
        found = "not quantized" if declared is None else f"quantized with {declared!r}"
        raise ValueError(
            f"quantization={quantization!r}, but {folder} is {found}; pagemill reads a "
            "checkpoint's own quantization (drop the option) and quantizes on load only to "
            "int8 / int4"
        )
    return None


def checkpoint_names(files: Iterable[Path]) -> set[str]:
    """Every tensor name in the checkpoint (headers only)."""
    names: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names.update(f.keys())
    return names


def quantized_weights(
    quant: QuantizationConfig,
    names: set[str],
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor | QuantizedRows]]:
    """`weights` with each quantized module's tensors replaced by its `<module>.weight` rows.

    A module's rows are yielded as soon as all its tensors have been read, so only the
    modules split across the stream are held at once.
    """
    rewritten = quant.rewrite(names, weights)
    if rewritten is not None:
        yield from rewritten
        for k, n in sorted(quant.served.items()):
            logger.info("%s: %d tensors %s", quant.describe(), n, k)
        return
    groups = quant.module_parts(names)
    owner = {name: prefix for prefix, members in groups.items() for name in members}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    skipped: Counter[str] = Counter()
    for name, tensor in weights:
        prefix = owner.get(name)
        if prefix is None:
            leaf = name.rsplit(".", 1)[-1]
            if leaf in quant.unused:
                skipped[leaf] += 1
                continue
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[name[len(prefix) + 1 :]] = tensor
        if len(parts) == len(groups[prefix]):
            del pending[prefix]
            yield prefix + ".weight", quant.convert(prefix, parts)
    if pending:  # cannot happen with a consistent header; say which module if it does
        prefix = next(iter(pending))
        raise ValueError(f"{quant.describe()}: tensors of {prefix} were listed but not read")
    if skipped:
        logger.info(
            "%s: not used by the weights (activations stay in %s; an fp8 KV cache reads "
            "its k/v scales on its own): %s",
            quant.describe(),
            str(quant.dtype).removeprefix("torch."),
            ", ".join(f"{n} {leaf}" for leaf, n in sorted(skipped.items())),
        )
    if quant.served:
        logger.info(
            "%s: %s",
            quant.describe(),
            ", ".join(f"{n} modules as {k}" for k, n in sorted(quant.served.items())),
        )
    for note in quant.notes():
        logger.info("%s: %s", quant.describe(), note)


def require(prefix: str, tensors: dict[str, torch.Tensor], *leaves: str) -> None:
    missing = [leaf for leaf in leaves if leaf not in tensors]
    if missing:
        raise ValueError(f"quantized module {prefix} lacks {', '.join(missing)}")


def option_error(method: str, option: str, value: Any, supported: str) -> UnsupportedQuantization:
    return UnsupportedQuantization(
        f"quantization_config: {method} with {option}={value!r} is not supported ({supported}); "
        f"refusing to load it rather than serve wrong weights"
    )
