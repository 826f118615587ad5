"""The compiled LoRA shrink/expand on a real GPU against the torch path (skipped without CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

from pagemill.kernels import add_lora, add_lora_torch, lora_segments

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        reason="needs a CUDA device and compiled (not interpreted) Triton",
    ),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t", [1, 7, 64, 300])
@pytest.mark.parametrize(
    ("k", "slices", "r"), [(4096, (4096, 1024, 1024), 16), (576, (1536, 1536), 64)]
)
def test_add_lora(dtype, t, k, slices, r):
    gen = torch.Generator().manual_seed(t)
    num_slots = 4
    out = sum(slices)
    x = torch.randn(t, k, generator=gen).to(dtype)
    y = torch.randn(t, out, generator=gen).to(dtype)
    a = (torch.randn(num_slots, len(slices) * r, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(num_slots, out, len(slices) * r, generator=gen) / r**0.5
    row = 0
    for j, n in enumerate(slices):  # block-diagonal, as the layout requires
        b[:, row : row + n, : j * r] = 0
        b[:, row : row + n, (j + 1) * r :] = 0
        row += n
    b = b.to(dtype)
    slots = torch.randint(-1, num_slots, (t,), generator=gen)
    starts = torch.tensor([0, *torch.tensor(slices).cumsum(0).tolist()], dtype=torch.int32)
    sorted_ids, seg = lora_segments(slots, num_slots)
    want = y.clone()
    add_lora_torch(want, x, a, b, sorted_ids, seg, starts)
    got = y.cuda()
    add_lora(got, x.cuda(), a.cuda(), b.cuda(), sorted_ids.cuda(), seg.cuda(), starts.cuda())
    err = ((got.cpu().double() - want.double()).norm() / want.double().norm()).item()
    assert err < (1e-2 if dtype != torch.float32 else 1e-4), err
