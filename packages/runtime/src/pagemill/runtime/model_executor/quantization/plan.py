"""Deciding, before loading, what every linear layer and the LM head are served as."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from pagemill.runtime.model_executor.quantization.formats import INT4_GROUP_SIZES, INT4_N_MULTIPLE
from pagemill.runtime.model_executor.quantization.scheme import (
    DEFAULT_GROUP_SIZE,
    DENSE,
    LM_HEAD_PACKED_MAX_TOKENS,
    WeightScheme,
    default_dense_fallback,
)

if TYPE_CHECKING:
    from pagemill.runtime.model_executor.models.llama import LlamaForCausalLM

QUANTIZATIONS = ("int8", "int4")


@dataclass(frozen=True)
class WeightPlan:
    linear: WeightScheme  # every projection of every layer
    lm_head: WeightScheme | None  # None: the dense head (the embedding, when tied)

    @property
    def quantized(self) -> bool:
        return self.linear.method != "dense"

    def apply(self, model: LlamaForCausalLM) -> None:
        """Set every `Linear`'s scheme (and the LM head's), or raise naming every layer that
        cannot be served as asked — before a single weight is read."""
        from pagemill.runtime.model_executor.layers.linear import Linear

        if self.linear.method == "int4":
            g = self.linear.group_size
            bad = [
                f"{name} [{m.out_features}, {m.in_features}]"
                for name, m in model.named_modules()
                if isinstance(m, Linear) and (m.in_features % g or m.out_features % INT4_N_MULTIPLE)
            ]
            if bad:
                shown = ", ".join(bad[:4]) + (f", ... ({len(bad)} in all)" if len(bad) > 4 else "")
                raise ValueError(
                    f"cannot quantize this model to int4 with groups of {g}: PyTorch's int4 CPU "
                    f"kernel needs in_features divisible by the group size and out_features "
                    f"divisible by {INT4_N_MULTIPLE}, and {shown} are not. Use quantization='int8' "
                    f"(any shape) or none."
                )
        for m in model.modules():
            if isinstance(m, Linear):
                m.scheme = self.linear
        if self.lm_head is not None:
            model.serve_lm_head_as(self.lm_head)


def plan_weights(
    quantization: str | None,
    *,
    gguf: bool,
    dtype: torch.dtype,
    device: torch.device,
    dense_fallback: bool | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
    packed_max_tokens: int | None = None,
) -> WeightPlan:
    """The plan for a model about to load.

    - `quantization` None: a safetensors model stays dense; a GGUF model served in bf16
      keeps its own Q4_0/Q4_1 (int4) and Q8_0 (exact two-plane int4) tensors packed, its
      LM head too, and dequantizes the rest; in fp32 (or on a GPU) it is dequantized
      exactly into dense weights.
    - "int8" / "int4": every projection is quantized as asked (GGUF int4 rows of the same
      group size are kept as they are: no second rounding); the LM head becomes int8 per
      channel (a GGUF Q8_0 head is kept exact unless int8 is asked). CPU only.
    - `dense_fallback` None: keep dense copies for large batches where bf16 GEMMs are native.
    """
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(
            f"unknown quantization {quantization!r}; expected one of {QUANTIZATIONS} or None"
        )
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if device.type != "cpu":
        if quantization is not None:
            raise ValueError(
                f"quantization={quantization!r} runs on CPU only (PyTorch's packed int8/int4 CPU "
                f"kernels), but the model is on {device}; drop the quantization or use device='cpu'"
            )
        return WeightPlan(DENSE, None)
    if dense_fallback is None:
        dense_fallback = default_dense_fallback(dtype, device)
    base = WeightScheme("dense", group_size, dense_fallback, packed_max_tokens)
    head_limit = LM_HEAD_PACKED_MAX_TOKENS if packed_max_tokens is None else packed_max_tokens
    if quantization is None:
        if not gguf or dtype != torch.bfloat16:
            # fp32 stays dense unless quantization is asked: a GGUF's rows are dequantized
            # (exactly, in fp32). The packed kernels would compute in bf16 anyway.
            return WeightPlan(DENSE, None)
        native = replace(base, method="native")
        return WeightPlan(native, replace(native, packed_max_tokens=head_limit))
    head = replace(
        base,
        method="native" if gguf and quantization != "int8" else "int8",
        packed_max_tokens=head_limit,
    )
    return WeightPlan(replace(base, method=quantization), head)
