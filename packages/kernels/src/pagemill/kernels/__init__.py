"""pagemill.kernels: paged attention, KV cache writes and the Llama fused ops.

Every op is one public name that dispatches on the tensors' device (CUDA → Triton kernel,
anything else → torch path), plus ``<op>_torch`` and ``<op>_triton`` with the same
signature for callers and tests that want one explicitly. Attention also has a per-step
plan (`plan_attention`) that every layer's call reuses.
"""

from pagemill.kernels.activation import (
    gelu_tanh_and_mul,
    silu_and_mul,
    silu_and_mul_torch,
    silu_and_mul_triton,
)
from pagemill.kernels.attention import (
    AttentionPlan,
    paged_attention,
    paged_attention_torch,
    paged_attention_triton,
    plan_attention,
)
from pagemill.kernels.gemv_q4_cpu import gemv_q4, gemv_q4_torch, pack_q4_blocks
from pagemill.kernels.int4_gemm import (
    int4_group_gemm,
    int4_group_gemm_torch,
    int4_group_gemm_triton,
    pack_int4_groups,
)
from pagemill.kernels.kv_cache import write_kv_cache, write_kv_cache_torch, write_kv_cache_triton
from pagemill.kernels.lora import (
    add_lora,
    add_lora_torch,
    add_lora_triton,
    lora_segments,
    lora_token_runs,
)
from pagemill.kernels.moe import (
    fused_moe,
    fused_moe_int4_cpu,
    fused_moe_torch,
    fused_moe_triton,
    moe_align_block_size,
    swigluoai_and_mul,
    topk_softmax,
    topk_then_softmax,
)
from pagemill.kernels.rms_norm import rms_norm, rms_norm_torch, rms_norm_triton
from pagemill.kernels.rotary import (
    apply_rotary,
    apply_rotary_torch,
    apply_rotary_triton,
    rope_cos_sin,
)

__version__ = "0.3.0"

__all__ = [
    "AttentionPlan",
    "__version__",
    "add_lora",
    "add_lora_torch",
    "add_lora_triton",
    "apply_rotary",
    "apply_rotary_torch",
    "apply_rotary_triton",
    "fused_moe",
    "fused_moe_int4_cpu",
    "fused_moe_torch",
    "fused_moe_triton",
    "gelu_tanh_and_mul",
    "gemv_q4",
    "gemv_q4_torch",
    "int4_group_gemm",
    "int4_group_gemm_torch",
    "int4_group_gemm_triton",
    "lora_segments",
    "lora_token_runs",
    "moe_align_block_size",
    "pack_int4_groups",
    "pack_q4_blocks",
    "paged_attention",
    "paged_attention_torch",
    "paged_attention_triton",
    "plan_attention",
    "rms_norm",
    "rms_norm_torch",
    "rms_norm_triton",
    "rope_cos_sin",
    "silu_and_mul",
    "silu_and_mul_torch",
    "silu_and_mul_triton",
    "swigluoai_and_mul",
    "topk_softmax",
    "topk_then_softmax",
    "write_kv_cache",
    "write_kv_cache_torch",
    "write_kv_cache_triton",
]
