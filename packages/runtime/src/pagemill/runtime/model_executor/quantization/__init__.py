"""Weight-only quantization on CPU: int8 per channel, int4 groups with zero points.

PyTorch's packed CPU kernels do the work (`aten._weight_int8pack_mm`,
`aten._weight_int4pack_mm_for_cpu`); `pagemill.runtime.model_executor.layers.Linear` holds the
packed weights and picks, per step, the packed kernel (few tokens: the step streams weights) or
a dense copy (many tokens: the step is compute-bound) when it keeps one. A GGUF's quantized
rows are repacked into these formats (`gguf_blocks`: exactly, except Q6_K/Q2_K, whose
requantization error is measured), and `plan_weights` decides what each layer is served
as before anything loads.
"""

from pagemill.runtime.model_executor.quantization.formats import (
    Int4Groups,
    Int8Blocks,
    QuantizedRows,
    dequantize,
    quantize_int4_groups,
    quantize_int8_per_channel,
)
from pagemill.runtime.model_executor.quantization.gguf_blocks import RequantError
from pagemill.runtime.model_executor.quantization.plan import (
    CPU_DENSE_WEIGHTS,
    WeightPlan,
    choose_dense_copies,
    plan_weights,
)
from pagemill.runtime.model_executor.quantization.report import WeightReport, weight_report
from pagemill.runtime.model_executor.quantization.scheme import (
    DENSE,
    LM_HEAD_PACKED_MAX_TOKENS,
    METHODS,
    PACKED_MAX_TOKENS,
    WeightScheme,
    default_dense_fallback,
)

__all__ = [
    "CPU_DENSE_WEIGHTS",
    "DENSE",
    "LM_HEAD_PACKED_MAX_TOKENS",
    "METHODS",
    "PACKED_MAX_TOKENS",
    "Int4Groups",
    "Int8Blocks",
    "QuantizedRows",
    "RequantError",
    "WeightPlan",
    "WeightReport",
    "WeightScheme",
    "choose_dense_copies",
    "default_dense_fallback",
    "dequantize",
    "plan_weights",
    "quantize_int4_groups",
    "quantize_int8_per_channel",
    "weight_report",
]
