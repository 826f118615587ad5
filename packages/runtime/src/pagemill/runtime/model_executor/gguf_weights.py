"""Reading a GGUF file's tensors as Hugging Face-named weights, quantized ones kept quantized.

The file is read with the `gguf` package (`GGUFReader` for the tensor table, its tensor
name map and dequantizers); tensor bytes come through a memory map. Tensors come out under
the Hugging Face names the model asks for, as:

- Q4_0 / Q4_1 → `Int4Groups` (groups of 32: Q4_1's d * q + m is scale d, zero m + 8d;
  Q4_0's d * (q - 8) is scale d, zero 0), exactly the values ggml dequantizes to;
- Q8_0 → `Int8Blocks` (int8 values, one scale per 32);
- F32 / F16 / BF16 → dense tensors as stored;
- any other type (Q6_K, Q4_K, ...) → dequantized by `gguf.quants.dequantize` to fp32.

What llama.cpp's converter changed beyond names (Llama's q/k rows permuted for its rotary
layout, Gemma's norms stored as w + 1) is undone per architecture (`gguf_arch`): a row
permutation keeps quantized rows exact.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagemill.runtime.model_config import ModelConfig
from pagemill.runtime.model_executor.gguf_arch import GGUF_ARCHS
from pagemill.runtime.model_executor.quantization.formats import (
    Int4Groups,
    Int8Blocks,
    QuantizedRows,
)

logger = logging.getLogger(__name__)

_BLOCK = 32  # Q4_0, Q4_1 and Q8_0 all quantize blocks of 32 values


def _reader(path: str | Path) -> Any:  # a gguf.GGUFReader
    import gguf

    return gguf.GGUFReader(str(path))


def _blocks(raw: np.ndarray, rows: int, k: int, block_bytes: int) -> torch.Tensor:
    data = np.array(raw, dtype=np.uint8, copy=True)  # out of the read-only memory map
    return torch.from_numpy(data).reshape(rows, k // _BLOCK, block_bytes)


def _half(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [...] float32 through fp16."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """ggml's 4-bit block layout: values 0..15 in the low nibbles, 16..31 in the high ones."""
    return torch.cat([qs & 15, qs >> 4], dim=-1).reshape(rows, k)


