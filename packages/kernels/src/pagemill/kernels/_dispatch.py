"""Choosing between the Triton kernel and the torch path of an op.

The engine serves on CUDA and on CPU from the same model code, so every op is called
through one name and picks its implementation from where the tensors live. Triton only
compiles for CUDA devices; on any other device the torch path is the backend. Under
``TRITON_INTERPRET=1`` the Triton kernels also run on CPU tensors, which is how the tests
exercise them without a GPU — but only when called by their ``*_triton`` name.
"""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """Whether Triton kernels run in the NumPy interpreter (set before import, read by jit)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda


def next_pow2(n: int) -> int:
    """Smallest power of two >= n, since ``tl.arange`` extents must be powers of two."""
    return 1 << max(0, (int(n) - 1).bit_length())


def check_triton_device(*tensors: torch.Tensor) -> None:
    """Refuse CPU tensors outside the interpreter: a compiled kernel would read host memory."""
    if interpreting():
        return
    for t in tensors:
        if not t.is_cuda:
            raise ValueError(
                "Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before import); "
                f"got a tensor on {t.device}"
            )
