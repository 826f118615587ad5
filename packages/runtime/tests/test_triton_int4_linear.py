"""Int4-group rows served on a GPU through the kernels' Triton dequant-GEMM ("triton_int4").

The plan is checked for a CUDA device without allocating on one; the `Linear` runs on CPU
tensors through the same custom op, either its torch reference path or (under
TRITON_INTERPRET=1) the Triton kernel itself, against `F.linear` on the rows dequantized
by `Int4Groups.dequantize` — the dense weight the GPU served before this method existed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pagemill.kernels.int4_gemm as int4_gemm_module
from pagemill.kernels._dispatch import interpreting
from pagemill.runtime.model_executor.layers import Linear
from pagemill.runtime.model_executor.quantization import (
    Int4Groups,
    Int8Blocks,
    WeightScheme,
    plan_weights,
)
from pagemill.runtime.model_executor.quantization.formats import quantize_int4_groups
from pagemill.runtime.model_executor.quantization.plan import choose_dense_copies

CUDA = torch.device("cuda")
CPU = torch.device("cpu")
TRITON_INT4 = WeightScheme("triton_int4")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_plan_packs_int4_rows_for_triton_on_cuda(dtype: torch.dtype) -> None:
    plan = plan_weights(None, gguf=True, dtype=dtype, device=CUDA)
    assert plan.linear.method == "triton_int4"
    assert plan.lm_head is None  # the head is served dense on a GPU
    # No dense copies on a GPU, whatever --cpu-dense-weights says.
    assert choose_dense_copies(plan, nn.Module(), "always", dtype, CUDA) == (plan, None)


def test_plan_keeps_dense_where_the_gpu_gemm_does_not_apply() -> None:
    assert plan_weights(None, gguf=True, dtype=torch.float32, device=CUDA).linear.method == "dense"
    assert plan_weights(None, gguf=False, dtype=torch.bfloat16, device=CUDA).linear.method == (
        "dense"
    )
    # CPU unchanged: GGUF / quantized checkpoints in bf16 use PyTorch's packed CPU kernels.
    assert plan_weights(None, gguf=True, dtype=torch.bfloat16, device=CPU).linear.method == (
        "native"
    )
    with pytest.raises(ValueError, match="CPU only"):
        plan_weights("int4", gguf=True, dtype=torch.bfloat16, device=CUDA)


def _rows(n: int, k: int, g: int, seed: int) -> Int4Groups:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, k // g, generator=gen) * 0.02 + 0.001
    zeros = torch.randn(n, k // g, generator=gen) * 0.01
    return Int4Groups(q, scales, zeros, g, source="Q4_1")


@pytest.fixture(params=["torch", "triton"])
def gemm_path(request, monkeypatch) -> str:
    """The op's torch path (CPU dispatch) or the Triton kernel in the interpreter."""
    if request.param == "triton":
        if not interpreting():
            pytest.skip("the Triton kernel on CPU tensors needs TRITON_INTERPRET=1")
        monkeypatch.setattr(int4_gemm_module, "use_triton", lambda t: True)
    return request.param


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_matches_the_dense_dequantized_weight(gemm_path: str, dtype: torch.dtype) -> None:
    # A fused projection: two checkpoint tensors at row offsets, groups of 32 and a bias.
    k, g = 96, 32
    top, bottom = _rows(48, k, g, seed=1), _rows(32, k, g, seed=2)
    layer = Linear(k, 80, bias=True, dtype=dtype)
    layer.scheme = TRITON_INT4
    # Small, so y + bias (rounded twice to the dtype) stays within the tolerance of the fp32
    # reference below; a wrong nibble, scale or zero is off by far more.
    assert layer.bias is not None
    layer.bias.copy_(0.1 * torch.randn(80, generator=torch.Generator().manual_seed(7)))
    layer.load_rows(0, top)
    layer.load_rows(48, bottom)
    assert layer.weight_format == "triton_int4" and layer.weight is None
    assert layer.qweight is not None and layer.qweight.dtype == torch.int32
    dense = torch.cat([top.dequantize(torch.float32), bottom.dequantize(torch.float32)]).to(dtype)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    expected = F.linear(x.float(), dense.float(), layer.bias.float())
    got = layer(x)
    assert got.dtype == dtype and got.shape == (5, 80)
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2)
    # A leading batch dimension is flattened and restored.
    torch.testing.assert_close(layer(x.view(1, 5, k)).view(5, 80), got)


def test_other_rows_stay_dense() -> None:
    """Int8 blocks (Q8_0 ...) and rows mixed with dense ones are dequantized on a GPU."""
    k = 64
    gen = torch.Generator().manual_seed(4)
    q8 = Int8Blocks(
        torch.randint(-128, 128, (16, k), generator=gen, dtype=torch.int8),
        torch.rand(16, k // 32, generator=gen) * 0.01,
        32,
    )
    layer = Linear(k, 16, bias=False, dtype=torch.bfloat16)
    layer.scheme = TRITON_INT4
    layer.load_rows(0, q8)
    assert layer.weight_format == "dense"
    assert layer.weight is not None
    assert torch.equal(layer.weight, q8.dequantize(torch.float32).to(torch.bfloat16))

    mixed = Linear(k, 32, bias=False, dtype=torch.bfloat16)
    mixed.scheme = TRITON_INT4
    rows = _rows(16, k, 32, seed=5)
    mixed.load_rows(0, rows)
    mixed.load_rows(16, torch.zeros(16, k))
    assert mixed.weight_format == "dense"
    assert mixed.weight is not None
    assert torch.equal(mixed.weight[:16], rows.dequantize(torch.float32).to(torch.bfloat16))


def test_compiled_graph_holds_the_gemm_as_one_op() -> None:
    """fullgraph: the op neither breaks the graph nor is traced into (its fake impl runs)."""
    k = 64
    w = torch.randn(32, k, generator=torch.Generator().manual_seed(6))
    layer = Linear(k, 32, bias=False, dtype=torch.bfloat16)
    layer.scheme = TRITON_INT4
    layer.load_rows(0, quantize_int4_groups(w, 32, torch.float32))
    x = torch.randn(3, k).to(torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), layer(x))
