"""FP8 checkpoints (`quant_method: fp8`, as published for Qwen3 / Llama / DeepSeek FP8
models) dequantized to the model's dtype.

Each quantized projection stores its `weight` as float8 (e4m3) and a float32 scale:
- per tensor: `weight_scale` (one value), w = q * s;
- block-scaled (`weight_block_size: [bn, bk]`, usually 128 x 128): `weight_scale_inv`
  [ceil(N / bn), ceil(K / bk)], w[n, k] = q[n, k] * s[n // bn, k // bk] (the name is
  DeepSeek's: the inverse of the scale used to quantize).
An e4m3 value has 4 significant bits and is no integer, so neither packed int format holds
it exactly; the product q * s is exact in fp32 (4 + 24 bits round once) and is served in the
model dtype — for bf16 one more rounding, at most 2^-8 relative, which is measured and logged.
Activation scales (`input_scale`, static activation quantization) and KV-cache scales are not
used: activations and the cache stay in the model dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from pagemill.runtime.model_executor.quantization.formats import QuantizedRows
from pagemill.runtime.model_executor.quantization.hf_config import (
    QuantizationConfig,
    option_error,
)

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
ACTIVATION_SCALES = frozenset({"input_scale", "k_scale", "v_scale", "kv_scale"})


def scaled(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None
) -> torch.Tensor:
    """weight (float8 [N, K]) times its scale — per tensor, row, group or block — in fp32,
    without materializing the scales at the weight's size."""
    n, k = weight.shape
    w = weight.float()
    s = scale.float()
    if s.numel() == 1:
        return w.mul_(s.reshape(()))
    if block is not None:
        bn, bk = block
        rows, cols = -(-n // bn), -(-k // bk)
        if tuple(s.shape) != (rows, cols):
            raise ValueError(f"block scales {tuple(s.shape)} do not fit [{n}, {k}] in {block}")
        if n % bn or k % bk:  # partial blocks at the edges: expand the scales
            return w.mul_(s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k])
        return w.view(rows, bn, cols, bk).mul_(s[:, None, :, None]).view(n, k)
    if s.dim() == 2 and s.shape[0] == n and k % s.shape[1] == 0:
        g = k // s.shape[1]
        return w.view(n, s.shape[1], g).mul_(s[:, :, None]).view(n, k)
    raise ValueError(f"scales {tuple(s.shape)} do not fit a [{n}, {k}] weight")


class Fp8Rounding:
    """The largest relative change from the exact fp32 product to the served dtype."""

    def __init__(self) -> None:
        self.max_rel = 0.0
        self.modules = 0

    def dequantize(
        self,
        prefix: str,
        weight: torch.Tensor,
        scale: torch.Tensor,
        block: tuple[int, int] | None,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        if weight.dtype not in FP8_DTYPES:
            raise ValueError(f"fp8 module {prefix}: weight is {weight.dtype}, not float8")
        exact = scaled(weight, scale, block)
        served = exact.to(dtype)
        if served.dtype != torch.float32:
            # |served - exact| / |exact| over the nonzero products, in place in `exact`.
            err = served.float().sub_(exact).abs_()
            rel = err.div_(exact.abs_()).nan_to_num_(nan=0.0).max().item()
            self.max_rel = max(self.max_rel, rel)
        self.modules += 1
        return served

    def note(self, dtype: torch.dtype) -> str:
        return (
            f"{self.modules} fp8 modules dequantized to {str(dtype).removeprefix('torch.')}, "
            f"largest relative rounding {self.max_rel:.2e} of the exact fp8 x scale product"
        )


class Fp8Config(QuantizationConfig):
    quant_method = "fp8"
    parts = frozenset({"weight", "weight_scale", "weight_scale_inv"})
    unused = ACTIVATION_SCALES

    def __init__(self, dtype: torch.dtype, block: tuple[int, int] | None) -> None:
        super().__init__(dtype)
        self.block = block
        self.rounding = Fp8Rounding()

    @classmethod
    def from_config(cls, q: dict[str, Any], dtype: torch.dtype) -> Fp8Config:
        fmt = str(q.get("fmt", "e4m3")).lower()
        if fmt not in ("e4m3", "e5m2"):
            raise option_error("fp8", "fmt", q.get("fmt"), "e4m3")
        scheme = str(q.get("activation_scheme", "dynamic")).lower()
        if scheme not in ("dynamic", "static"):
            raise option_error("fp8", "activation_scheme", scheme, "dynamic or static")
        block = q.get("weight_block_size")
        if block is not None:
            if not (isinstance(block, list) and len(block) == 2 and all(b > 0 for b in block)):
                raise option_error("fp8", "weight_block_size", block, "[rows, columns]")
            return cls(dtype, (int(block[0]), int(block[1])))
        return cls(dtype, None)

    def describe(self) -> str:
        return "fp8" + (f" ({self.block[0]}x{self.block[1]} blocks)" if self.block else "")

    def is_quantized_module(self, prefix: str, names: set[str]) -> bool:
        return f"{prefix}.weight" in names and (
            f"{prefix}.weight_scale" in names or f"{prefix}.weight_scale_inv" in names
        )

    def convert(
        self, prefix: str, tensors: dict[str, torch.Tensor]
    ) -> torch.Tensor | QuantizedRows:
        if "weight_scale_inv" in tensors:
            if self.block is None:
                raise ValueError(f"{prefix}.weight_scale_inv without weight_block_size")
            scale, block = tensors["weight_scale_inv"], self.block
        else:
            scale, block = tensors["weight_scale"], None
        self.served[str(self.dtype).removeprefix("torch.")] += 1
        return self.rounding.dequantize(prefix, tensors["weight"], scale, block, self.dtype)

    def notes(self) -> list[str]:
        return [self.rounding.note(self.dtype)] if self.rounding.modules else []
