"""Deciding, before loading, what every linear layer and the LM head are served as."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

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
MB = 1e6


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
    gguf_packed_fp32: bool = False,
) -> WeightPlan:
    """The plan for a model about to load.

    - `quantization` None: a safetensors model stays dense; a GGUF model served in bf16
      keeps its own quantized tensors packed (int4 groups, or int8 blocks as two int4
      planes: see `gguf_blocks`), its LM head too; in fp32 it is dequantized exactly into
      dense weights, unless `gguf_packed_fp32`: then it is packed as in bf16 (the packed
      kernels take fp32 activations), with dense fp32 copies for large batches. That is
      what an auto dtype serves on a CPU without bf16 arithmetic (`EngineCore`), where
      dense fp32 steps at a few rows stream several times the bytes of the packed rows.
      On a GPU in fp16/bf16, int4-group rows (GGUF Q4_0/Q4_1/Q4_K, AWQ, GPTQ,
      w4a16) stay packed for the Triton dequant-GEMM ("triton_int4") and every other row
      (Q8_0 and the int8-block types, Q6_K, FP8, the LM head) is dequantized to dense.
    - "int8" / "int4": every projection is quantized as asked (GGUF int4 rows of the same
      group size are kept as they are: no second rounding); the LM head becomes int8 per
      channel (a GGUF Q8_0 head is kept exact unless int8 is asked). CPU only.
    - `dense_fallback` None: keep dense copies for large batches where their GEMMs are
      native (fp32 on any CPU, bf16 where the CPU has bf16 arithmetic).
    - `packed_max_tokens` None: the row count where a packed layer hands over to its dense
      copy is measured on this machine once loaded (`crossover.measure_packed_limits`;
      `scheme.PACKED_MAX_TOKENS` until then, and when measuring is turned off).
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
        if gguf and device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
            return WeightPlan(WeightScheme("triton_int4", group_size), None)
        return WeightPlan(DENSE, None)
    if dense_fallback is None:
        dense_fallback = default_dense_fallback(dtype, device)
    base = WeightScheme(
        "dense",
        group_size,
        dense_fallback,
        packed_max_tokens,
        measure_packed_limit=packed_max_tokens is None,
    )
    head_limit = LM_HEAD_PACKED_MAX_TOKENS if packed_max_tokens is None else packed_max_tokens
    if quantization is None:
        packed_fp32 = gguf_packed_fp32 and dtype == torch.float32
        if not gguf or (dtype != torch.bfloat16 and not packed_fp32):
            # fp32 stays dense unless quantization or `gguf_packed_fp32` is asked: a GGUF's
            # rows are dequantized (exactly, in fp32).
            return WeightPlan(DENSE, None)
        native = replace(base, method="native")
        return WeightPlan(native, replace(native, packed_max_tokens=head_limit))
    head = replace(
        base,
        method="native" if gguf and quantization != "int8" else "int8",
        packed_max_tokens=head_limit,
    )
    return WeightPlan(replace(base, method=quantization), head)


# --cpu-dense-weights: whether packed layers keep a dense copy for large batches.
CPU_DENSE_WEIGHTS = ("auto", "always", "never")
# auto keeps the copies only while all of them fit in this share of the machine's memory.
DENSE_COPY_RAM_SHARE = 0.25


def machine_memory_bytes() -> int:
    """Physical memory, or the cgroup's limit when that is lower (a container)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total


def dense_copy_bytes(plan: WeightPlan, model: nn.Module) -> int:
    """What dense copies of every layer `plan` packs would take in `model` (built, the plan
    not applied yet); an upper bound: a layer whose rows turn out dense needs none. A tied
    LM head's copy is the embedding: free."""
    from pagemill.runtime.model_executor.layers.linear import Linear

    total = 0
    if plan.linear.method != "dense":
        for name, m in model.named_modules():
            if isinstance(m, Linear) and not name.startswith("logits_proj"):
                total += m.in_features * m.out_features * m.dtype.itemsize
    head = getattr(model, "lm_head", None)
    if plan.lm_head is not None and plan.lm_head.method != "dense" and head is not None:
        total += head.numel() * head.element_size()
    return total


def choose_dense_copies(
    plan: WeightPlan,
    model: nn.Module,
    mode: str,
    dtype: torch.dtype,
    device: torch.device,
    memory_bytes: int | None = None,
) -> tuple[WeightPlan, str | None]:
    """The plan with dense copies kept or dropped as `mode` says, and a line for the log
    (None when nothing is packed). Call after the model is built (its shapes are needed)
    and before `plan.apply`."""
    if mode not in CPU_DENSE_WEIGHTS:
        raise ValueError(f"cpu_dense_weights must be one of {CPU_DENSE_WEIGHTS}, got {mode!r}")
    if not plan.quantized or plan.linear.method == "triton_int4":
        return plan, None  # the GPU int4 GEMM keeps no dense copies
    need = dense_copy_bytes(plan, model)
    if mode == "always":
        keep, why = True, "asked for (always)"
    elif mode == "never":
        keep, why = False, "asked for (never)"
    elif not default_dense_fallback(dtype, device):
        keep, why = False, f"{str(dtype).removeprefix('torch.')} GEMMs are not native here (auto)"
    else:
        memory = machine_memory_bytes() if memory_bytes is None else memory_bytes
        budget = int(DENSE_COPY_RAM_SHARE * memory)
        keep = need <= budget
        why = (
            f"auto: {need / MB:.0f} MB {'fits' if keep else 'exceeds'} "
            f"{DENSE_COPY_RAM_SHARE:.0%} of {memory / 1e9:.1f} GB RAM"
        )
    asked = mode == "always"
    linear = replace(plan.linear, dense_fallback=keep, keep_dense_copy=asked)
    head = (
        None
        if plan.lm_head is None
        else replace(plan.lm_head, dense_fallback=keep, keep_dense_copy=asked)
    )
    # An upper bound, decided before the layers are built: a layer that runs large batches
    # on the matrix units from its packed blocks (`Linear.amx_large_rows`) keeps no copy, so
    # the line says what is allowed, and the weights' resident total what is held.
    line = (
        f"cpu_dense_weights: dense copies of packed layers for large batches "
        f"{'allowed' if keep else 'off'} (up to {need / MB:.0f} MB, none where a layer runs "
        f"them on the matrix units; {why})"
    )
    return WeightPlan(linear, head), line
