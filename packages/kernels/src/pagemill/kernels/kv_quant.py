"""An 8-bit KV cache: what "quantize on write, dequantize on read" means, in one place.

vLLM's ``--kv-cache-dtype fp8`` semantics: each layer has one K scale and one V scale
(fp32, per tensor); the write stores ``saturate(x / scale)`` in float8 and every read
computes ``float(x_fp8) * scale``. Saturating (clamping to the format's largest finite
value) rather than overflowing to NaN/inf is what a cast to ``float8_e4m3fn`` would not
do on its own (it has no inf), so an outlier costs precision, never a poisoned row.

``--kv-cache-dtype int8`` is the same contract with symmetric int8 codes: the write stores
``clamp(round(x / scale), -127, 127)`` (round half to even, as ``torch.round``), the read
``float(x_int8) * scale``. -128 is never written, so the range is symmetric and a negated
input gives the negated code. Every int8 value is exact in bf16/fp16, so the torch paths
widen the codes exactly and fold the scales in, as they do for fp8.

Scales are fp32 tensors, read by the kernels on every call, so a compiled graph or CUDA
graph reads the current value rather than a baked constant: 0-dim (one per layer, the
default) or ``[num_kv_heads]`` (one per KV head: llm-compressor's ``strategy: "attn_head"``,
or ``kv_scales_per_head``), which divides and multiplies each head's rows by its own scale.
A few heads with outlier K/V then no longer spend every other head's resolution.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Every dtype a quantized KV cache is stored in (one byte per element, with scales).
KV_QUANT_DTYPES = (*FP8_DTYPES, torch.int8)

# The largest int8 code written (symmetric: -INT8_MAX .. INT8_MAX).
INT8_MAX = 127


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def is_quantized_kv(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` holds scaled 8-bit codes (fp8 or int8)."""
    return dtype in KV_QUANT_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def quant_max(dtype: torch.dtype) -> float:
    """The largest magnitude a quantized cache of ``dtype`` stores (its saturation point)."""
    return float(INT8_MAX) if dtype == torch.int8 else fp8_max(dtype)


def quantize(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` saturated to ``dtype``'s range and cast (round to nearest, ties even)."""
    if scale is None:
        y = x.to(torch.float32, copy=True)  # clamp_ below must not touch an fp32 caller's x
    else:
        y = x.float() / _broadcastable(scale, x)
    limit = quant_max(dtype)
    y = y.clamp_(-limit, limit)
    if dtype == torch.int8:
        # A float -> int cast truncates: round first (NaN cannot reach here from a finite
        # activation; clamp keeps +-inf in range).
        y = y.round_()
    return y.to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """8-bit ``x`` back to ``dtype`` as ``float32(x) * scale``."""
    y = x.float()
    if scale is not None:
        y = y * _broadcastable(scale, x)
    return y.to(dtype)


def _broadcastable(scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A per-head scale [H] against ``x [..., H, D]``: one value per row of each head."""
    return scale[:, None] if scale.dim() == 1 else scale


def is_per_head(scale: torch.Tensor | None) -> bool:
    """Whether ``scale`` holds one value per KV head (else one per layer, or none)."""
    return scale is not None and scale.dim() == 1


def check_scale(name: str, scale: torch.Tensor | None, num_kv_heads: int | None = None) -> None:
    """A scale is fp32, 0-dim (per layer) or ``[num_kv_heads]`` contiguous (per KV head);
    anything else would be read as something it is not, so it is refused here."""
    if scale is None:
        return
    if not isinstance(scale, torch.Tensor):
        raise ValueError(f"{name} must be an fp32 tensor, got {scale!r}")
    if scale.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {scale.dtype}")
    if scale.dim() == 0:
        return
    if scale.dim() != 1 or (num_kv_heads is not None and scale.shape[0] != num_kv_heads):
        want = "[]" if num_kv_heads is None else f"[] or [num_kv_heads={num_kv_heads}]"
        raise ValueError(
            f"{name} must be one scale per layer or per KV head ({want}), "
            f"got shape {tuple(scale.shape)}"
        )
    if not scale.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


_LUTS: dict[torch.dtype, torch.Tensor] = {}


def decode_table(dtype: torch.dtype) -> torch.Tensor:
    """The 256 float32 values of an 8-bit format indexed by its bit pattern (for the native
    CPU kernel, which reads the cache as bytes): fp8's values, or int8's two's-complement
    integers (the kernel multiplies by the scale after the lookup, whatever the format)."""
    lut = _LUTS.get(dtype)
    if lut is None:
        if not is_quantized_kv(dtype):
            raise ValueError(f"no byte decode table for a {dtype} KV cache")
        lut = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
        # fp8 NaN patterns never occur in a saturated cache; they stay NaN in the table.
        _LUTS[dtype] = lut = lut.contiguous()
    return lut
