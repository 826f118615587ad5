"""What each linear layer is served as, decided before any weight loads.

A `WeightScheme` tells a `Linear` what to turn its loaded rows into:

- "dense": a plain weight in the compute dtype (quantized rows are dequantized);
- "native": keep what the checkpoint holds — dense rows stay dense, GGUF int4 rows
  (Q4_0/Q4_1/Q4_K) become the int4 kernel's format and int8 rows (Q8_0, Q5_x, Q3_K, IQ4,
  requantized Q6_K) its two-plane int4 form (see `gguf_blocks`);
- "int8": int8 per output channel (PyTorch's `_weight_int8pack_mm`);
- "int4": int4 groups with zero points (`_weight_int4pack_mm_for_cpu`); GGUF rows already
  in that form (Q4_0/Q4_1, same group size) are kept exactly, anything else is quantized.
- "triton_int4" (CUDA): int4-group rows (GGUF Q4_0/Q4_1/Q4_K, AWQ, GPTQ, w4a16) stay packed
  for the kernels' Triton dequant-GEMM (`int4_group_gemm`); any other rows are dequantized.

`dense_fallback` keeps, next to the packed weight, a dense copy of the same (dequantized)
values for steps with many tokens: the packed CPU kernels read 2-4x fewer bytes, which wins
while a step streams weights (few tokens), but they compute 2-3x slower than a bf16 GEMM
once a step is compute-bound (prefill, large decode batches). It pays only where bf16 GEMMs
are native (AVX512-BF16 / AMX), so it is on by default only for bf16 on such a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

METHODS = ("dense", "native", "int8", "int4", "triton_int4")
DEFAULT_GROUP_SIZE = 32

# Tokens in a step up to which the packed kernel beats a dense bf16 GEMM, per served format:
# measured on SmolLM2-135M decode steps (model forward + LM head, compiled with freezing, so
# the dense side is oneDNN's prepacked GEMM; eager crosses over at about the same counts) on
# a 2-core Zen 4 with AVX512-BF16. Step ms, dense vs packed: int4 12 rows 37 vs 31,
# 16 rows 41 vs 40, 24 rows 49 vs 54; int8 4 rows 29 vs 19, 8 rows 34 vs 33, 12 rows 37 vs 38.
PACKED_MAX_TOKENS = {"int4": 16, "int8": 8, "int4x2": 8}
# The LM head (49152 x 576 for SmolLM2) crosses over earlier: at 4 rows int4x2 2.8 ms,
# int8 3.0, dense bf16 3.7; at 6 rows 5.6 / 5.0 / 4.1.
LM_HEAD_PACKED_MAX_TOKENS = 4


@dataclass(frozen=True)
class WeightScheme:
    method: str = "dense"
    group_size: int = DEFAULT_GROUP_SIZE
    dense_fallback: bool = False
    # Overrides PACKED_MAX_TOKENS for this layer (None: the table's value for its format).
    packed_max_tokens: int | None = None
    # Whether the limit may be measured on this machine instead, after loading
    # (`crossover.measure_packed_limits`); False when the caller fixed it.
    measure_packed_limit: bool = False
    # The dtype the packed kernels compute in (activations and scales; None: bf16). PyTorch's
    # int8/int4 CPU kernels are vectorized for bf16 only: with fp32 activations they run
    # 3x (1 row) to 40x (64 rows) slower than a dense fp32 GEMM, with fp16 slower still. So
    # an fp32 model's packed layers cast their input to bf16 and their output back; fp32
    # kernels are exact (GGUF rows bit for bit) and are kept for checks.
    kernel_dtype: torch.dtype | None = None
    # The dense copy was asked for (`--cpu-dense-weights always`): kept even where AMX would
    # run large batches from the packed blocks without one (`Linear.amx_packed`).
    keep_dense_copy: bool = False

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown weight scheme {self.method!r}; expected one of {METHODS}")


DENSE = WeightScheme()
KERNEL_DTYPE = torch.bfloat16


def default_dense_fallback(dtype: torch.dtype, device: torch.device) -> bool:
    """A dense copy pays where its GEMMs are native: fp32 on every CPU, bf16 where the CPU
    has bf16 arithmetic."""
    if device.type != "cpu":
        return False
    if dtype == torch.float32:
        return True
    if dtype != torch.bfloat16:
        return False
    from pagemill.runtime.worker.cpu_features import cpu_has_native_bf16

    return cpu_has_native_bf16()
