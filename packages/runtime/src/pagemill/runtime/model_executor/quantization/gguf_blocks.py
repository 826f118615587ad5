"""GGML quantized blocks as the packed rows the CPU kernels take, read with numpy.

Every decoder takes a tensor's raw bytes ([rows, bytes per row], usually a view of the
memory-mapped file) and unpacks whole tensors at once with numpy's vectorised bit
operations (the block layouts are llama.cpp's `ggml-quants.c`, which the `gguf` package's
own dequantizers spell out). What each type becomes — exact unless said:

- Q4_0, Q4_1, Q4_K → `Int4Groups` of 32 (Q4_K's sub-block scale d*sc and min dmin*m
  become a scale and a zero point per group of 32);
- Q8_0, Q5_0, Q5_1, Q5_K, Q3_K, IQ4_NL, IQ4_XS → `Int8Blocks` of 32, with zero points for
  Q5_1/Q5_K/Q3_K: their values are small integers times a per-32 scale (Q3_K's two
  sub-blocks of 16 share the super-block scale d, so (sc - 32) * q is the integer; IQ4's
  non-linear levels are int8 values of a fixed table);
- Q6_K: its 16-value sub-blocks each have their own scale, which a group of 32 cannot
  hold exactly (the integer sc * q needs 13 bits): requantized to int8 per 32, an error of
  at most 1/254 of each group's largest magnitude (about 1/8 of a Q6_K step);
- Q2_K: likewise per 16 with a min each; requantized to int8 per 32 with a zero point
  (min/max): an error of at most 1/510 of each group's range (an int4 group cannot hold
  two sub-blocks' grids, and its error on top of a 2.6-bit file moved logits visibly);
- any other type the `gguf` package can dequantize (IQ1/IQ2/IQ3, TQ, MXFP4, ...) → a dense
  tensor in the compute dtype.

Requantized types carry their error against `gguf.quants.dequantize` (`RequantError`), so
the loader can log it and the weight report can state it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagemill.runtime.model_executor.quantization.formats import (
    Int4Groups,
    Int8Blocks,
    QuantizedRows,
)

_QK = 32  # the group every packed format here uses
_QK_K = 256  # K-quant super-blocks
_IQ4_LEVELS = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8
)


@dataclass
class RequantError:
    """Absolute error of requantized weights against the `gguf` package's dequantization."""

    max_abs: float = 0.0
    sum_abs: float = 0.0
    count: int = 0
    served_as: str = ""

    @property
    def mean_abs(self) -> float:
        return self.sum_abs / self.count if self.count else 0.0

    def add(self, served: torch.Tensor, exact: torch.Tensor, served_as: str) -> None:
        err = (served.float() - exact.float()).abs()
        self.max_abs = max(self.max_abs, float(err.max())) if err.numel() else self.max_abs
        self.sum_abs += float(err.double().sum())
        self.count += err.numel()
        self.served_as = served_as


# ---- byte helpers ---------------------------------------------------------------------------


