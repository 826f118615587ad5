"""Choosing between the Triton kernel and the torch path of an op.

The engine serves on CUDA and on CPU from the same model code, so every op is called
through one name and picks its implementation from where the tensors live. Triton only
compiles for CUDA devices; on any other device the torch path is the backend, and so it
is on a CUDA device when Triton is not installed (e.g. Windows). Under
``TRITON_INTERPRET=1`` the Triton kernels also run on CPU tensors, which is how the tests
exercise them without a GPU — but only when called by their ``*_triton`` name.

Triton itself is imported lazily (`lazy_kernels`): importing pagemill.kernels never
imports it, so the package imports and runs its torch paths where Triton does not exist.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType
from typing import Any

import torch

_TRITON_AVAILABLE: bool | None = None


def interpreting() -> bool:
    """Whether Triton kernels run in the NumPy interpreter (read by ``@triton.jit`` when the
    kernels are first imported, i.e. at the first Triton call)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available() -> bool:
    """Whether the ``triton`` package can be imported (located, not imported: no cost)."""
    global _TRITON_AVAILABLE
    if _TRITON_AVAILABLE is None:
        try:
            _TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None
        except (ImportError, ValueError):
            _TRITON_AVAILABLE = False
    return _TRITON_AVAILABLE


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and triton_available()


def next_pow2(n: int) -> int:
    """Smallest power of two >= n, since ``tl.arange`` extents must be powers of two."""
    return 1 << max(0, (int(n) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_triton_device(*tensors: torch.Tensor) -> None:
    """Refuse CPU tensors outside the interpreter: a compiled kernel would read host memory."""
    if interpreting():
        return
    for t in tensors:
        if not t.is_cuda:
            raise ValueError(
                "Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before the first "
                f"Triton call); got a tensor on {t.device}"
            )


class LazyKernels:
    """Stands for a module of Triton kernels (`pagemill.kernels._triton.*`) and imports it at
    the first attribute read; after that, reads are plain instance-dict lookups."""

    def __init__(self, module: str) -> None:
        self.__dict__["_module_name"] = module

    def load(self) -> ModuleType:
        name = self.__dict__["_module_name"]
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            if triton_available():
                raise
            raise ImportError(
                "this op's Triton kernel needs the 'triton' package, which is not installed "
                "(it exists for Linux; on other platforms pagemill runs the torch paths: "
                "call the op by its plain name or its *_torch name)"
            ) from exc
        self.__dict__.update(vars(module))
        return module

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.load(), attr)


def lazy_kernels(module: str) -> Any:
    """A `LazyKernels` for ``pagemill.kernels._triton.<module>``."""
    return LazyKernels(f"pagemill.kernels._triton.{module}")
