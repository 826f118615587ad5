"""Rotary position embedding in the Llama/NeoX rotate-half layout, with Llama-3 scaling.

The table holds ``cos`` in its first ``D/2`` columns and ``sin`` in the last ``D/2`` for
every position, computed once in fp32 exactly as transformers computes its per-step
values (same inverse frequencies, same fp32 products), so a lookup by position gives the
reference's numbers without recomputing trigonometry every step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from pagemill.kernels._dispatch import check_triton_device, lazy_kernels, next_pow2, use_triton

_kernels = lazy_kernels("rotary")


def _inv_freq(
    head_dim: int,
    theta: float,
    rope_scaling: Mapping[str, Any] | None,
    device: torch.device | str | None,
) -> torch.Tensor:
    inv_freq = 1.0 / (
        float(theta)
        ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
    )
    rope_type = "default"
    if rope_scaling:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default")) or "default"
    if rope_type == "default":
        return inv_freq
    assert rope_scaling is not None  # a non-default rope_type came from it
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        try:
            factor = float(rope_scaling["factor"])
            low = float(rope_scaling["low_freq_factor"])
            high = float(rope_scaling["high_freq_factor"])
            old_len = float(rope_scaling["original_max_position_embeddings"])
        except KeyError as e:
            raise ValueError(
                f"llama3 rope_scaling needs key {e.args[0]!r}; got {dict(rope_scaling)}"
            ) from e
        # Wavelengths shorter than old_len/high keep their frequency, longer than old_len/low
        # are slowed by `factor`, and the band between is blended linearly in 1/wavelength.
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, blended, scaled)
    raise ValueError(
        f"unsupported rope_type {rope_type!r}: pagemill supports 'default', 'linear' and 'llama3'"
    )


def rope_cos_sin(
    head_dim: int,
    max_position: int,
    theta: float,
    rope_scaling: Mapping[str, Any] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    if head_dim <= 0 or head_dim % 2 != 0:
        raise ValueError(f"head_dim must be a positive even number, got {head_dim}")
    if max_position <= 0:
        raise ValueError(f"max_position must be positive, got {max_position}")
    inv_freq = _inv_freq(head_dim, theta, rope_scaling, device)
    pos = torch.arange(max_position, dtype=torch.int64, device=device).float()
    freqs = pos[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _check_args(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor
) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            "q must be [T, H, D] and k [T, KVH, D] with the same T and D; "
            f"got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    if positions.dim() != 1 or positions.shape[0] != q.shape[0]:
        raise ValueError(f"positions must be [T={q.shape[0]}], got {tuple(positions.shape)}")
    if cos_sin.dim() != 2 or cos_sin.shape[1] != q.shape[2]:
        raise ValueError(
            f"cos_sin must be [max_position, head_dim={q.shape[2]}], got {tuple(cos_sin.shape)}"
        )
    if k.dtype != q.dtype:
        raise ValueError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")


def apply_rotary_torch(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_args(positions, q, k, cos_sin)
    half = q.shape[2] // 2
    cs = cos_sin.index_select(0, positions.to(device=cos_sin.device, dtype=torch.int64))
    cos = cs[:, None, :half].to(q.dtype)
    sin = cs[:, None, half:].to(q.dtype)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rotate(q), rotate(k)


def apply_rotary_triton(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_args(positions, q, k, cos_sin)
    check_triton_device(positions, q, k, cos_sin)
    if q.stride(2) != 1 or k.stride(2) != 1:
        q, k = q.contiguous(), k.contiguous()
    cs = cos_sin.contiguous()
    qo, ko = (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
    )
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens > 0:
        half = head_dim // 2
        _kernels.rotary_kernel[(num_tokens,)](
            positions.contiguous(),
            q,
            k,
            qo,
            ko,
            cs,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            qo.stride(0),
            qo.stride(1),
            ko.stride(0),
            ko.stride(1),
            cs.stride(0),
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=k.shape[1],
            H_PAD=next_pow2(num_heads),
            KVH_PAD=next_pow2(k.shape[1]),
            HALF=half,
            HALF_PAD=next_pow2(half),
        )
    return qo, ko


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    impl = apply_rotary_triton if use_triton(q) else apply_rotary_torch
    return impl(positions, q, k, cos_sin)
