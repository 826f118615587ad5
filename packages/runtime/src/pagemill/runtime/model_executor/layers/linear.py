"""A linear layer whose weight format is the layer's own business.

The model calls `proj(x)` and loads checkpoint rows with `proj.load_rows(offset, value)`
(fused projections take several checkpoint tensors at row offsets); a value is a dense
tensor or quantized rows (`Int4Groups` / `Int8Blocks`, e.g. straight from a GGUF file).
Once every row is in — or at the latest when `finalize()` is called — the layer turns what
it holds into the format its `scheme` asks for (see `pagemill.runtime.model_executor.quantization`):

- dense: `weight` [out, in] in the compute dtype, `F.linear`;
- int8: `qweight` int8 [out, in] and one scale per row, `aten._weight_int8pack_mm`;
- int4: `qweight` packed by `aten._convert_weight_to_int4pack_for_cpu` and
  `scales_and_zeros` [planes * in / g, out, 2], `aten._weight_int4pack_mm_for_cpu`
  (two planes carry an int8 value exactly: see `quantization.formats`);
- int4 with int8 activations (`int8_activations`, the default for one-plane int4 in bf16
  on the CPU: see `_int8_activation_planes`): `qweight` uint8 tiles of
  `pagemill.kernels.gemv_q4_cpu` (exact fp16/fp32 scales, no `scales_and_zeros`),
  `torch.ops.pagemill_native.gemv_q4` (a C++ torch operator; `torch.ops.pagemill.gemv_q4`
  over ctypes where it cannot be built), which rounds each input row to int8 per block of
  32 and multiplies in integer SIMD, as llama.cpp does: a decode step streams its weights
  faster than through PyTorch's int4 kernel. With =2 the rounding's
  remainder goes through a second int8 plane (error ~max|x| / 64516 per block instead of
  llama.cpp's / 254, which flips visibly more greedy tokens on SmolLM2);
  PAGEMILL_CPU_INT8_ACTIVATIONS=1 keeps one plane, 0 PyTorch's kernel. Layers asking for
  fp32 kernels (`WeightScheme.kernel_dtype`, kept for exactness checks) keep PyTorch's;
- q8_0 (under the same switch: GGUF Q8_0 rows, e.g. SmolLM2's LM head): `qweight` uint8
  tiles of `pagemill.kernels.gemv_q8_cpu` (int8 values with their exact fp16 scales, the
  file's bytes per weight), `torch.ops.pagemill.gemv_q8`, int8 activations as for int4;
  with it at 0 Q8_0 rows are served as two int4 planes (int4x2);
- triton_int4 (CUDA): int4-group rows kept as they came, packed for the kernels' Triton
  dequant-GEMM (`pagemill.kernels.pack_int4_groups`): `qweight` int32 [in / 8, out],
  `scales` / `zeros` fp32 [in / g, out] (fp32 keeps a checkpoint's fp16 scales exact under
  bf16 activations), `torch.ops.pagemill.int4_group_gemm` — an opaque custom op, so a
  compiled graph or a captured CUDA graph holds it as one call. Int8 blocks (Q8_0, ...) and
  rows the kernel cannot take are dequantized to the dense weight instead.

The packed kernels compute in `kernel_dtype` (bf16 unless the scheme says otherwise: they
are only vectorized for bf16), so an fp32 model's packed layers cast on the way in and out.

A packed layer may keep `weight` too — a dense copy of the same dequantized values — and
then runs it for steps of more than `packed_max_tokens` rows, where a dense GEMM is faster.
An int4 layer served by `gemv_q4` on a CPU with AMX needs no dense copy for that: its large
batches run `gemm_q4_amx`, which turns each weight block into bf16 tiles as it goes and
multiplies on the matrix units — the dense bf16 product without the copy's memory
(`amx_large_rows`, `PAGEMILL_CPU_AMX_PACKED`). A bf16 q8_0 layer likewise runs
`gemm_q8_amx` (its blocks made into bf16 as it goes). A tied q8_0 head keeps the bf16
embedding as `weight` (the AMX side then rounds the scales as the embedding was made, so both
make the same weights), and the start-up crossover measurement may still pick oneDNN on it
for large batches where that measures faster (`crossover.measure_packed_limits`).
The branch on the row count is the only shape-dependent choice; see `compiled_branch` for
how a compiled graph makes it.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagemill.kernels import (
    gelu_tanh_and_mul,
    gemv_q4_cpu,  # also registers pagemill::gemv_q4
    gemv_q8_cpu,  # also registers pagemill::gemv_q8
    pack_int4_groups,  # also registers pagemill::int4_group_gemm
    silu_and_mul,
)
from pagemill.kernels.cpu_native import load_gemv_ops
from pagemill.runtime.model_executor.huge_page_weights import arena_view
from pagemill.runtime.model_executor.layers.prepacked import prepacked_linear
from pagemill.runtime.model_executor.quantization.formats import (
    INT4_GROUP_SIZES,
    INT4_N_MULTIPLE,
    Int4Groups,
    Int8Blocks,
    QuantizedRows,
    int4_planes,
    pack_int4,
    quantize_int4_groups,
    quantize_int8_per_channel,
    unpack_int4_dense,
)
from pagemill.runtime.model_executor.quantization.scheme import (
    DENSE,
    KERNEL_DTYPE,
    PACKED_MAX_TOKENS,
    WeightScheme,
)

if TYPE_CHECKING:
    from pagemill.runtime.lora.layers import LoRALayer

logger = logging.getLogger(__name__)

# torch.cond on a row count the graph specialized (a decode of one sequence) is a constant
# predicate: the branch is picked at trace time, which is what we want; say nothing.
warnings.filterwarnings("ignore", message="Pred is a Python constant", category=UserWarning)


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _int8_activation_planes() -> int:
    """`PAGEMILL_CPU_INT8_ACTIVATIONS` (0, 1 or 2; default 2); anything else is refused.

    Two planes by default: a decode step of few rows streams its weights faster through
    `gemv_q4` / `gemv_q8` than through PyTorch's int4 kernel, and teacher forced on a fixed
    text against the GGUF dequantized to fp32 (`benchmarks/int8_quality.py`) their
    next-token distributions are no further from it than PyTorch's kernel's. 0 keeps
    PyTorch's kernel (bf16 activations); 1 is llama.cpp's rounding, one plane, measurably
    further off. Where no C++ compiler builds the kernels, PyTorch's kernel serves anyway."""
    value = os.environ.get("PAGEMILL_CPU_INT8_ACTIVATIONS", "2").strip()
    if value not in ("0", "1", "2"):
        raise ValueError(f"PAGEMILL_CPU_INT8_ACTIVATIONS must be 0, 1 or 2, got {value!r}")
    return int(value)


