"""How many bytes of weights a model serves, and how many a small-batch step reads."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from pagemill.runtime.model_executor.quantization.gguf_blocks import RequantError

MB = 1e6


@dataclass
class WeightReport:
    total_bytes: int = 0  # resident: parameters and packed buffers, shared tensors once
    packed_bytes: int = 0  # int8/int4 weights and their scales
    dense_copy_bytes: int = 0  # dense copies kept next to packed weights (large batches)
    embedding_bytes: int = 0  # the embedding table (a lookup reads only its rows)
    # What a step of few tokens streams: every layer's served weights (packed when packed),
    # norms and the LM head; not the embedding table.
    step_bytes: int = 0
    formats: Counter = field(default_factory=Counter)  # "int4 (Q4_1)" -> number of linears
    # GGML type -> (served as, max abs error, mean abs error) of rows requantized on load
    # (types no packed format holds exactly), against the gguf package's dequantization.
    requantized: dict[str, tuple[str, float, float]] = field(default_factory=dict)

    def summary(self) -> str:
        fmts = ", ".join(f"{n} {k}" for k, n in sorted(self.formats.items(), key=lambda kv: -kv[1]))
        parts = [f"{self.total_bytes / MB:.1f} MB resident ({fmts})"]
        if self.packed_bytes:
            parts.append(f"packed {self.packed_bytes / MB:.1f} MB")
        if self.dense_copy_bytes:
            parts.append(f"dense copies for large batches {self.dense_copy_bytes / MB:.1f} MB")
        parts.append(f"embedding {self.embedding_bytes / MB:.1f} MB")
        parts.append(f"a small-batch step reads {self.step_bytes / MB:.1f} MB")
        for qtype, (served_as, max_abs, mean_abs) in sorted(self.requantized.items()):
            parts.append(
                f"{qtype} requantized to {served_as} (abs error max {max_abs:.3g}, "
                f"mean {mean_abs:.3g})"
            )
        return "; ".join(parts)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def weight_report(
    model: nn.Module, requant_errors: Mapping[str, RequantError] | None = None
) -> WeightReport:
    from pagemill.runtime.model_executor.layers.linear import Linear

    report = WeightReport()
    for qtype, err in (requant_errors or {}).items():
        report.requantized[qtype] = (err.served_as, err.max_abs, err.mean_abs)
    # A tensor is counted once however many modules hold it (tied weights), keyed by its own
    # bytes: distinct views of one storage (packed weights in one huge-page mapping,
    # `huge_page_weights`) each count.
    seen: set[tuple[int, int]] = set()

    def count(t: torch.Tensor | None) -> int:
        if t is None or t.numel() == 0:
            return 0
        key = (t.data_ptr(), _nbytes(t))
        if key in seen:
            return 0
        seen.add(key)
        report.total_bytes += _nbytes(t)
        return _nbytes(t)

    embed = getattr(model, "embed_tokens", None)
    if isinstance(embed, torch.Tensor):
        report.embedding_bytes = count(embed)
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        label = module.weight_format + ("" if module.source == "dense" else f" ({module.source})")
        report.formats[label if not name.startswith("logits_proj") else f"LM head {label}"] += 1
        bias = count(module.bias)
        if module.format == "dense":
            report.step_bytes += _nbytes(module.weight) + bias
            count(module.weight)
            continue
        packed = sum(
            count(t) for t in (module.qweight, module.scales, module.scales_and_zeros, module.zeros)
        )
        report.packed_bytes += packed
        report.step_bytes += packed + bias
        report.dense_copy_bytes += count(module.weight)
    for module in model.modules():
        if getattr(module, "w13_qweight", None) is not None:  # packed experts (`FusedMoE`)
            fmt = "int4x2" if getattr(module, "planes", [1]) != [1, 1] else "int4"
            report.formats[f"experts {fmt} ({getattr(module, 'source', '?')})"] += 1
            packed = sum(count(t) for t in module.buffers(recurse=False))
            report.packed_bytes += packed
            report.step_bytes += packed
    linear_params = {
        id(p) for m in model.modules() if isinstance(m, Linear) for p in m.parameters(recurse=False)
    }
    for p in model.parameters():
        if id(p) in linear_params or (embed is not None and p is embed):
            continue
        count(p)
        report.step_bytes += _nbytes(p)  # norms; a dense untied LM head
    if (
        getattr(model, "logits_proj", None) is None
        and getattr(model, "lm_head", None) is None
        and embed is not None
    ):
        report.step_bytes += _nbytes(embed)  # the tied dense head reads the whole table
    return report
