"""Dense bf16 weights prepacked for oneDNN once, instead of at every call.

A bf16 `F.linear` on CPU hands the weight to oneDNN in PyTorch's plain [out, in] layout,
and oneDNN reorders it into its blocked layout inside every call: at the row counts where
a step runs dense weights (prefill chunks, large decode batches, the LM head) that reorder
is a large share of the GEMM. Inductor's `freezing` prepacks the weights of a compiled
graph, but the compile cache compiles without it (weights stay graph inputs), and the LM
head and eager steps run outside any graph. So each dense bf16 weight gets a prepacked twin
(`torch.ops.mkldnn._reorder_linear_weight`), hung on the weight tensor itself, and a layer
computes through it (`mkldnn._linear_pointwise`, the op `freezing` emits). A compiled graph
calls it through an opaque custom op that looks the twin up on the weight it is handed.

The twin costs as much memory as the dense weight again, and it is off by default:
`PAGEMILL_PREPACK_DENSE=1` turns it on. It waits for a quiet-machine A/B of the compiled
step (`benchmarks/step_ab.py --variant prepack`): the compile cache's unfrozen graph
measured within a few percent of the frozen (prepacked) one, and the opaque op adds a
Python call per layer, so the gain is not yet shown to be worth the memory. A weight
written in place afterwards (its version counter moved) is not served by its stale twin:
the layer falls back to `F.linear`.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pagemill.runtime.switches import env_switch

logger = logging.getLogger(__name__)

PREPACK_ENV = "PAGEMILL_PREPACK_DENSE"
_ATTR = "_pagemill_mkldnn"


def prepack_enabled() -> bool:
    """On when `PAGEMILL_PREPACK_DENSE=1`; a value other than 0 or 1 is refused."""
    return env_switch(PREPACK_ENV, default=False)


def _version(t: torch.Tensor) -> int:
    try:
        return int(t._version)
    except RuntimeError:  # an inference tensor tracks no versions (and cannot be written)
        return -1


def can_prepack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def prepack(weight: torch.Tensor) -> None:
    """Give `weight` its prepacked twin (idempotent while the weight is unchanged)."""
    entry = getattr(weight, _ATTR, None)
    if entry is not None and entry[0] == _version(weight):
        return
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    setattr(weight, _ATTR, (_version(weight), packed))


def _twin(weight: torch.Tensor) -> torch.Tensor | None:
    entry = getattr(weight, _ATTR, None)
    if entry is None or entry[0] != _version(weight):
        return None
    return entry[1]


def prepacked_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` through the weight's prepacked twin when it has one."""
    packed = _twin(weight)
    if packed is None or x.dtype != weight.dtype or x.device != weight.device:
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
    return y.view(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("pagemill::prepacked_linear", mutates_args=())
def _prepacked_linear_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`prepacked_linear`, opaque to a compiled graph (the twin is not a graph input)."""
    return prepacked_linear(x, weight, bias)


@_prepacked_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def prepack_dense_weights(model: nn.Module, memory_bytes: int | None = None) -> int:
    """Prepack the dense bf16 weight (or dense copy) of every `Linear` of `model`, and a
    dense LM head outside one; returns the bytes the twins take (0 when off, not
    applicable, or when they would take more than the share of the machine's memory that
    `--cpu-dense-weights auto` allows dense copies: a model that barely fits is not
    doubled)."""
    from pagemill.runtime.model_executor.layers.linear import Linear
    from pagemill.runtime.model_executor.quantization.plan import (
        DENSE_COPY_RAM_SHARE,
        machine_memory_bytes,
    )

    if not prepack_enabled():
        return 0
    weights: dict[int, torch.Tensor] = {}
    layers = [
        m
        for m in model.modules()
        if isinstance(m, Linear) and m.weight is not None and can_prepack(m.weight)
    ]
    for m in layers:
        assert m.weight is not None
        weights[id(m.weight)] = m.weight
    head = getattr(model, "lm_head_weight", None)
    if (
        getattr(model, "logits_proj", None) is None
        and isinstance(head, torch.Tensor)
        and can_prepack(head)
    ):
        weights[id(head)] = head  # `compute_logits` of a model without logits_proj
    total = sum(w.numel() * w.element_size() for w in weights.values())
    if not total:
        return 0
    memory = machine_memory_bytes() if memory_bytes is None else memory_bytes
    if total > DENSE_COPY_RAM_SHARE * memory:
        logger.info(
            "dense bf16 weights not prepacked: %.0f MiB exceeds %.0f%% of %.1f GB RAM",
            total / (1 << 20),
            100 * DENSE_COPY_RAM_SHARE,
            memory / 1e9,
        )
        return 0
    for w in weights.values():
        prepack(w)
    for m in layers:
        m.prepacked = True
    logger.info("dense bf16 weights prepacked for oneDNN: %.0f MiB", total / (1 << 20))
    return total
