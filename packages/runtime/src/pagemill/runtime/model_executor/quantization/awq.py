"""AWQ checkpoints (AutoAWQ's GEMM layout) repacked into `Int4Groups`.

The GEMM layout stores, per linear layer with K inputs and N outputs:
- `qweight` int32 [K, N / 8]: eight 4-bit values per word along the output dim, in AWQ's
  interleaved order — nibble i of word j holds output column 8j + [0, 2, 4, 6, 1, 3, 5, 7][i]
  (chosen for its fast dequantization on GPUs);
- `qzeros` int32 [K / g, N / 8], packed the same way; `scales` fp16 [K / g, N];
- w[n, k] = (q[k, n] - z[k // g, n]) * s[k // g, n].
The GEMV layout (`version: gemv`) packs along the input dim in another order; it is refused
rather than guessed.
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

# Nibble i of a word holds column AWQ_PACK_ORDER[i] of its eight.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Column j of the eight is in nibble _AWQ_UNPACK[j].
_AWQ_UNPACK = [AWQ_PACK_ORDER.index(j) for j in range(8)]


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C / 8] in AWQ's order -> uint8 [R, C] in column order."""
    nibbles = unpack_int32(packed, 4, dim=1).view(packed.shape[0], -1, 8)
    return nibbles[..., _AWQ_UNPACK].reshape(packed.shape[0], -1)


class AWQConfig(QuantizationConfig):
    quant_method = "awq"
    parts = frozenset({"qweight", "qzeros", "scales"})

    def __init__(self, dtype: torch.dtype, group_size: int) -> None:
        super().__init__(dtype)
        self.group_size = group_size

    @classmethod
    def from_config(cls, q: dict[str, Any], dtype: torch.dtype) -> AWQConfig:
        bits = q.get("bits", q.get("w_bit"))
        if bits != 4:
            raise option_error("awq", "bits", bits, "AWQ is read with 4 bits")
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise option_error("awq", "version", q.get("version"), "only the GEMM layout")
        if not q.get("zero_point", True):
            raise option_error("awq", "zero_point", q.get("zero_point"), "zero points required")
        group_size = int(q.get("group_size", q.get("q_group_size", 128)))
        if group_size <= 0:
            raise option_error("awq", "group_size", group_size, "groups of a positive size")
        return cls(dtype, group_size)

    def describe(self) -> str:
        return f"awq (gemm, groups of {self.group_size})"

    def is_quantized_module(self, prefix: str, names: set[str]) -> bool:
        return f"{prefix}.qweight" in names

    def convert(
        self, prefix: str, tensors: dict[str, torch.Tensor]
    ) -> torch.Tensor | QuantizedRows:
        require(prefix, tensors, "qweight", "qzeros", "scales")
        q = unpack_awq(tensors["qweight"]).T.contiguous()  # [N, K]
        zeros = unpack_awq(tensors["qzeros"]).T  # [N, K / g]
        scales = tensors["scales"].T
        n, k = q.shape
        if scales.shape != zeros.shape or scales.shape[0] != n or k % scales.shape[1]:
            raise ValueError(
                f"AWQ module {prefix}: qweight {tuple(tensors['qweight'].shape)}, qzeros "
                f"{tuple(tensors['qzeros'].shape)} and scales {tuple(tensors['scales'].shape)} "
                "do not fit the GEMM layout"
            )
        rows, served = int_rows(q, zeros, scales, 4, None, self.dtype, "AWQ")
        self.served[served] += 1
        return rows