def _amx_packed_switch() -> bool:
    """`PAGEMILL_CPU_AMX_PACKED` (1, the default, or 0); anything else is refused.

    0 keeps the dense copies for large batches of `gemv_q4` layers where AMX could run them
    from the packed blocks (to compare, or on a machine where the copy measures faster)."""
    value = os.environ.get("PAGEMILL_CPU_AMX_PACKED", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"PAGEMILL_CPU_AMX_PACKED must be 0 or 1, got {value!r}")
    return value == "1"


def _check_gemv_amx_switch() -> None:
    """`PAGEMILL_CPU_GEMV_AMX`: 0 (never), 1 / auto / unset (the kernels' own row counts) or
    a row count n >= 2 from which `gemv_q4` and `gemv_q8` move to the AMX-INT8 tiles. The C++
    kernels read it themselves (they cannot refuse a value); it is checked here, at start,
    so a value they would misread is refused instead of silently taken as "never"."""
    value = os.environ.get("PAGEMILL_CPU_GEMV_AMX", "").strip()
    if value in ("", "0", "1", "auto") or (value.isdigit() and int(value) >= 2):
        return
    raise ValueError(f"PAGEMILL_CPU_GEMV_AMX must be 0, 1, auto or a row count, got {value!r}")


_check_gemv_amx_switch()


