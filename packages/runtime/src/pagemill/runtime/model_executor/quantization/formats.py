"""Quantized weight rows as they arrive from a checkpoint, and the packed form the CPU runs.

Two row formats travel from a reader (GGUF blocks) or a quantizer to a `Linear`:

- `Int4Groups`: w[n, k] = (q[n, k] - 8) * scales[n, k // g] + zeros[n, k // g], q in 0..15.
  This is exactly what PyTorch's int4 CPU kernel computes (`_weight_int4pack_mm_for_cpu`
  evaluates fma(q - 8, scale, zero) in fp32), so GGUF Q4_1 (d * q + m: scale d, zero
  m + 8d) and Q4_0 (d * (q - 8): scale d, zero 0) are repacked without rounding anything.
- `Int8Blocks`: w[n, k] = q[n, k] * scales[n, k // b] (+ zeros[n, k // b]), q an int8
  (GGUF Q8_0, b = 32; Q5_x, Q3_K/Q5_K, IQ4 values fit int8 too, some with a zero point).
  PyTorch's int8 CPU kernel has one scale per output row, which a per-32 scale does not
  fit; the block is split into two int4 planes instead (`int4_planes`): q = 16 * hi + lo
  with lo = q & 15 in 0..15 and hi = q >> 4 in -8..7, so
  w = (lo - 8) * d + 8d  +  ((hi + 8) - 8) * 16d + z,
  one int4 matmul over [x, x] against [N, 2K]: exact, and as many bytes as int8.

Scales are held in fp32 until packing; packing casts them to the compute dtype (the
kernels take scales in the activation dtype), which is exact in fp32 and rounds to 8
mantissa bits in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_GROUP_SIZES = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu accepts
INT4_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu needs out_features % 16 == 0
_INNER_K_TILES = 2  # ignored by the CPU packing (same layout for every value)


@dataclass
class Int4Groups:
    """Rows of 4-bit values with a scale and a zero point per group of `group_size`."""

    q: torch.Tensor  # uint8 [N, K], values 0..15
    scales: torch.Tensor  # float32 [N, K // group_size]
    zeros: torch.Tensor  # float32 [N, K // group_size]
    group_size: int
    source: str = "int4"  # what the rows came from, for logs ("Q4_1", "Q4_0", "int4")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1])

    def index_rows(self, index: torch.Tensor) -> Int4Groups:
        return Int4Groups(
            self.q.index_select(0, index),
            self.scales.index_select(0, index),
            self.zeros.index_select(0, index),
            self.group_size,
            self.source,
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as the int4 kernel sees it with scales in `dtype` (fp32: exact)."""
        return _int4_fp32(self.q, self.scales, self.zeros, self.group_size, dtype).to(dtype)


