"""compressed-tensors checkpoints (llm-compressor's output): `pack-quantized` integer weights
(w4a16, w8a16) repacked into `Int4Groups` / `Int8Blocks`, `float-quantized` fp8 weights
dequantized like `fp8`.

`pack-quantized` stores per linear layer with K inputs and N outputs and b bits:
- `weight_packed` int32 [N, ceil(K * b / 32)]: the signed values q' (-2^(b-1) .. 2^(b-1) - 1)
  plus 2^(b-1), packed along the input dim, value i of a word at bits [i*b, (i+1)*b);
- `weight_scale` [N, G] (G = K / group_size for the group strategy, 1 per channel);
- `weight_zero_point` (asymmetric only) [ceil(N * b / 32), G] int32, the signed zero points
  plus 2^(b-1) packed along the output dim; `weight_g_idx` [K] with act-order groups;
- `weight_shape` [2] = (N, K); w = (q' - zp') * s, i.e. (q - z) * s in the stored unsigned
  values with z = 2^(b-1) when symmetric.
`float-quantized` stores `weight` as float8 with `weight_scale` per tensor, row, group or
block. Activation quantization (`input_activations`) is a kernel choice of the checkpoint's
authors: activations stay in the model dtype here, which the log says.
"""

from __future__ import annotations

from typing import Any

import torch

from pagemill.runtime.model_executor.quantization.formats import QuantizedRows
from pagemill.runtime.model_executor.quantization.fp8 import ACTIVATION_SCALES, Fp8Rounding
from pagemill.runtime.model_executor.quantization.hf_config import (
    QuantizationConfig,
    UnsupportedQuantization,
    option_error,
    require,
)
from pagemill.runtime.model_executor.quantization.int_groups import int_rows, unpack_int32

FORMATS = ("pack-quantized", "float-quantized")
INT_STRATEGIES = ("group", "channel", "tensor")
FLOAT_STRATEGIES = ("tensor", "channel", "group", "block")


class CompressedTensorsConfig(QuantizationConfig):
    quant_method = "compressed-tensors"
    parts = frozenset(
        {
            "weight",
            "weight_packed",
            "weight_scale",
            "weight_zero_point",
            "weight_g_idx",
            "weight_shape",
        }
    )
    unused = ACTIVATION_SCALES

    def __init__(
        self,
        dtype: torch.dtype,
        formats: set[str],
        bits: set[int],
        block: tuple[int, int] | None,
        act_quant: bool,
    ) -> None:
        super().__init__(dtype)
        self.formats, self.bits, self.block, self.act_quant = formats, bits, block, act_quant
        self.rounding = Fp8Rounding()

    @classmethod
    def from_config(cls, q: dict[str, Any], dtype: torch.dtype) -> CompressedTensorsConfig:
        m = "compressed-tensors"
        sparsity = q.get("sparsity_config") or {}
        if sparsity and sparsity.get("format", "dense") != "dense":
            raise option_error(m, "sparsity_config.format", sparsity.get("format"), "dense")
        status = q.get("quantization_status", "compressed")
        if status != "compressed":
            raise option_error(m, "quantization_status", status, "compressed checkpoints")
        groups = q.get("config_groups") or {}
        if not groups:
            raise UnsupportedQuantization(f"quantization_config: {m} without config_groups")
        formats, bits, blocks, act_quant = set(), set(), set(), False
        for name, group in groups.items():
            fmt = group.get("format") or q.get("format")
            if fmt not in FORMATS:
                raise option_error(m, f"format (config_groups.{name})", fmt, f"one of {FORMATS}")
            w = group.get("weights") or {}
            kind, nbits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
            if fmt == "pack-quantized":
                if kind != "int" or nbits not in (4, 8):
                    raise option_error(m, f"{name}.weights", f"{kind} {nbits}-bit", "int 4 or 8")
                if strategy not in INT_STRATEGIES:
                    raise option_error(m, f"{name}.weights.strategy", strategy, "group/channel")
                bits.add(int(nbits))
            else:
                if kind != "float" or nbits != 8:
                    raise option_error(m, f"{name}.weights", f"{kind} {nbits}-bit", "float 8")
                if strategy not in FLOAT_STRATEGIES:
                    raise option_error(m, f"{name}.weights.strategy", strategy, "tensor..block")
                if strategy == "block":
                    blocks.add(tuple(w.get("block_structure") or (128, 128)))
            if w.get("dynamic"):
                raise option_error(m, f"{name}.weights.dynamic", True, "static weight scales")
            formats.add(fmt)
            act_quant = act_quant or bool(group.get("input_activations"))
        if len(blocks) > 1:
            raise option_error(m, "block_structure", sorted(blocks), "one block shape")
        block = next(iter(blocks)) if blocks else None
        return cls(
            dtype, formats, bits, (int(block[0]), int(block[1])) if block else None, act_quant
        )

    def describe(self) -> str:
        return f"compressed-tensors ({', '.join(sorted(self.formats))})"

    def is_quantized_module(self, prefix: str, names: set[str]) -> bool:
        if f"{prefix}.weight_packed" in names:
            return True
        return f"{prefix}.weight" in names and f"{prefix}.weight_scale" in names

    def convert(
        self, prefix: str, tensors: dict[str, torch.Tensor]
    ) -> torch.Tensor | QuantizedRows:
        if "weight_packed" not in tensors:
            self.served[str(self.dtype).removeprefix("torch.")] += 1
            return self.rounding.dequantize(
                prefix, tensors["weight"], tensors["weight_scale"], self.block, self.dtype
            )
        require(prefix, tensors, "weight_packed", "weight_scale", "weight_shape")
        packed = tensors["weight_packed"]
        n, k = (int(v) for v in tensors["weight_shape"].tolist())
        bits = next((b for b in (4, 8) if packed.shape[1] == -(-k * b // 32)), None)
        if bits is None or bits not in self.bits or packed.shape[0] != n:
            raise ValueError(
                f"{prefix}.weight_packed {tuple(packed.shape)} does not hold a [{n}, {k}] weight "
                f"of {sorted(self.bits)} bits"
            )
        q = unpack_int32(packed, bits, dim=1)[:, :k]
        scales = tensors["weight_scale"]
        scales = scales.reshape(1, 1).expand(n, 1) if scales.numel() == 1 else scales
        if scales.dim() != 2 or scales.shape[0] != n:
            raise ValueError(f"{prefix}.weight_scale {tuple(scales.shape)} for [{n}, {k}]")
        zp = tensors.get("weight_zero_point")
        offset = 1 << (bits - 1)
        if zp is None:
            zeros = torch.full(scales.shape, offset, dtype=torch.int32)
        elif zp.dtype == torch.int32 and zp.shape[0] == -(-n * bits // 32):
            zeros = unpack_int32(zp, bits, dim=0)[:n]  # stored with the offset added
        elif tuple(zp.shape) == tuple(scales.shape):
            zeros = zp.to(torch.int32) + offset  # older exports: signed, unpacked
        else:
            raise ValueError(
                f"{prefix}.weight_zero_point {tuple(zp.shape)} for scales {scales.shape}"
            )
        rows, served = int_rows(
            q, zeros, scales, bits, tensors.get("weight_g_idx"), self.dtype, f"w{bits}a16"
        )
        self.served[served] += 1
        return rows

    def notes(self) -> list[str]:
        out = [self.rounding.note(self.dtype)] if self.rounding.modules else []
        if self.act_quant:
            out.append("the checkpoint also quantizes activations; they stay in the model dtype")
        return out