class Linear(nn.Module):
    """y = x Wᵀ (+ b), W [out_features, in_features]."""

    # How a compiled graph chooses between a packed layer's two paths:
    # "guard": a Python branch on the row count — dynamo guards on it (a SHAPE_ENV guard:
    #   keep those) and compiles one graph per side (warm both: `packed_row_limits`); under
    #   `freezing` the dense side gets oneDNN's prepacked bf16 GEMM.
    # "cond": torch.cond — one graph, the choice made per call, no guard needed; but the
    #   dense side is a plain mm and the graph fuses less around the conds: SmolLM2 decode
    #   steps measured 1.2-1.7x slower than "guard" (4 rows 26 vs 15 ms, 64 rows 121 vs 102).
    compiled_branch = "guard"
    # Packed matmuls as opaque ops (PyTorch's own CPU kernels) in a graph compiled for the
    # compile cache, which compiles without `freezing`: unfrozen, inductor lowers them
    # through `quantized::int4mm_packed_weight_cpu` instead (see `compilation`'s status).
    opaque_packed = False
    # Activation planes of `gemv_q4` for one-plane int4 layers in bf16 on the CPU (when its
    # kernel builds here): 2 int8 plus its remainder, 1 int8 alone, 0 (the default):
    # PyTorch's int4 kernel. Read when a layer is finalized.
    int8_activations = _int8_activation_planes()
    # Large batches of `gemv_q4` int4 layers on the AMX tiles from the packed blocks
    # (`gemm_q4_amx`, bf16) instead of a dense copy, where the CPU has AMX. Read when a
    # layer is finalized.
    amx_packed = _amx_packed_switch()

    # In a compiled graph, read the gemv kernels' packed blocks as slices of the one mapping
    # they were moved into (`huge_page_weights.arena_view`) rather than as the layer's own
    # buffer: one graph input for all of them instead of one each.
    read_from_arena = True

    # Buffers (None until `finalize` packs the weight).
    qweight: torch.Tensor | None
    scales: torch.Tensor | None
    scales_and_zeros: torch.Tensor | None
    zeros: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.dtype = dtype
        self.weight: nn.Parameter | None = _param(out_features, in_features, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None
        self.scheme: WeightScheme = DENSE
        self.format = "dense"  # "dense" | "int8" | "int4" | "q8_0" | "triton_int4"
        self.int4_planes = 1
        # int4 / q8_0 served by gemv_q4 / gemv_q8 with this many planes (`int8_activations`)
        self.int8_act = 0
        self.native_gemv = False
        # Rows above `packed_max_tokens` run `gemm_q4_amx` / `gemm_q8_amx` on the packed
        # blocks (no dense copy).
        self.amx_large_rows = False
        # q8_0: `gemm_q8_amx` rounds the scales to bf16 first, as the shared dense weight (a
        # tied head's embedding) was made (see `use_dense_weight`).
        self.amx_bf16_scales = False
        self.group_size = 0
        self.packed_max_tokens = 0
        self.kernel_dtype = dtype
        self.register_buffer("qweight", None)
        self.register_buffer("scales", None)  # int8: [out]; triton_int4: [in / g, out]
        self.register_buffer("zeros", None)  # triton_int4: [in / g, out]
        self.register_buffer("scales_and_zeros", None)  # int4: [planes * in / g, out, 2]
        self.source = "dense"  # what the loaded rows were (for logs): dense, Q4_1, Q8_0, ...
        self._pieces: dict[int, QuantizedRows] = {}
        self._loaded: dict[int, int] = {}
        self._finalized = False
        # Adapter slots (`pagemill.runtime.lora`), set once by the LoRA manager: every
        # token then adds its own adapter's delta after the layer's own matmul.
        self.lora: LoRALayer | None = None
        # The dense weight has a oneDNN-prepacked twin (see `prepacked`).
        self.prepacked = False

    # ---- loading ---------------------------------------------------------------------------

    @torch.no_grad()
    def load_rows(self, offset: int, value: torch.Tensor | QuantizedRows) -> None:
        """Rows [offset, offset + len(value)) of the weight; the caller checks the shape."""
        if self._finalized:
            raise RuntimeError("weights loaded into a Linear after finalize()")
        rows = value.shape[0]
        if isinstance(value, torch.Tensor):
            if not value.is_floating_point() or value.element_size() == 1:
                # int / fp8 values mean nothing without their scales: a quantized checkpoint
                # whose method did not convert them (see quantization.hf_config).
                raise TypeError(
                    f"a {value.dtype} tensor reached a Linear [{self.out_features}, "
                    f"{self.in_features}] as plain weights; quantized weights need their "
                    "quantization_config's reader"
                )
            assert self.weight is not None
            self.weight.narrow(0, offset, rows).copy_(value)
        else:
            self._pieces[offset] = value
        self._loaded[offset] = rows
        if sum(self._loaded.values()) == self.out_features:
            self.finalize()  # convert now: a model never holds all its dense weights at once

    @torch.no_grad()
    def finalize(self) -> None:
        """Turn the loaded rows into the scheme's format; idempotent."""
        if self._finalized:
            return
        self._finalized = True
        weight = self.weight
        assert weight is not None  # only finalize (this, once) drops the dense weight
        pieces = dict(sorted(self._pieces.items()))
        self._pieces, self._loaded = {}, {}
        method = self.scheme.method
        kdt = self.scheme.kernel_dtype or KERNEL_DTYPE
        if pieces:
            self.source = "+".join(sorted({p.source for p in pieces.values()}))
        # Dense rows mixed in, a dense scheme, or a format the kernels cannot take: dequantize.
        complete = sum(p.shape[0] for p in pieces.values()) == self.out_features
        why = self._why_not_packable(pieces, method) if pieces else None
        if pieces and (why is not None or not complete):
            if method in ("native", "int4", "triton_int4") and complete:
                logger.info(
                    "%s rows [%d, %d] %s: %s",
                    self.source,
                    self.out_features,
                    self.in_features,
                    "are requantized" if method == "int4" else "stay dense",
                    why,
                )
            for off, p in pieces.items():  # exact values, rounded once to the dtype
                weight.narrow(0, off, p.shape[0]).copy_(p.dequantize(torch.float32))
            pieces = {}
        if method == "dense" or (method in ("native", "triton_int4") and not pieces):
            return
        if method == "triton_int4":
            self._pack_triton_int4([p for p in pieces.values() if isinstance(p, Int4Groups)])
            return
        self.kernel_dtype = kdt
        if method == "int8":
            q, scales = quantize_int8_per_channel(weight, kdt)
            self._set_packed("int8", qweight=q, scales=scales)
            if self.scheme.dense_fallback:
                weight.copy_((q.float() * scales.float()[:, None]).to(self.dtype))
        elif pieces and self._takes_q8_blocks(list(pieces.values()), kdt, weight.device):
            q8 = torch.cat([p.q for p in pieces.values() if isinstance(p, Int8Blocks)])
            d8 = torch.cat([p.scales for p in pieces.values() if isinstance(p, Int8Blocks)])
            tiles = gemv_q8_cpu.pack_q8_blocks(q8, d8)
            self._set_packed("q8_0", qweight=tiles)
            self.group_size = gemv_q8_cpu.QK
            self.int8_act = 2 if self.int8_activations >= 2 else 1
            self.native_gemv = True
            # As for int4: large batches on the matrix units from the packed tiles
            # (`gemm_q8_amx`, the bf16 values a dense copy would hold), so no dense copy. In
            # bf16 models only: an fp32 model's dense copy holds the rows exactly, and its
            # packed side's two int8 planes round x more finely than bf16 would.
            self.amx_large_rows = (
                self.amx_packed
                and self.dtype == torch.bfloat16
                and not self.scheme.keep_dense_copy
                and self.native_gemv
                and gemv_q8_cpu.gemm_amx_available()
            )
            if self.scheme.dense_fallback and not self.amx_large_rows:
                weight.copy_(gemv_q8_cpu.dequantize_q8_blocks(tiles, self.out_features))
        else:
            if pieces:
                q, s, z, g, planes = int4_planes(list(pieces.values()))
            else:
                rows = quantize_int4_groups(weight, self.scheme.group_size, kdt)
                q, s, z, g, planes = rows.q, rows.scales, rows.zeros, rows.group_size, 1
            self.group_size, self.int4_planes = g, planes
            scale_dtype = kdt
            if self._takes_int8_activations(planes, kdt, weight.device):
                self._set_packed("int4", qweight=gemv_q4_cpu.pack_q4_blocks(q, s, z, g))
                self.int8_act = 2 if self.int8_activations >= 2 else 1
                self.native_gemv = True
                scale_dtype = torch.float32  # its scales are exact
                # The matrix units multiply the packed blocks themselves: a dense copy would
                # only cost memory (and is not needed even where copies are refused).
                self.amx_large_rows = (
                    self.amx_packed
                    and not self.scheme.keep_dense_copy
                    and self.native_gemv
                    and gemv_q4_cpu.amx_available()
                )
            else:
                packed, scales_and_zeros = pack_int4(q, s, z, kdt)
                self._set_packed("int4", qweight=packed, scales_and_zeros=scales_and_zeros)
            if self.scheme.dense_fallback and not self.amx_large_rows:
                weight.copy_(unpack_int4_dense(q, s, z, g, planes, self.dtype, scale_dtype))
        if not self.scheme.dense_fallback or self.amx_large_rows:
            self.weight = None
        limit = self.scheme.packed_max_tokens
        if limit is None:  # q8_0 streams as many bytes as int4x2 and computes less
            limit = PACKED_MAX_TOKENS.get(self.weight_format, PACKED_MAX_TOKENS["int4x2"])
        self.packed_max_tokens = limit

    @property
    def native_gemv(self) -> bool:
        """Whether `gemv_q4` / `gemv_q8` are called as C++ torch operators
        (`torch.ops.pagemill_native`, `cpu_native.load_gemv_ops`) rather than through the
        Python custom ops."""
        return bool(self.__dict__.get("native_gemv", False))

    @native_gemv.setter
    def native_gemv(self, value: bool) -> None:
        # Set True, the operators are loaded in this process (or it stays False where they
        # cannot be). The weight cache restores plain attributes with object.__setattr__, which
        # a property still sees: a restored layer loads them too. The value lives in __dict__
        # under its own name, so that the cache sees it as a plain attribute.
        self.__dict__["native_gemv"] = bool(value) and load_gemv_ops()

    def _takes_int8_activations(
        self, planes: int, kernel_dtype: torch.dtype, device: torch.device
    ) -> bool:
        return (
            self.int8_activations > 0
            and planes == 1
            and kernel_dtype == torch.bfloat16
            and device.type == "cpu"
            and self.in_features % gemv_q4_cpu.QK == 0
            and gemv_q4_cpu.available()
        )

    def _takes_q8_blocks(
        self, pieces: list[QuantizedRows], kernel_dtype: torch.dtype, device: torch.device
    ) -> bool:
        """Q8_0 rows (int8 blocks of 32, fp16 scales, no zero points) for `gemv_q8`."""
        return (
            self.int8_activations > 0
            and kernel_dtype == torch.bfloat16
            and device.type == "cpu"
            and all(
                isinstance(p, Int8Blocks)
                and p.zeros is None
                and p.block_size == gemv_q8_cpu.QK
                and gemv_q8_cpu.packable(p.q, p.scales)
                for p in pieces
            )
            and gemv_q8_cpu.available()
        )

    def _pack_triton_int4(self, pieces: list[Int4Groups]) -> None:
        q = torch.cat([p.q for p in pieces])
        s = torch.cat([p.scales for p in pieces])
        z = torch.cat([p.zeros for p in pieces])
        device = self.weight.device if self.weight is not None else q.device
        qweight, scales, zeros = pack_int4_groups(
            q.to(device), s.to(device), z.to(device), torch.float32
        )
        self._set_packed("triton_int4", qweight=qweight, scales=scales, zeros=zeros)
        self.group_size = pieces[0].group_size
        self.weight = None  # the GEMM reads the packed rows at every batch size

    def _why_not_packable(self, pieces: dict[int, QuantizedRows], method: str) -> str | None:
        if method == "triton_int4":
            values = list(pieces.values())
            if not all(isinstance(p, Int4Groups) for p in values):
                return "not int4 groups (the GPU int4 GEMM takes int4 groups only)"
            sizes = {p.group_size for p in values if isinstance(p, Int4Groups)}
            if len(sizes) != 1 or self.in_features % 8 or self.in_features % next(iter(sizes)):
                return f"group sizes {sorted(sizes)} do not tile in_features {self.in_features}"
            return None
        if method not in ("native", "int4"):
            return f"the scheme is {method}"
        values = list(pieces.values())
        if method == "int4" and not all(
            isinstance(p, Int4Groups) and p.group_size == self.scheme.group_size for p in values
        ):
            return "not int4 groups of the asked size"
        sizes = {p.group_size if isinstance(p, Int4Groups) else p.block_size for p in values}
        if len(sizes) != 1 or next(iter(sizes)) not in INT4_GROUP_SIZES:
            return f"group sizes {sorted(sizes)}, the int4 kernel takes one of {INT4_GROUP_SIZES}"
        if self.out_features % INT4_N_MULTIPLE:
            return f"out_features {self.out_features} is not a multiple of {INT4_N_MULTIPLE}"
        if not all(isinstance(p, (Int4Groups, Int8Blocks)) for p in values):
            return "unknown row format"
        return None

    def _set_packed(self, fmt: str, **buffers: torch.Tensor) -> None:
        self.format = fmt
        for name, value in buffers.items():
            setattr(self, name, value)

    def use_dense_weight(self, weight: torch.Tensor) -> None:
        """Share an existing dense [out, in] tensor (e.g. a tied embedding) as the dense copy."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"dense weight {tuple(weight.shape)} does not fit "
                f"[{self.out_features}, {self.in_features}]"
            )
        self.weight = (
            weight
            if isinstance(weight, nn.Parameter)
            else nn.Parameter(weight, requires_grad=False)
        )
        if self.format == "q8_0" and self.amx_large_rows:
            self.amx_bf16_scales = self._holds_bf16_scaled_rows(weight)

    @torch.no_grad()
    def _holds_bf16_scaled_rows(self, weight: torch.Tensor) -> bool:
        """Whether `weight` holds the tiles' rows dequantized with scales rounded to bf16 (a
        bf16 embedding as `formats.dequantize` makes it) rather than the exact fp16 scales,
        judged on its first rows: `gemm_q8_amx` then makes the same values, and a tied head's
        large-row paths (AMX on the tiles, oneDNN on the embedding) agree."""
        assert self.qweight is not None
        rows = min(self.out_features, 256)
        if weight.dtype != torch.bfloat16:
            return False
        tiles = self.qweight[: -(-rows // gemv_q8_cpu.ROWS)]
        made = gemv_q8_cpu.gemm_q8_amx_weights(tiles, rows, bf16_scales=True)
        return bool(torch.equal(made, weight[:rows].detach().cpu()))

    # ---- introspection ---------------------------------------------------------------------

    @property
    def weight_format(self) -> str:
        """dense, int8, int4, int4x2 (two planes: an exact int8 block format) or q8_0."""
        if self.format == "int4" and self.int4_planes == 2:
            return "int4x2"
        return self.format

    @property
    def finalized(self) -> bool:
        return self._finalized

    @property
    def has_dense_fallback(self) -> bool:
        """Whether rows above `packed_max_tokens` leave the packed kernel: for a dense copy,
        or for `gemm_q4_amx` / `gemm_q8_amx` on the packed blocks (`amx_large_rows`)."""
        return self.format != "dense" and (self.weight is not None or self.amx_large_rows)

    def packed_nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (self.qweight, self.scales, self.scales_and_zeros, self.zeros)
            if t is not None
        )

    def extra_repr(self) -> str:
        s = (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, format={self.weight_format}"
        )
        if self.format in ("int4", "q8_0", "triton_int4"):
            s += f", group_size={self.group_size}"
        if self.int8_act:
            s += f", int8 activations x{self.int8_act}"
        if self.amx_large_rows:
            s += f", AMX above {self.packed_max_tokens} rows"
        elif self.has_dense_fallback:
            s += f", dense above {self.packed_max_tokens} rows"
        return s

    # ---- compute ---------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]."""
        y = self._forward(x)
        return y if self.lora is None else self.lora.apply(x, y)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.format == "dense":
            return self._dense(x)
        if self.format == "triton_int4":
            return self._triton_int4(x)
        if not self.has_dense_fallback:
            return self._packed(x)
        if self.compiled_branch == "cond" and torch.compiler.is_compiling():
            # Both paths in one graph, the row count picks one per call (no shape guard).
            # A row count the graph specialized (e.g. 1) is a constant: one branch is kept.
            return torch.cond(x.shape[0] > self.packed_max_tokens, self._dense, self._packed, (x,))
        return self._dense(x) if x.shape[0] > self.packed_max_tokens else self._packed(x)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        if self.amx_large_rows:
            return self._amx(x)
        return self._onednn(x)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        """The dense weight through oneDNN: a dense layer, a packed layer's dense copy, or the
        bf16 embedding a tied head shares (also where it has `amx_large_rows`: the crossover
        measurement times both, see `crossover.time_layers`)."""
        assert self.weight is not None  # the dense path is taken only with a dense copy
        if not self.prepacked:
            return F.linear(x, self.weight, self.bias)
        if not torch.compiler.is_compiling():
            return prepacked_linear(x, self.weight, self.bias)
        if self.opaque_packed:  # a graph without `freezing`: its weights are inputs
            return torch.ops.pagemill.prepacked_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)  # `freezing` prepacks constants itself

    def _triton_int4(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.pagemill.int4_group_gemm(
            x.reshape(-1, self.in_features), self.qweight, self.scales, self.zeros, self.group_size
        ).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_act:
            return self._gemv_q8(x) if self.format == "q8_0" else self._gemv_q4(x)
        xk = x if x.dtype == self.kernel_dtype else x.to(self.kernel_dtype)
        opaque = self.opaque_packed and torch.compiler.is_compiling()
        if self.format == "int8":
            mm8 = (
                torch.ops.pagemill.weight_int8pack_mm
                if opaque
                else torch.ops.aten._weight_int8pack_mm
            )
            y = mm8(xk.contiguous(), self.qweight, self.scales)
        else:
            if self.int4_planes == 2:
                xk = torch.cat([xk, xk], dim=-1)
            mm4 = (
                torch.ops.pagemill.weight_int4pack_mm
                if opaque
                else torch.ops.aten._weight_int4pack_mm_for_cpu
            )
            y = mm4(xk.contiguous(), self.qweight, self.group_size, self.scales_and_zeros)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias

    def _kernel_qweight(self) -> torch.Tensor:
        """The packed blocks for the gemv operators: inside a compiled graph, their slice of
        the one mapping (see `read_from_arena`), else the buffer."""
        if self.read_from_arena and torch.compiler.is_compiling():
            view = arena_view(self, "qweight")
            if view is not None:
                return view
        assert self.qweight is not None
        return self.qweight

    def _gemv_q4(self, x: torch.Tensor) -> torch.Tensor:
        # The kernel takes fp32 and bf16 as they are (it rounds to int8 either way).
        xk = x if x.dtype in (torch.float32, torch.bfloat16) else x.to(self.kernel_dtype)
        xk = xk.reshape(-1, self.in_features)
        if self.native_gemv:  # the C++ operator: no Python between the graph and the kernel
            y = torch.ops.pagemill_native.gemv_q4(
                xk, self._kernel_qweight(), self.out_features, self.int8_act
            )
        elif torch.compiler.is_compiling():
            y = torch.ops.pagemill.gemv_q4(
                xk, self._kernel_qweight(), self.out_features, self.int8_act
            )
        else:  # eager: skip the dispatcher
            assert self.qweight is not None
            y = gemv_q4_cpu.gemv_q4(xk, self.qweight, self.out_features, planes=self.int8_act)
        y = y.view(*x.shape[:-1], self.out_features)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias

    def _amx(self, x: torch.Tensor) -> torch.Tensor:
        """The large-batch side of an `amx_large_rows` layer: bf16 products on the matrix
        units from the packed blocks (int4: 0 activation planes; both formats round x to
        bf16, as the dense copy's GEMM would take it)."""
        xk = x if x.dtype in (torch.float32, torch.bfloat16) else x.to(self.kernel_dtype)
        xk = xk.reshape(-1, self.in_features)
        if self.format == "q8_0":
            y = torch.ops.pagemill_native.gemm_q8_amx(
                xk, self.qweight, self.out_features, self.amx_bf16_scales
            )
        else:
            y = torch.ops.pagemill_native.gemm_q4_amx(xk, self.qweight, self.out_features, 0)
        y = y.view(*x.shape[:-1], self.out_features)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias

    # ---- a gated MLP's gate | up layer with its activation ------------------------------------

    def act_and_mul_forward(self, x: torch.Tensor, act: str) -> torch.Tensor:
        """act(gate) * up of this gate | up layer's output (gate rows first), x [T, in] ->
        [T, out / 2]; `act` "silu" or "gelu_tanh" (`ACT_AND_MUL`).

        Above `packed_max_tokens` rows an `amx_large_rows` layer applies silu in the AMX
        product's epilogue (`gemm_q4_amx_silu_mul`): the gate | up output never reaches
        memory, and the graph loses its elementwise loop over it. Everywhere else (fewer
        rows, other formats, an adapter or a bias to add first, another activation) it is
        the unfused `act_and_mul(self(x))`. The row-count branch is `_forward`'s."""
        unfused = ACT_AND_MUL[act]
        if not self._fuses_silu_mul(x, act):
            return unfused(self(x))
        if self.compiled_branch == "cond" and torch.compiler.is_compiling():
            return torch.cond(
                x.shape[0] > self.packed_max_tokens,
                self._amx_silu_mul,
                self._packed_silu_mul,
                (x,),
            )
        if x.shape[0] > self.packed_max_tokens:
            return self._amx_silu_mul(x)
        return self._packed_silu_mul(x)

    def _fuses_silu_mul(self, x: torch.Tensor, act: str) -> bool:
        return (
            act == "silu"
            and self.amx_large_rows
            and self.lora is None
            and self.bias is None
            and x.dtype in (torch.float32, torch.bfloat16)
            and gemv_q4_cpu.silu_mul_fusable(self.out_features)
        )

    def _packed_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(self._packed(x))

    def _amx_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """`_amx` and silu_and_mul in one kernel: g and u rounded to x's dtype as `_amx`
        would store them, the activation and the product in fp32, rounded once (a compiled
        graph's fused loop; eager torch rounds silu(g) before the product too)."""
        half = self.out_features // 2
        y = torch.ops.pagemill_native.gemm_q4_amx_silu_mul(
            x.reshape(-1, self.in_features), self.qweight, self.out_features
        )
        return y.view(*x.shape[:-1], half)

    def _gemv_q8(self, x: torch.Tensor) -> torch.Tensor:
        xk = x if x.dtype in (torch.float32, torch.bfloat16) else x.to(self.kernel_dtype)
        xk = xk.reshape(-1, self.in_features)
        if self.native_gemv:
            y = torch.ops.pagemill_native.gemv_q8(
                xk, self._kernel_qweight(), self.out_features, self.int8_act
            )
        elif torch.compiler.is_compiling():
            y = torch.ops.pagemill.gemv_q8(
                xk, self._kernel_qweight(), self.out_features, self.int8_act
            )
        else:  # eager (the LM head runs outside the compiled forward): skip the dispatcher
            assert self.qweight is not None
            y = gemv_q8_cpu.gemv_q8(xk, self.qweight, self.out_features, planes=self.int8_act)
        y = y.view(*x.shape[:-1], self.out_features)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias


# The activations `Linear.act_and_mul_forward` takes, by name, with their unfused form.
ACT_AND_MUL = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}