def _blocks(raw: np.ndarray, rows: int, k: int, block: int, type_size: int) -> np.ndarray:
    return np.asarray(raw, dtype=np.uint8).reshape(rows, k // block, type_size)


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of every block, as float32 [rows, blocks]."""
    return np.ascontiguousarray(b[..., at : at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., n] bytes -> [..., 2n]: the n low nibbles, then the n high ones (ggml's order)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _bits(b: np.ndarray, count: int) -> np.ndarray:
    """[..., count / 8] bytes -> [..., count] bits, least significant first."""
    return np.unpackbits(np.ascontiguousarray(b), axis=-1, count=count, bitorder="little")


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and eight 6-bit mins."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=-1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _t(a: np.ndarray, rows: int, k: int | None = None) -> torch.Tensor:
    a = np.ascontiguousarray(a)
    return torch.from_numpy(a.reshape(rows, -1 if k is None else k))


def _int8_blocks(
    q: np.ndarray,
    scales: np.ndarray,
    zeros: np.ndarray | None,
    rows: int,
    k: int,
    source: str,
) -> Int8Blocks:
    return Int8Blocks(
        _t(q.astype(np.int8), rows, k),
        _t(scales.astype(np.float32), rows),
        _QK,
        source,
        None if zeros is None else _t(zeros.astype(np.float32), rows),
    )


# ---- 32-value blocks ------------------------------------------------------------------------


def decode_q4_0(raw: np.ndarray, rows: int, k: int) -> Int4Groups:
    b = _blocks(raw, rows, k, _QK, 18)
    d = _t(_f16(b, 0), rows)
    return Int4Groups(_t(_nibbles(b[..., 2:]), rows, k), d, torch.zeros_like(d), _QK, "Q4_0")


def decode_q4_1(raw: np.ndarray, rows: int, k: int) -> Int4Groups:
    b = _blocks(raw, rows, k, _QK, 20)
    d, m = _f16(b, 0), _f16(b, 2)
    # d * q + m = (q - 8) * d + (m + 8d)
    zeros = _t(m + np.float32(8.0) * d, rows)
    return Int4Groups(_t(_nibbles(b[..., 4:]), rows, k), _t(d, rows), zeros, _QK, "Q4_1")


def decode_q8_0(raw: np.ndarray, rows: int, k: int) -> Int8Blocks:
    b = _blocks(raw, rows, k, _QK, 34)
    return _int8_blocks(b[..., 2:].view(np.int8), _f16(b, 0), None, rows, k, "Q8_0")


def _q5_values(b: np.ndarray, qh_at: int) -> np.ndarray:
    """Q5_0/Q5_1's 5-bit values 0..31 of every block: 4 bits in qs, the fifth in qh."""
    high = _bits(b[..., qh_at : qh_at + 4], 32)
    return _nibbles(b[..., qh_at + 4 :]) | (high << 4)


def decode_q5_0(raw: np.ndarray, rows: int, k: int) -> Int8Blocks:
    b = _blocks(raw, rows, k, _QK, 22)
    q = _q5_values(b, 2).astype(np.int8) - np.int8(16)  # d * (q - 16)
    return _int8_blocks(q, _f16(b, 0), None, rows, k, "Q5_0")


def decode_q5_1(raw: np.ndarray, rows: int, k: int) -> Int8Blocks:
    b = _blocks(raw, rows, k, _QK, 24)
    return _int8_blocks(_q5_values(b, 4), _f16(b, 0), _f16(b, 2), rows, k, "Q5_1")  # d*q + m


def decode_iq4_nl(raw: np.ndarray, rows: int, k: int) -> Int8Blocks:
    b = _blocks(raw, rows, k, _QK, 18)
    q = _IQ4_LEVELS[_nibbles(b[..., 2:])]
    return _int8_blocks(q, _f16(b, 0), None, rows, k, "IQ4_NL")


# ---- K-quant super-blocks of 256 ------------------------------------------------------------


def decode_q4_k(raw: np.ndarray, rows: int, k: int) -> Int4Groups:
    b = _blocks(raw, rows, k, _QK_K, 144)
    d, dmin = _f16(b, 0)[..., None], _f16(b, 2)[..., None]
    sc, mn = _k_scale_min(b[..., 4:16])
    scale = d * sc  # [rows, blocks, 8]: exact in fp32 (11-bit mantissa times a 6-bit integer)
    # d*sc*q - dmin*m = (q - 8) * (d*sc) + (8*d*sc - dmin*m)
    zeros = np.float32(8.0) * scale - dmin * mn
    q = _nibbles(b[..., 16:].reshape(rows, -1, 4, 32))  # 32 bytes: sub-blocks 2i, 2i + 1
    return Int4Groups(_t(q, rows, k), _t(scale, rows), _t(zeros, rows), _QK, "Q4_K")


def decode_q5_k(raw: np.ndarray, rows: int, k: int) -> Int8Blocks:
    b = _blocks(raw, rows, k, _QK_K, 176)
    d, dmin = _f16(b, 0)[..., None], _f16(b, 2)[..., None]
    sc, mn = _k_scale_min(b[..., 4:16])
    low = _nibbles(b[..., 48:].reshape(rows, -1, 4, 32)).reshape(rows, -1, 8, 32)
    # Bit j of qh byte i is the fifth bit of value i of sub-block j.
    high = _bits(b[..., 16:48, None], 8).swapaxes(-1, -2)  # [rows, blocks, 8, 32]
    q = low | (high << 4)
    return _int8_blocks(q, d * sc, -dmin * mn, rows, k, "Q5_K")


def decode_q3_k(raw: np.ndarray, rows: int, k: int) -> Int8Blocks:
    b = _blocks(raw, rows, k, _QK_K, 110)
    hmask, qs, s = b[..., 0:32], b[..., 32:96], b[..., 96:108]
    d = _f16(b, 108)
    low_s = _nibbles(s[..., 0:8])  # scales 0..15, low 4 bits
    high_s = np.stack([(s[..., 8:12] >> shift) & 3 for shift in (0, 2, 4, 6)], axis=-2)
    sc = (low_s | (high_s.reshape(*s.shape[:-1], 16) << 4)).astype(np.int16) - 32  # [., 16]
    # 2-bit values: byte i of each 32-byte half holds values i of four sub-blocks.
    low = np.stack([(qs.reshape(rows, -1, 2, 32) >> shift) & 3 for shift in (0, 2, 4, 6)], -2)
    high = _bits(hmask[..., None], 8).swapaxes(-1, -2)  # [rows, blocks, 8, 32]
    q = low.reshape(rows, -1, 8, 32).astype(np.int16) - 4 * (1 - high.astype(np.int16))
    # d * sc * q with sc in -32..31, q in -4..3: per group of 32 the integer v = sc * q is in
    # -124..128, and v - 1 fits int8: w = d * (v - 1) + d.
    v = q.reshape(rows, -1, 16, 16) * sc[..., None]
    d32 = np.repeat(d[..., None], 8, axis=-1)
    return _int8_blocks(v - 1, d32, d32, rows, k, "Q3_K")


def decode_iq4_xs(raw: np.ndarray, rows: int, k: int) -> Int8Blocks:
    b = _blocks(raw, rows, k, _QK_K, 136)
    d = _f16(b, 0)[..., None]
    packed_high = np.ascontiguousarray(b[..., 2:4]).view(np.uint16)  # [rows, blocks, 1]
    high = ((packed_high >> (2 * np.arange(8, dtype=np.uint16))) & 3).astype(np.uint8)
    low = np.stack([b[..., 4:8] & 15, b[..., 4:8] >> 4], axis=-1).reshape(rows, -1, 8)
    sc = (low | (high << 4)).astype(np.int16) - 32
    q = _IQ4_LEVELS[_nibbles(b[..., 8:].reshape(rows, -1, 8, 16))]
    return _int8_blocks(q, d * sc, None, rows, k, "IQ4_XS")


# ---- requantized types ----------------------------------------------------------------------


def _exact(raw: np.ndarray, qtype_name: str, rows: int, k: int) -> torch.Tensor:
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    values = gguf.quants.dequantize(np.asarray(raw, dtype=np.uint8), qtype)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(rows, k)


def requantize_q6_k(raw: np.ndarray, rows: int, k: int, error: RequantError) -> Int8Blocks:
    w = _exact(raw, "Q6_K", rows, k).reshape(rows, k // _QK, _QK)
    scales = w.abs().amax(dim=-1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / safe[..., None]).clamp_(-127, 127).to(torch.int8).reshape(rows, k)
    rows_out = Int8Blocks(q, scales, _QK, "Q6_K")
    error.add(rows_out.dequantize(torch.float32), w.reshape(rows, k), "int8 blocks of 32")
    return rows_out


def requantize_q2_k(raw: np.ndarray, rows: int, k: int, error: RequantError) -> Int8Blocks:
    w = _exact(raw, "Q2_K", rows, k).reshape(rows, k // _QK, _QK)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scales = (hi - lo) / 255.0
    zeros = lo + 128.0 * scales  # q in -128..127: w = q * s + z
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round((w - zeros[..., None]) / safe[..., None]).clamp_(-128, 127)
    rows_out = Int8Blocks(q.to(torch.int8).reshape(rows, k), scales, _QK, "Q2_K", zeros)
    error.add(rows_out.dequantize(torch.float32), w.reshape(rows, k), "int8 blocks of 32")
    return rows_out


# Exact: GGML type name -> decoder.
DECODERS: dict[str, Callable[[np.ndarray, int, int], QuantizedRows]] = {
    "Q4_0": decode_q4_0,
    "Q4_1": decode_q4_1,
    "Q8_0": decode_q8_0,
    "Q5_0": decode_q5_0,
    "Q5_1": decode_q5_1,
    "IQ4_NL": decode_iq4_nl,
    "Q4_K": decode_q4_k,
    "Q5_K": decode_q5_k,
    "Q3_K": decode_q3_k,
    "IQ4_XS": decode_iq4_xs,
}
# Not exact: GGML type name -> requantizer (the error is added to the RequantError given).
REQUANTIZERS: dict[str, Callable[[np.ndarray, int, int, RequantError], QuantizedRows]] = {
    "Q6_K": requantize_q6_k,
    "Q2_K": requantize_q2_k,
}


def decode_dense(raw: np.ndarray, qtype_name: str, shape: tuple[int, ...], dtype: torch.dtype):
    """Any type the `gguf` package dequantizes, as a dense tensor in `dtype`."""
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return _exact(raw, qtype_name, rows, shape[-1]).reshape(shape).to(dtype)
