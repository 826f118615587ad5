"""MXFP4 checkpoints (``quant_method: mxfp4``, as gpt-oss is published) dequantized on load.

OCP's MX format: blocks of 32 values share one power-of-two scale. A projection ``P`` of
shape [..., N, K] is stored as ``P_blocks`` (uint8 [..., N, K / 32, 16]: two 4-bit E2M1
values per byte, the element at the even index in the low nibble) and ``P_scales`` (uint8
[..., N, K / 32]: the block's E8M0 exponent, biased by 127). A value is
``E2M1[nibble] * 2 ** (scale - 127)`` with E2M1 codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6
and 8..15 their negatives. Every such value is exact in fp32 and bf16 (one significant
bit past the leading one, the fp32 exponent range), so the dense weight is exactly the
checkpoint's in either; fp16's narrower range can round the extremes.

gpt-oss stores its experts so — ``mlp.experts.gate_up_proj`` and ``down_proj``, stacked
[E, N, K] — and everything else (attention, router, embeddings, biases) dense. The dense
gpt-oss checkpoint holds the same experts transposed ([E, K, N]), and that is what the
stream yields under the plain name, so the model, and tensor parallelism's cut, read one
format (`models.gpt_oss`). Served dense in the model dtype: a packed MXFP4 GEMM is not
written yet.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagemill.runtime.model_executor.quantization.formats import QuantizedRows
from pagemill.runtime.model_executor.quantization.hf_config import QuantizationConfig

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_BLOCKS, _SCALES = "_blocks", "_scales"
_SLICE_VALUES = 1 << 22  # values decoded at once


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """uint8 blocks [..., G, 16] and scales [..., G] -> [..., G * 32] in ``dtype``.

    Decoded in slices of rows, in fp32 (exact), so the index and fp32 temporaries stay a
    few tens of MB for any tensor size (a gpt-oss-120b layer's gate|up stack alone holds
    two billion values).
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype}, {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)} "
            "(blocks are [..., G, 16] bytes for scales [..., G])"
        )
    groups = scales.shape[-1]
    out = torch.empty(*scales.shape[:-1], groups * 32, dtype=dtype, device=blocks.device)
    rows_b = blocks.reshape(-1, groups, 16)
    rows_s = scales.reshape(-1, groups)
    rows_o = out.view(-1, groups * 32)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    lut = torch.cat((lut, -lut))
    step = max(1, _SLICE_VALUES // max(1, groups * 32))
    for r in range(0, rows_o.shape[0], step):
        b = rows_b[r : r + step]
        codes = torch.stack((b & 0x0F, b >> 4), dim=-1).int()  # [rows, G, 16, 2]
        values = lut[codes].view(b.shape[0], groups, 32)
        exponents = rows_s[r : r + step].to(torch.int32).sub_(127).unsqueeze(-1)
        rows_o[r : r + step] = torch.ldexp(values, exponents).view(b.shape[0], -1)
    return out


class Mxfp4Config(QuantizationConfig):
    """Rewrites the stream: each ``P_blocks`` / ``P_scales`` pair becomes the dense ``P``
    (transposed to the dense checkpoint's layout), in the model dtype."""

    quant_method = "mxfp4"
    parts = frozenset()

    @classmethod
    def from_config(cls, q: dict[str, Any], dtype: torch.dtype) -> Mxfp4Config:
        return cls(dtype)

    def is_quantized_module(self, prefix: str, names: set[str]) -> bool:
        return False

    def convert(self, prefix: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError("MXFP4 tensors are converted by rewrite()")

    def describe(self) -> str:
        return "mxfp4 (experts dequantized)"

    def rewrite(
        self, names: set[str], weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedRows]]:
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            suffix = next((s for s in (_BLOCKS, _SCALES) if name.endswith(s)), None)
            if suffix is None or tensor.dtype != torch.uint8:
                yield name, tensor
                continue
            base = name[: -len(suffix)]
            other = _SCALES if suffix == _BLOCKS else _BLOCKS
            if base + other not in names:
                raise ValueError(f"MXFP4 tensor {name} has no {base + other}")
            parts = pending.setdefault(base, {})
            parts[suffix] = tensor
            if len(parts) == 2:
                del pending[base]
                dense = dequantize_mxfp4(parts[_BLOCKS], parts[_SCALES], self.dtype)
                self.served[f"MXFP4 dequantized to {str(self.dtype).removeprefix('torch.')}"] += 1
                yield base, dense.transpose(-1, -2) if dense.dim() == 3 else dense
        if pending:
            raise ValueError(f"MXFP4 tensors of {next(iter(pending))} were listed but not read")