def decode_q4_0(raw: np.ndarray, rows: int, k: int) -> Int4Groups:
    b = _blocks(raw, rows, k, 2 + _BLOCK // 2)
    d = _half(b[..., 0:2])
    return Int4Groups(_nibbles(b[..., 2:], rows, k), d, torch.zeros_like(d), _BLOCK, "Q4_0")


def decode_q4_1(raw: np.ndarray, rows: int, k: int) -> Int4Groups:
    b = _blocks(raw, rows, k, 4 + _BLOCK // 2)
    d, m = _half(b[..., 0:2]), _half(b[..., 2:4])
    zeros = m + 8.0 * d
    inexact = int((zeros.double() != m.double() + 8.0 * d.double()).sum())
    if inexact:  # fp16 d and m almost never need more than fp32's 24 bits together
        logger.debug("%d Q4_1 zero points are not exact in fp32", inexact)
    return Int4Groups(_nibbles(b[..., 4:], rows, k), d, zeros, _BLOCK, "Q4_1")


def decode_q8_0(raw: np.ndarray, rows: int, k: int) -> Int8Blocks:
    b = _blocks(raw, rows, k, 2 + _BLOCK)
    d = _half(b[..., 0:2])
    q = b[..., 2:].contiguous().view(torch.int8).reshape(rows, k)
    return Int8Blocks(q, d, _BLOCK, "Q8_0")


def read_gguf_tensor(
    kind: int, shape: tuple[int, ...], raw: np.ndarray
) -> torch.Tensor | QuantizedRows:
    """One tensor from its GGML type, GGUF shape (innermost dimension first) and raw bytes,
    in Hugging Face's [out, in] orientation."""
    import gguf

    qtype = gguf.GGMLQuantizationType(kind)
    shape = tuple(int(n) for n in reversed(shape))
    k = shape[-1]
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    raw = raw.reshape(rows, -1)
    decoders: dict[gguf.GGMLQuantizationType, Callable[[np.ndarray, int, int], QuantizedRows]] = {
        gguf.GGMLQuantizationType.Q4_0: decode_q4_0,
        gguf.GGMLQuantizationType.Q4_1: decode_q4_1,
        gguf.GGMLQuantizationType.Q8_0: decode_q8_0,
    }
    if qtype in decoders and len(shape) == 2:
        return decoders[qtype](raw, rows, k)
    plain = {
        gguf.GGMLQuantizationType.F32: np.float32,
        gguf.GGMLQuantizationType.F16: np.float16,
        gguf.GGMLQuantizationType.BF16: np.int16,
    }
    if qtype in plain:
        values = torch.from_numpy(np.array(raw, copy=True).view(plain[qtype])).reshape(shape)
        return values.view(torch.bfloat16) if qtype == gguf.GGMLQuantizationType.BF16 else values
    dequantized = gguf.quants.dequantize(raw, qtype)
    return torch.from_numpy(np.ascontiguousarray(dequantized, dtype=np.float32)).reshape(shape)


_INDEX_VERSION = 1


class GGUFCheckpoint:
    """One GGUF file's tensors, read through a memory map.

    The tensor table (names, types, shapes, offsets) comes from `gguf.GGUFReader`, which also
    parses every metadata field — for a model with a 49k-token vocabulary that is seconds
    of Python. With `index_file`, the table is saved there (keyed by the file's size and
    mtime) and later opens read it instead of parsing the file again.
    """

    def __init__(
        self,
        path: str | Path,
        index_file: str | Path | None = None,
        *,
        architecture: str | None = None,
        block_count: int | None = None,
    ) -> None:
        """`architecture` / `block_count`: for a split GGUF's later shards, which carry
        only tensors (the first shard has the model's metadata)."""
        self.path = Path(path)
        stat = self.path.stat()
        key = {"version": _INDEX_VERSION, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        index = self._read_index(index_file, key)
        if index is None:
            reader = _reader(self.path)
            field = reader.fields.get("general.architecture")
            arch = str(field.contents()) if field is not None else str(architecture)
            blocks = reader.fields.get(f"{arch}.block_count")
            index = {
                **key,
                "architecture": arch,
                "block_count": int(blocks.contents()) if blocks is not None else block_count,
                "tensors": [
                    [
                        t.name,
                        int(t.tensor_type),
                        [int(n) for n in t.shape.tolist()],
                        int(t.data_offset),
                        int(t.n_bytes),
                    ]
                    for t in reader.tensors
                ],
            }
            if index_file is not None:
                self._write_index(Path(index_file), index)
        self.architecture: str = index["architecture"]
        self.block_count: int = index["block_count"]
        self.tensors: list[tuple[str, int, list[int], int, int]] = [
            tuple(t) for t in index["tensors"]
        ]
        self._data = np.memmap(self.path, dtype=np.uint8, mode="r")

    @staticmethod
    def _read_index(index_file: str | Path | None, key: dict) -> dict | None:
        if index_file is None or not Path(index_file).is_file():
            return None
        try:
            index = json.loads(Path(index_file).read_text())
        except (OSError, json.JSONDecodeError):
            return None
        return index if all(index.get(k) == v for k, v in key.items()) else None

    @staticmethod
    def _write_index(index_file: Path, index: dict) -> None:
        try:
            tmp = index_file.with_name(index_file.name + f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(index))
            tmp.replace(index_file)
        except OSError as e:  # a read-only cache only costs the next start some seconds
            logger.debug("could not save the GGUF tensor index to %s: %s", index_file, e)

    def tensor_types(self) -> dict[str, int]:
        """How many tensors of each GGML type the file holds (for logs)."""
        import gguf

        counts: dict[str, int] = {}
        for _, kind, *_ in self.tensors:
            name = gguf.GGMLQuantizationType(kind).name
            counts[name] = counts.get(name, 0) + 1
        return counts

    def _name_map(self, names: Iterable[str]) -> dict[str, str]:
        """GGUF tensor name -> Hugging Face name, for the Hugging Face names asked for."""
        import gguf

        archs = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
        if self.architecture not in archs:
            raise ValueError(
                f"GGUF architecture {self.architecture!r} is not known to the gguf package"
            )
        tmap = gguf.get_tensor_name_map(archs[self.architecture], self.block_count)
        out: dict[str, str] = {}
        for hf in names:
            g = tmap.get_name(hf, try_suffixes=(".weight", ".bias"))
            if g is not None:
                out[g] = hf
        return out

    def weights(
        self, names: Iterable[str], config: ModelConfig
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedRows]]:
        """Yield (Hugging Face name, tensor or quantized rows) for every tensor of the file
        that one of `names` maps to; tensors nothing asks for (rope tables, ...) are skipped."""
        mapping = self._name_map(names)
        arch = GGUF_ARCHS.get(self.architecture)
        for name, kind, shape, offset, n_bytes in self.tensors:
            hf = mapping.get(name)
            if hf is None:
                continue
            value = read_gguf_tensor(kind, tuple(shape), self._data[offset : offset + n_bytes])
            if arch is not None:  # llama.cpp's storage conventions (q/k permutation, norms)
                value = arch.undo(name, value, config)
            yield hf, value


def iterate_gguf_weights(
    path: str | Path, names: Iterable[str], config: ModelConfig
) -> Iterator[tuple[str, torch.Tensor | QuantizedRows]]:
    """`GGUFCheckpoint(path).weights(names, config)`."""
    yield from GGUFCheckpoint(path).weights(names, config)
