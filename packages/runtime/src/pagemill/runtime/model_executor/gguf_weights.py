"""Reading a GGUF file's tensors as Hugging Face-named weights, quantized ones kept quantized.

The file is read with the `gguf` package (`GGUFReader` for the tensor table, its tensor
name map and dequantizers); tensor bytes come through a memory map. Tensors come out under
the Hugging Face names the model asks for, as:

- quantized types → the packed rows of `quantization.gguf_blocks`: Q4_0/Q4_1/Q4_K as
  `Int4Groups`, Q8_0/Q5_x/Q5_K/Q3_K/IQ4 as `Int8Blocks`, all exact; Q6_K/Q2_K
  requantized (error measured and reported) when the rows will be served packed;
- F32 / F16 / BF16 → dense tensors as stored;
- any other type (IQ2, IQ3, ...) → dequantized by `gguf.quants.dequantize`, in the compute
  dtype.

What llama.cpp's converter changed beyond names (Llama's q/k rows permuted for its rotary
layout, Gemma's norms stored as w + 1) is undone per architecture (`gguf_arch`): a row
permutation keeps quantized rows exact.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagemill.runtime.model_config import ModelConfig
from pagemill.runtime.model_executor.gguf_arch import GGUF_ARCHS
from pagemill.runtime.model_executor.quantization.formats import QuantizedRows
from pagemill.runtime.model_executor.quantization.gguf_blocks import (
    DECODERS,
    REQUANTIZERS,
    RequantError,
    decode_dense,
)

logger = logging.getLogger(__name__)


def _reader(path: str | Path) -> Any:  # a gguf.GGUFReader
    import gguf

    return gguf.GGUFReader(str(path))


def read_gguf_tensor(
    kind: int,
    shape: tuple[int, ...],
    raw: np.ndarray,
    *,
    requantize: bool = True,
    dense_dtype: torch.dtype = torch.float32,
    errors: dict[str, RequantError] | None = None,
) -> torch.Tensor | QuantizedRows:
    """One tensor from its GGML type, GGUF shape (innermost dimension first) and raw bytes,
    in Hugging Face's [out, in] orientation.

    Quantized matrices come out as the packed rows of `quantization.gguf_blocks` (exact), or
    requantized for types no packed format holds exactly (Q6_K, Q2_K) when `requantize`,
    their error added to `errors[type]`; otherwise, and for types with no packed form, as
    a dense tensor in `dense_dtype` (exact before that cast).
    """
    import gguf

    qtype = gguf.GGMLQuantizationType(kind)
    shape = tuple(int(n) for n in reversed(shape))
    k = shape[-1]
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    raw = raw.reshape(rows, -1)
    plain = {
        gguf.GGMLQuantizationType.F32: np.float32,
        gguf.GGMLQuantizationType.F16: np.float16,
        gguf.GGMLQuantizationType.BF16: np.int16,
    }
    if qtype in plain:
        values = torch.from_numpy(np.array(raw, copy=True).view(plain[qtype])).reshape(shape)
        return values.view(torch.bfloat16) if qtype == gguf.GGMLQuantizationType.BF16 else values
    name = qtype.name
    if len(shape) == 2 and name in DECODERS:
        return DECODERS[name](raw, rows, k)
    if len(shape) == 2 and name in REQUANTIZERS and requantize:
        error = RequantError() if errors is None else errors.setdefault(name, RequantError())
        return REQUANTIZERS[name](raw, rows, k, error)
    return decode_dense(raw, name, shape, dense_dtype)


_INDEX_VERSION = 1
# A per-expert Hugging Face name: llama.cpp stacks a layer's experts into one tensor
# (`ffn_gate_exps`, ...) named as the converter's merged name, without the expert index.
_EXPERT = re.compile(r"^(.*\.experts\.)(\d+)\.(.*)$")


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
        # GGML type -> error of the tensors `weights` requantized so far.
        self.requant_errors: dict[str, RequantError] = {}

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
        """GGUF tensor name -> Hugging Face name, for the Hugging Face names asked for; a
        stacked expert tensor -> the per-expert name with `{}` for the expert index."""
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
            elif (m := _EXPERT.match(hf)) is not None:
                g = tmap.get_name(m[1] + m[3], try_suffixes=(".weight", ".bias"))
                if g is not None:
                    out[g] = f"{m[1]}{{}}.{m[3]}"
        return out

    def weights(
        self,
        names: Iterable[str],
        config: ModelConfig,
        *,
        requantize: bool = True,
        dense_dtype: torch.dtype = torch.float32,
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedRows]]:
        """Yield (Hugging Face name, tensor or quantized rows) for every tensor of the file
        that one of `names` maps to; tensors nothing asks for (rope tables, ...) are skipped.

        `requantize`: the rows will be served packed, so types no packed format holds exactly
        may be requantized (see `read_gguf_tensor`; errors in `requant_errors`). The embedding
        never is: its lookup reads every value, so it gets them as the file holds them."""
        mapping = self._name_map(names)
        arch = GGUF_ARCHS.get(self.architecture)
        for name, kind, shape, offset, n_bytes in self.tensors:
            hf = mapping.get(name)
            if hf is None:
                continue
            if "{}" in hf:
                yield from self._experts(
                    hf, name, kind, shape, offset, n_bytes, config, dense_dtype, requantize
                )
                continue
            value = read_gguf_tensor(
                kind,
                tuple(shape),
                self._data[offset : offset + n_bytes],
                requantize=requantize and not hf.endswith("embed_tokens.weight"),
                dense_dtype=dense_dtype,
                errors=self.requant_errors,
            )
            if arch is not None:  # llama.cpp's storage conventions (q/k permutation, norms)
                value = arch.undo(name, value, config)
            yield hf, value

    def _experts(
        self,
        hf: str,
        name: str,
        kind: int,
        shape: list[int],
        offset: int,
        n_bytes: int,
        config: ModelConfig,
        dense_dtype: torch.dtype,
        requantize: bool = False,
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedRows]]:
        """A stacked expert tensor (GGUF shape [in, rows, experts]) one expert at a time,
        so that no layer's experts are ever dense at once. With `requantize` (the rows will
        be served packed) quantized rows come out as `read_gguf_tensor` gives them, the
        same rules as a dense layer's (the MoE layer packs them: `layers.fused_moe`);
        otherwise they are dequantized exactly (fp32, one expert) before the one rounding
        to the compute dtype — not with scales in that dtype, as a packed kernel computes."""
        experts = shape[-1]
        size = n_bytes // experts
        arch = GGUF_ARCHS.get(self.architecture)
        for j in range(experts):
            start = offset + j * size
            value = read_gguf_tensor(
                kind,
                tuple(shape[:-1]),
                self._data[start : start + size],
                requantize=requantize,
                dense_dtype=dense_dtype,
                errors=self.requant_errors,
            )
            if isinstance(value, QuantizedRows) and not requantize:
                value = value.dequantize(torch.float32).to(dense_dtype)
            yield hf.format(j), value if arch is None else arch.undo(name, value, config)


def iterate_gguf_weights(
    path: str | Path, names: Iterable[str], config: ModelConfig
) -> Iterator[tuple[str, torch.Tensor | QuantizedRows]]:
    """`GGUFCheckpoint(path).weights(names, config)`."""
    yield from GGUFCheckpoint(path).weights(names, config)
