"""Rotary position embedding in the Llama/NeoX rotate-half layout, with the long-context
scalings of Hugging Face configs: linear, llama3, yarn, longrope and dynamic (NTK).

The table holds ``cos`` in its first ``D/2`` columns and ``sin`` in the last ``D/2`` for
every position, computed once in fp32 exactly as transformers computes its per-step
values (same inverse frequencies, same fp32 products, cos/sin multiplied by the same
attention factor), so a lookup by position gives the reference's numbers without
recomputing trigonometry every step. Every scaling is a different table; the kernels that
apply it (torch, Triton) never know which.

Two scalings depend, in transformers, on the length of the sequence being run; a paged
engine batches requests of every length and shares KV blocks between them, so each table
row must depend on its position alone:

* ``longrope`` (Phi-3 128k, Phi-3.5, Phi-4-mini): transformers rotates with the short
  factors while the sequence fits ``original_max_position_embeddings`` and with the long
  ones past it. Here, as in vLLM, the engine's maximum length decides once: a table longer
  than the original context uses the long factors at every position (so every key and
  query of a long sequence is rotated alike, as transformers rotates a long prompt), a
  shorter one the short factors.
* ``dynamic`` (NTK): transformers rescales the base to the current sequence length once
  it exceeds ``max_position_embeddings``. Here row ``p`` is rotated with the base
  transformers uses for a sequence of ``p + 1`` tokens — what its ``generate`` applies to
  the token at ``p`` whenever the prompt fits ``max_position_embeddings``. (vLLM's table
  is fixed too, but its base formula reduces to the unscaled one: plain RoPE at every
  position, equal to transformers only within ``max_position_embeddings``.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from pagemill.kernels._dispatch import check_triton_device, lazy_kernels, next_pow2, use_triton

_kernels = lazy_kernels("rotary")

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


def _need(rope_scaling: Mapping[str, Any], rope_type: str, *keys: str) -> list[Any]:
    missing = [k for k in keys if rope_scaling.get(k) is None]
    if missing:
        raise ValueError(
            f"{rope_type} rope_scaling needs key {missing[0]!r}; got {dict(rope_scaling)}"
        )
    return [rope_scaling[k] for k in keys]


def _exponents(head_dim: int, device: torch.device | str | None) -> torch.Tensor:
    """2i / D for each rotated pair, in fp32 as transformers computes it."""
    return torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim


def _llama3(inv_freq: torch.Tensor, rope_scaling: Mapping[str, Any]) -> torch.Tensor:
    factor, low, high, old_len = (
        float(v)
        for v in _need(
            rope_scaling,
            "llama3",
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        )
    )
    # Wavelengths shorter than old_len/high keep their frequency, longer than old_len/low
    # are slowed by `factor`, and the band between is blended linearly in 1/wavelength.
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, blended, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(
    head_dim: int,
    theta: float,
    rope_scaling: Mapping[str, Any],
    device: torch.device | str | None,
) -> tuple[torch.Tensor, float]:
    """YaRN: high frequencies kept, low ones interpolated by ``factor``, a linear ramp
    between the dimensions that turn ``beta_fast`` and ``beta_slow`` times over the
    original context; cos/sin scaled by the attention factor (DeepSeek's ``mscale`` /
    ``mscale_all_dim`` ratio when the config gives both)."""
    factor, old_len = (
        float(v) for v in _need(rope_scaling, "yarn", "factor", "original_max_position_embeddings")
    )
    attention_factor = rope_scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = rope_scaling.get("beta_fast") or 32
    beta_slow = rope_scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope_scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = torch.clamp(
        (torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1
    ).to(device)
    pos_freqs = theta ** _exponents(head_dim, device)
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attention_factor)


def _longrope(
    head_dim: int,
    max_position: int,
    theta: float,
    rope_scaling: Mapping[str, Any],
    device: torch.device | str | None,
) -> tuple[torch.Tensor, float]:
    """Per-dimension rescale factors: the long set when the table reaches past the original
    context (see the module docstring), else the short set; cos/sin scaled by
    ``sqrt(1 + ln(factor) / ln(original))`` unless the config gives ``attention_factor``."""
    short, long, old_len, factor = _need(
        rope_scaling,
        "longrope",
        "short_factor",
        "long_factor",
        "original_max_position_embeddings",
        "factor",
    )
    old_len, factor = int(old_len), float(factor)
    for name, factors in (("short_factor", short), ("long_factor", long)):
        if len(factors) != head_dim // 2:
            raise ValueError(
                f"longrope {name} has {len(factors)} values; the rotary dimension "
                f"{head_dim} needs {head_dim // 2}"
            )
    attention_factor = rope_scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
        )
    chosen = long if max_position > old_len else short
    ext = torch.tensor(chosen, dtype=torch.float32, device=device)
    return 1.0 / (ext * theta ** _exponents(head_dim, device)), float(attention_factor)


def _dynamic_inv_freq(
    head_dim: int,
    max_position: int,
    theta: float,
    rope_scaling: Mapping[str, Any],
    device: torch.device | str | None,
) -> torch.Tensor:
    """[max_position, D/2]: row p holds transformers' dynamic-NTK frequencies for a
    sequence of ``max(p + 1, max_position_embeddings)`` tokens."""
    factor, old_len = _need(rope_scaling, "dynamic", "factor", "max_position_embeddings")
    factor, old_len = float(factor), int(old_len)
    if head_dim <= 2:
        raise ValueError(f"dynamic rope needs a rotary dimension above 2, got {head_dim}")
    expo = _exponents(head_dim, device)
    # Up to the original length transformers keeps the frequencies it built at start-up,
    # in float64 arithmetic on Python numbers.
    base = theta * ((factor * old_len / old_len) - (factor - 1)) ** (head_dim / (head_dim - 2))
    first = min(max_position, old_len)
    inv = (1.0 / (base**expo)).expand(first, -1)
    if max_position <= old_len:
        return inv
    # Past it, each step's length arrives as a 0-d tensor: fp32 arithmetic, except that
    # torch raises a 0-d fp32 tensor to a power in float64 and rounds (a vector's fp32 pow
    # differs in the last bit), which the float64 detour reproduces.
    seq = torch.arange(old_len + 1, max_position + 1, dtype=torch.int64, device=device)
    ratio = (factor * seq / old_len) - (factor - 1)
    bases = theta * (ratio.double() ** (head_dim / (head_dim - 2))).float()
    return torch.cat((inv, 1.0 / (bases[:, None] ** expo[None, :])))


def rope_type_of(rope_scaling: Mapping[str, Any] | None) -> str:
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")) or "default")


def rope_cos_sin(
    head_dim: int,
    max_position: int,
    theta: float,
    rope_scaling: Mapping[str, Any] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The [max_position, head_dim] cos|sin table of a (possibly scaled) RoPE.

    ``rope_scaling`` is a Hugging Face ``rope_parameters`` dict (``rope_type`` and its
    keys); ``factor`` must be filled in where the config leaves it to transformers
    (yarn/longrope: ``max_position_embeddings / original_max_position_embeddings``) and
    ``dynamic`` needs the model's ``max_position_embeddings`` — `ModelConfig` does both.
    ``max_position`` is the longest context served; it picks longrope's factor set.
    """
    if head_dim <= 0 or head_dim % 2 != 0:
        raise ValueError(f"head_dim must be a positive even number, got {head_dim}")
    if max_position <= 0:
        raise ValueError(f"max_position must be positive, got {max_position}")
    rope_type = rope_type_of(rope_scaling)
    theta = float(theta)
    attention_factor = 1.0
    inv_freq = 1.0 / (theta ** _exponents(head_dim, device))
    if rope_type == "default":
        pass
    elif rope_type not in ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}: pagemill supports {', '.join(ROPE_TYPES)}"
        )
    else:
        assert rope_scaling is not None  # a non-default rope_type came from it
        if rope_type == "linear":
            inv_freq = inv_freq / float(_need(rope_scaling, "linear", "factor")[0])
        elif rope_type == "llama3":
            inv_freq = _llama3(inv_freq, rope_scaling)
        elif rope_type == "yarn":
            inv_freq, attention_factor = _yarn(head_dim, theta, rope_scaling, device)
        elif rope_type == "longrope":
            inv_freq, attention_factor = _longrope(
                head_dim, max_position, theta, rope_scaling, device
            )
        else:
            inv_freq = _dynamic_inv_freq(head_dim, max_position, theta, rope_scaling, device)
    pos = torch.arange(max_position, dtype=torch.int64, device=device).float()
    freqs = pos[:, None] * (inv_freq if inv_freq.dim() == 2 else inv_freq[None, :])
    cos, sin = freqs.cos(), freqs.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return torch.cat((cos, sin), dim=-1)


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


