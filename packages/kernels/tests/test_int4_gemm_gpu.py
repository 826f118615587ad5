"""The compiled int4-group GEMM on a real GPU against its torch path (skipped without CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

from pagemill.kernels import int4_group_gemm, int4_group_gemm_torch, pack_int4_groups

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        reason="needs a CUDA device and compiled (not interpreted) Triton",
    ),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize(("k", "n", "g"), [(4096, 6144, 128), (1536, 576, 32), (576, 1000, 64)])
def test_int4_group_gemm(dtype, m, k, n, g):
    gen = torch.Generator().manual_seed(m)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, k // g, generator=gen) * 0.02 + 0.001
    zeros = torch.randn(n, k // g, generator=gen) * 0.01
    qweight, s, z = (t.cuda() for t in pack_int4_groups(q, scales, zeros, dtype))
    x = torch.randn(m, k, generator=gen).to(dtype).cuda()
    got = int4_group_gemm(x, qweight, s, z, g)  # CUDA: the Triton kernel
    want = int4_group_gemm_torch(x, qweight, s, z, g)
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert err < (1e-2 if dtype == torch.bfloat16 else 2e-3), err
