"""int4-group dequantizing GEMM: the packing and torch path against the dense weight the
groups mean; the Triton kernel (interpreter) against the torch path."""

from __future__ import annotations

import pytest
import torch

from pagemill.kernels import (
    int4_group_gemm,
    int4_group_gemm_torch,
    int4_group_gemm_triton,
    pack_int4_groups,
)


def groups(n: int, k: int, g: int, seed: int = 0):
    """Random int4 groups and the dense [N, K] weight they mean, element by element."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    q[0, :8] = 15  # the top nibble of a word: the packed int32 is negative
    scales = torch.rand(n, k // g, generator=gen) * 0.1 + 0.01
    zeros = torch.randn(n, k // g, generator=gen) * 0.1
    dense = torch.empty(n, k)
    for i in range(n):
        for j in range(k):
            dense[i, j] = (int(q[i, j]) - 8) * scales[i, j // g] + zeros[i, j // g]
    return q, scales, zeros, dense


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_torch_path_is_the_dense_weight(dtype):
    """Packed and multiplied, the groups give x @ W.T with W (rounded to the activation
    dtype, as the kernel rounds it) accumulated in fp32."""
    n, k, g = 24, 64, 32
    q, scales, zeros, _ = groups(n, k, g)
    # Scales and zeros exactly representable in `dtype`: the dense weight is then exact too.
    scales, zeros = scales.to(dtype).float(), zeros.to(dtype).float()
    dense = torch.stack(
        [
            torch.tensor(
                [(int(q[i, j]) - 8) * scales[i, j // g] + zeros[i, j // g] for j in range(k)]
            )
            for i in range(n)
        ]
    )
    qweight, s, z = pack_int4_groups(q, scales, zeros, dtype)
    assert qweight.shape == (k // 8, n) and qweight.dtype == torch.int32
    assert int(qweight[0, 0]) == int(sum(int(q[0, i]) << (4 * i) for i in range(8)) - (1 << 32))
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    want = (x.float() @ dense.to(dtype).float().T).to(dtype)
    assert torch.equal(int4_group_gemm_torch(x, qweight, s, z, g), want)
    assert torch.equal(int4_group_gemm(x, qweight, s, z, g), want)  # CPU: the torch path


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("m", "n", "k", "g"), [(1, 64, 128, 32), (5, 96, 192, 64), (33, 40, 64, 64)]
)
def test_triton_matches_torch(interpreter, dtype, m, n, k, g):
    q, scales, zeros, _ = groups(n, k, g, seed=m)
    qweight, s, z = pack_int4_groups(q, scales, zeros, dtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = int4_group_gemm_triton(x, qweight, s, z, g)
    want = int4_group_gemm_torch(x, qweight, s, z, g)
    assert got.shape == want.shape and got.dtype == dtype
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < 1e-2 if dtype == torch.bfloat16 else err < 2e-3


def test_shapes_are_checked():
    qweight = torch.zeros(8, 16, dtype=torch.int32)
    s = torch.zeros(2, 16)
    with pytest.raises(ValueError, match="does not fit"):
        int4_group_gemm_torch(torch.zeros(1, 32), qweight, s, s, 32)
    with pytest.raises(ValueError, match=r"\[K/g, N\]"):
        int4_group_gemm_torch(torch.zeros(1, 64), qweight, s[:1], s[:1], 32)
    with pytest.raises(ValueError, match="divisible by 8"):
        pack_int4_groups(torch.zeros(4, 12, dtype=torch.uint8), s, s, torch.float16)
