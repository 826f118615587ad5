"""The native CPU kernel of batched LoRA, built on the host at first use.

`csrc/lora_cpu.cpp` adds every adapter token's delta for one projection in one call: tasks
of up to 8 tokens of one slot, read and written in place through the step's ``sorted_ids``
(no gather, no run structure needed), shrink and expand in fp32 registers over B's
non-zero blocks only, split over OpenMP threads. Built and cached as the paged decode
kernel is (`pagemill.kernels.cpu_native`: same compiler, flags, cache folder and the
``PAGEMILL_NATIVE_CPU_KERNELS=0`` switch); without a compiler, or if the build fails,
`load()` returns None and `add_lora` keeps the torch path (one warning).

It serves fp32 adapter stacks (what the runtime keeps on CPU) with B stored transposed:
``lora_b`` a [L, out, S*R] view of a contiguous [L, S*R, out] tensor, so the expand reads
B's rows along the output (`supports`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from pagemill.kernels.cpu_native import build_library

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "lora_cpu.cpp"
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# False: `add_lora` keeps the torch path even where the kernel is built (an A/B switch for
# benchmarks/lora.py; read at every call, so a compiled graph follows it).
use_native = True


@functools.cache
def load() -> ctypes.CDLL | None:
    """The built kernel library, or None when it cannot be built here (see the log)."""
    lib = build_library(_SOURCE, "the CPU LoRA kernel", "using the torch path")
    if lib is None:
        return None
    fn = lib.pagemill_add_lora
    fn.restype = ctypes.c_int
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    fn.argtypes = [i32, ptr, i64, i32, ptr, i64, ptr, ptr, ptr, ptr, i32, ptr, i32, i32]
    fn.argtypes += [i64, i64, i64, i32]
    return lib


def supports(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    sorted_ids: torch.Tensor,
    seg_starts: torch.Tensor,
    slice_starts: torch.Tensor,
) -> bool:
    """Whether the native kernel serves these operands (see the module's docstring)."""
    b_t = lora_b.transpose(1, 2)
    return (
        x.device.type == "cpu"
        and x.dtype in _DTYPE_CODES
        and y.dtype in _DTYPE_CODES
        and lora_a.dtype == torch.float32
        and lora_b.dtype == torch.float32
        and lora_a.is_contiguous()
        and b_t.is_contiguous()
        and x.stride(1) == 1
        and y.stride(1) == 1
        and all(
            t.dtype == torch.int32 and t.is_contiguous()
            for t in (sorted_ids, seg_starts, slice_starts)
        )
    )


def add_lora_native(
    lib: ctypes.CDLL,
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    sorted_ids: torch.Tensor,
    seg_starts: torch.Tensor,
    slice_starts: torch.Tensor,
    num_slices: int,
    rank: int,
) -> None:
    """`add_lora_torch`'s contract in one native call (operands `supports` accepted)."""
    status = lib.pagemill_add_lora(
        _DTYPE_CODES[x.dtype],
        x.data_ptr(),
        x.stride(0),
        _DTYPE_CODES[y.dtype],
        y.data_ptr(),
        y.stride(0),
        lora_a.data_ptr(),
        lora_b.data_ptr(),
        sorted_ids.data_ptr(),
        seg_starts.data_ptr(),
        lora_a.shape[0],
        slice_starts.data_ptr(),
        num_slices,
        rank,
        x.shape[1],
        y.shape[1],
        x.shape[0],
        torch.get_num_threads(),
    )
    if status:
        raise RuntimeError(f"lora_cpu refused its arguments (status {status})")