def packed_row_limits(model: nn.Module) -> list[int]:
    """The row counts above which some layer of `model` leaves its packed kernel for its
    dense copy. A compiled forward has a graph for each side of each limit ("guard"
    branching), so a start-up warm-up should run one step longer than each limit too —
    otherwise the first long prefill chunk compiles while a request waits."""
    return sorted(
        {
            m.packed_max_tokens
            for name, m in model.named_modules()
            if isinstance(m, Linear) and m.has_dense_fallback and not name.startswith("logits_proj")
        }
    )  # the LM head runs outside forward()


@torch.library.custom_op("pagemill::weight_int4pack_mm", mutates_args=())
def _opaque_int4pack_mm(
    x: torch.Tensor, qweight: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor
) -> torch.Tensor:
    """PyTorch's int4 CPU kernel, opaque to inductor (see `Linear.opaque_packed`)."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, qweight, group_size, scales_and_zeros)


@_opaque_int4pack_mm.register_fake
def _(
    x: torch.Tensor, qweight: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor
) -> torch.Tensor:
    return x.new_empty(x.shape[0], scales_and_zeros.shape[1])


@torch.library.custom_op("pagemill::weight_int8pack_mm", mutates_args=())
def _opaque_int8pack_mm(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """PyTorch's int8 CPU kernel, opaque to inductor (see `Linear.opaque_packed`)."""
    return torch.ops.aten._weight_int8pack_mm(x, qweight, scales)


@_opaque_int8pack_mm.register_fake
def _(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], qweight.shape[0])
