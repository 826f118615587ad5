"""GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum) repacked into `Int4Groups` / `Int8Blocks`.

Per linear layer with K inputs and N outputs, `bits` b and 32 / b values per int32 word:
- `qweight` int32 [K * b / 32, N]: packed along the input dim, value i of a word at bits
  [i*b, (i+1)*b) (row r holds inputs r * 32/b ...);
- `qzeros` int32 [G, N * b / 32]: packed along the output dim the same way;
- `scales` fp16 [G, N]; `g_idx` int32 [K]: the group of each input (k // group_size unless
  the checkpoint was quantized with act-order, `desc_act`);
- w[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n].
The original format (`checkpoint_format: gptq`, "v1") stores z - 1 (a historical off-by-one
the kernels undo); `gptq_v2` stores z. `group_size: -1` is one group per output channel.
Act-order groups are not contiguous, so those layers are dequantized (see `int_groups`).
"""

from __future__ import annotations

from typing import Any

import torch

from pagemill.runtime.model_executor.quantization.formats import QuantizedRows
from pagemill.runtime.model_executor.quantization.hf_config import (
    QuantizationConfig,
    option_error,
    require,
)
from pagemill.runtime.model_executor.quantization.int_groups import int_rows, unpack_int32

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


class GPTQConfig(QuantizationConfig):
    quant_method = "gptq"
    parts = frozenset({"qweight", "qzeros", "scales", "g_idx"})

    def __init__(self, dtype: torch.dtype, bits: int, group_size: int, v2: bool) -> None:
        super().__init__(dtype)
        self.bits, self.group_size, self.v2 = bits, group_size, v2

    @classmethod
    def from_config(cls, q: dict[str, Any], dtype: torch.dtype) -> GPTQConfig:
        bits = q.get("bits")
        if bits not in (4, 8):
            raise option_error("gptq", "bits", bits, "4 or 8 bits")
        fmt = str(q.get("checkpoint_format", "gptq")).lower()
        if q.get("is_marlin_format") or fmt not in CHECKPOINT_FORMATS:
            value = "marlin" if q.get("is_marlin_format") else q.get("checkpoint_format")
            raise option_error("gptq", "checkpoint_format", value, f"one of {CHECKPOINT_FORMATS}")
        if q.get("dynamic"):
            raise option_error("gptq", "dynamic", "per-module overrides", "one scheme for all")
        group_size = int(q.get("group_size", 128))
        if group_size == 0 or group_size < -1:
            raise option_error("gptq", "group_size", group_size, "-1 or a positive size")
        return cls(dtype, bits, group_size, fmt == "gptq_v2")

    def describe(self) -> str:
        groups = "per channel" if self.group_size == -1 else f"groups of {self.group_size}"
        return f"gptq ({self.bits}-bit, {groups})"

    def is_quantized_module(self, prefix: str, names: set[str]) -> bool:
        return f"{prefix}.qweight" in names

    def convert(
        self, prefix: str, tensors: dict[str, torch.Tensor]
    ) -> torch.Tensor | QuantizedRows:
        require(prefix, tensors, "qweight", "qzeros", "scales")
        b = self.bits
        q = unpack_int32(tensors["qweight"], b, dim=0).T  # [N, K]
        zeros = unpack_int32(tensors["qzeros"], b, dim=1).T  # [N, G]
        scales = tensors["scales"].T  # [N, G]
        if not self.v2:
            zeros = zeros + 1
        n, k = q.shape
        if scales.shape != zeros.shape or scales.shape[0] != n:
            raise ValueError(
                f"GPTQ module {prefix}: qweight {tuple(tensors['qweight'].shape)}, qzeros "
                f"{tuple(tensors['qzeros'].shape)} and scales {tuple(tensors['scales'].shape)} "
                f"do not fit {b}-bit GPTQ"
            )
        g_idx = tensors.get("g_idx")
        if g_idx is not None and g_idx.shape != (k,):
            raise ValueError(f"GPTQ module {prefix}: g_idx {tuple(g_idx.shape)}, expected ({k},)")
        rows, served = int_rows(q, zeros, scales, b, g_idx, self.dtype, "GPTQ")
        self.served[served] += 1
        return rows
