"""Integer weights with a scale and a zero point per group — what AWQ, GPTQ and
compressed-tensors all store once unpacked — as the row formats a `Linear` packs.

Every one of them computes w[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)] with q and z
unsigned integers of `bits` bits and g(k) = k // group_size (or `g_idx[k]` with GPTQ's
act-order). In `Int4Groups`' terms, (q - z) * s = (q - 8) * s + (8 - z) * s: the zero is
(8 - z) * s, a small integer times an fp16/bf16 scale, exact in fp32. An 8-bit weight with
z = 128 everywhere (symmetric) is `Int8Blocks` with q - 128. Groups larger than the int4
kernel takes (per-channel: one group of K) are split into equal groups with the same
scale, which changes nothing. What fits neither (act-order groups that are not contiguous,
asymmetric 8-bit) is dequantized — exactly in fp32, then rounded once to the model dtype.
"""

from __future__ import annotations

import sys

import torch

from pagemill.runtime.model_executor.quantization.formats import (
    INT4_GROUP_SIZES,
    Int4Groups,
    Int8Blocks,
    QuantizedRows,
)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Values packed little-end first (value i of a word at bits [i*bits, (i+1)*bits)) along
    `dim` of an int32 tensor, unpacked along that dim as uint8."""
    if dim == 0:
        return unpack_int32(packed.T, bits, 1).T
    p = packed.to(torch.int32).contiguous()
    if sys.byteorder == "little" and bits in (4, 8):
        # A word's bytes in memory are its values in order: no shifts over int32 needed.
        b = p.view(torch.uint8)
        if bits == 8:
            return b
        return torch.stack((b & 15, b >> 4), dim=-1).reshape(p.shape[0], -1)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    v = (p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return v.reshape(p.shape[0], -1).to(torch.uint8)


def _split_groups(g: int, k: int) -> int:
    """The largest group size the int4 kernel takes that divides `g` (`g` if none does)."""
    if g in INT4_GROUP_SIZES:
        return g
    for size in sorted(INT4_GROUP_SIZES, reverse=True):
        if g % size == 0 and k % size == 0:
            return size
    return g


def int_rows(
    q: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    g_idx: torch.Tensor | None,
    dtype: torch.dtype,
    source: str,
) -> tuple[torch.Tensor | QuantizedRows, str]:
    """(rows, what they are served as) for q [N, K], zeros and scales [N, G] (zeros as
    unsigned integers), `g_idx` [K] or None for contiguous groups of K / G."""
    k = q.shape[1]
    groups = scales.shape[1]
    dense = str(dtype).removeprefix("torch.")
    s = scales.float()
    z = zeros.to(torch.int32)
    trivial = torch.arange(k) // (k // groups) if k % groups == 0 else None
    if g_idx is not None and (trivial is None or not torch.equal(g_idx.long(), trivial)):
        # Act-order: column k belongs to group g_idx[k]; groups are not contiguous.
        idx = g_idx.long()
        w = (q.to(torch.int32) - z[:, idx]).float() * s[:, idx]
        return w.to(dtype), f"{dense} (act-order groups)"
    if k % groups:
        raise ValueError(f"{source}: {k} input columns do not split into {groups} groups")
    g = k // groups
    size = _split_groups(g, k)
    if size != g:
        s = s.repeat_interleave(g // size, dim=1)
        z = z.repeat_interleave(g // size, dim=1)
    if bits == 4:
        zero = (8 - z).float() * s
        return Int4Groups(q.to(torch.uint8), s, zero, size, source), f"int4 groups of {size}"
    if bits == 8 and bool((z == 128).all()):
        q8 = (q.to(torch.int32) - 128).to(torch.int8)
        return Int8Blocks(q8, s, size, source), f"int8 blocks of {size}"
    w = (q.to(torch.int32) - z.repeat_interleave(size, dim=1)).float() * s.repeat_interleave(
        size, dim=1
    )
    return w.to(dtype), f"{dense} ({bits}-bit with zero points)"
