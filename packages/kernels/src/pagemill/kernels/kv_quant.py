"""An fp8 KV cache: what "quantize on write, dequantize on read" means, in one place.

vLLM's ``--kv-cache-dtype fp8`` semantics: each layer has one K scale and one V scale
(fp32, per tensor); the write stores ``saturate(x / scale)`` in float8 and every read
computes ``float(x_fp8) * scale``. Saturating (clamping to the format's largest finite
value) rather than overflowing to NaN/inf is what a cast to ``float8_e4m3fn`` would not
do on its own (it has no inf), so an outlier costs precision, never a poisoned row.

Scales are 0-dim fp32 tensors so a product with a bf16/fp16 tensor keeps that dtype and
a compiled graph or CUDA graph reads the current value rather than a baked constant.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def quantize(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` saturated to ``dtype``'s range and cast (round to nearest)."""
    y = x.float()
    if scale is not None:
        y = y / scale
    limit = fp8_max(dtype)
    return y.clamp_(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """fp8 ``x`` back to ``dtype`` as ``float32(x) * scale``."""
    y = x.float()
    if scale is not None:
        y = y * scale
    return y.to(dtype)


def check_scale(name: str, scale: torch.Tensor | None) -> None:
    if scale is None:
        return
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
        raise ValueError(f"{name} must be a one-element fp32 tensor, got {scale!r}")
    if scale.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {scale.dtype}")


_LUTS: dict[torch.dtype, torch.Tensor] = {}


def decode_table(dtype: torch.dtype) -> torch.Tensor:
    """The 256 float32 values of an fp8 format indexed by its bit pattern (for the native
    CPU kernel, which reads the cache as bytes)."""
    lut = _LUTS.get(dtype)
    if lut is None:
        lut = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
        # NaN patterns never occur in a saturated cache; keep them finite-agnostic as NaN.
        _LUTS[dtype] = lut = lut.contiguous()
    return lut