@dataclass
class Int8Blocks:
    """Rows of int8 values with one scale (and optionally a zero point) per block of
    `block_size` (GGUF Q8_0; Q5_0/Q5_1/Q5_K/Q3_K/IQ4_NL/IQ4_XS)."""

    q: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # float32 [N, K // block_size]
    block_size: int
    source: str = "Q8_0"
    zeros: torch.Tensor | None = None  # float32 [N, K // block_size]; None: all zero

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1])

    def index_rows(self, index: torch.Tensor) -> Int8Blocks:
        zeros = None if self.zeros is None else self.zeros.index_select(0, index)
        return Int8Blocks(
            self.q.index_select(0, index),
            self.scales.index_select(0, index),
            self.block_size,
            self.source,
            zeros,
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.q.shape
        s = _rounded(self.scales, dtype).unsqueeze(-1)
        w = self.q.view(n, k // self.block_size, self.block_size).float() * s
        if self.zeros is not None:
            w = w + _rounded(self.zeros, dtype).unsqueeze(-1)
        return w.reshape(n, k).to(dtype)


QuantizedRows = Int4Groups | Int8Blocks


def _int4_fp32(
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    scale_dtype: torch.dtype,
) -> torch.Tensor:
    """fma(q - 8, scale, zero) in fp32 with the scales as `scale_dtype` holds them.

    With scales of at most 16 significant bits (bf16, fp16) the product of a 4-bit
    integer and a scale is exact in fp32, so a multiply and then an add round once, as the
    fma does: in place, without the broadcast fma's temporaries (the dense copies of a
    model's packed layers are built with this at every load without a weight cache)."""
    n, k = q.shape
    s = _rounded(scales, scale_dtype).unsqueeze(-1)
    z = _rounded(zeros, scale_dtype).unsqueeze(-1)
    centered = q.view(n, k // group_size, group_size).float().sub_(8.0)
    if scale_dtype in (torch.bfloat16, torch.float16):
        return centered.mul_(s).add_(z).reshape(n, k)
    return torch.addcmul(z, centered, s).reshape(n, k)


def _rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 values as the kernel will read them: rounded to `dtype`, back in fp32."""
    return t.to(dtype).float() if dtype != torch.float32 else t.float()


def dequantize(value: torch.Tensor | QuantizedRows, dtype: torch.dtype) -> torch.Tensor:
    """The weight in `dtype` as a `dtype` kernel computes with it (scales in `dtype`): what
    an embedding holds, which a tied packed LM head then matches."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype)
    return value.dequantize(dtype)


# ---- quantizers (dense -> rows) -------------------------------------------------------------


def quantize_int8_per_channel(
    w: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per output row: (q int8 [N, K], scales [N] in `dtype`).

    The scale is rounded to `dtype` first and q computed against the rounded scale, so the
    kernel's q * scale is the nearest point of the grid it actually uses.
    """
    w32 = w.float()
    scales = (w32.abs().amax(dim=1) / 127.0).to(dtype)
    s32 = scales.float()
    safe = torch.where(s32 > 0, s32, torch.ones_like(s32))
    q = torch.round(w32 / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4_groups(w: torch.Tensor, group_size: int, dtype: torch.dtype) -> Int4Groups:
    """Asymmetric (min/max) int4 per group with a zero point; scales rounded to `dtype` first."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the int4 group size {group_size}")
    w32 = w.float().reshape(n, k // group_size, group_size)
    lo, hi = w32.amin(dim=-1), w32.amax(dim=-1)
    scales = _rounded((hi - lo) / 15.0, dtype)
    zeros = _rounded(lo + 8.0 * scales, dtype)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round((w32 - zeros[..., None]) / safe[..., None]) + 8.0
    q = torch.where(scales[..., None] > 0, q, torch.full_like(q, 8.0))
    q = q.clamp_(0, 15).to(torch.uint8).reshape(n, k)
    return Int4Groups(q, scales, zeros, group_size)


# ---- packing (rows -> what the kernels take) ------------------------------------------------


def int4_planes(
    pieces: list[QuantizedRows],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """Stack row pieces (in row order) into int4 planes: (q [N, P*K] uint8, scales, zeros
    [N, P*K/g] fp32, group size, P). P = 1 when every piece is `Int4Groups`, 2 when any is
    `Int8Blocks` (a 4-bit piece then gets an all-zero second plane: q 8, scale 0, zero 0).
    """
    sizes = {p.group_size if isinstance(p, Int4Groups) else p.block_size for p in pieces}
    if len(sizes) != 1:
        raise ValueError(f"cannot fuse rows with different group sizes {sorted(sizes)}")
    (g,) = sizes
    planes = 2 if any(isinstance(p, Int8Blocks) for p in pieces) else 1
    only = pieces[0]
    if len(pieces) == 1 and isinstance(only, Int4Groups):  # as they are: no copy
        return only.q, only.scales, only.zeros, g, planes
    qs, ss, zs = [], [], []
    for p in pieces:
        if isinstance(p, Int4Groups):
            q, s, z = p.q, p.scales, p.zeros
            if planes == 2:
                q = torch.cat([q, torch.full_like(q, 8)], dim=1)
                s = torch.cat([s, torch.zeros_like(s)], dim=1)
                z = torch.cat([z, torch.zeros_like(z)], dim=1)
        else:
            q16 = p.q.to(torch.int16)
            lo = (q16 & 15).to(torch.uint8)
            hi = ((q16 >> 4) + 8).to(torch.uint8)
            d = p.scales
            q = torch.cat([lo, hi], dim=1)
            s = torch.cat([d, 16.0 * d], dim=1)
            # The zero point rides on the second plane: 8d then rounds to bf16 exactly as
            # 8 * bf16(d) does and cancels the first plane's -8d exactly.
            z = torch.cat([8.0 * d, torch.zeros_like(d) if p.zeros is None else p.zeros], dim=1)
        qs.append(q)
        ss.append(s)
        zs.append(z)
    return torch.cat(qs), torch.cat(ss), torch.cat(zs), g, planes


def pack_int4(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weight for _weight_int4pack_mm_for_cpu, scales_and_zeros [K/g, N, 2] in dtype)."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        q.to(torch.int32).contiguous(), _INNER_K_TILES
    )
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(dtype)
    return packed, scales_and_zeros


def unpack_int4_dense(
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    planes: int,
    dtype: torch.dtype,
    scale_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The dense [N, K] weight of int4 planes in `dtype`, as the kernel computes it with
    `scale_dtype` scales (default: `dtype`)."""
    w = _int4_fp32(q, scales, zeros, group_size, scale_dtype or dtype)
    if planes > 1:
        w = w.reshape(w.shape[0], planes, -1).sum(dim=1)
    return w.to(dtype)