def apply_rotary_qk(
    positions: torch.Tensor, qk: torch.Tensor, num_heads: int, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k given as one tensor of heads ``[T, H + KVH, D]`` (q's heads first, as
    a fused QKV projection lays them out); returns q ``[T, H, D]`` and k ``[T, KVH, D]``.

    On CPU both rotate in one pass and come back as views of one buffer: compiled, that is
    one generated loop per layer instead of one for q and one for k (each loop pays its
    own call and OpenMP region, which at decode sizes cost more than the arithmetic).
    The values are `apply_rotary`'s, element for element.
    """
    if qk.dim() != 3 or not 0 < num_heads < qk.shape[1]:
        raise ValueError(
            f"qk must be [T, H + KVH, D] with 0 < H={num_heads} < H + KVH, got {tuple(qk.shape)}"
        )
    q, k = qk[:, :num_heads], qk[:, num_heads:]
    if use_triton(qk):
        return apply_rotary_triton(positions, q, k, cos_sin)
    _check_args(positions, q, k, cos_sin)
    half = qk.shape[2] // 2
    cs = cos_sin.index_select(0, positions.to(device=cos_sin.device, dtype=torch.int64))
    cos = cs[:, None, :half].to(qk.dtype)
    sin = cs[:, None, half:].to(qk.dtype)
    x1, x2 = qk[..., :half], qk[..., half:]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out[:, :num_heads], out[:, num_heads:]
