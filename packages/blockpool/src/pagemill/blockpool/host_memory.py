"""Host memory laid out for huge pages: anonymous mappings aligned to the transparent huge
page size, with `MADV_HUGEPAGE` asked before anything populates them.

A CPU kernel that streams a large array (a decode step's KV blocks, a batch-1 step's packed
weights) reads it a cache line at a time, but the TLB and the hardware prefetchers work in
pages: on 4 KB pages the prefetchers stop at every page boundary and the TLB misses every
64 lines, while one 2 MB page covers 512 such pages. The malloc that backs torch and
NumPy allocations returns 4 KB pages under the kernel's default THP policy ("madvise"), so
arrays that are read end to end every step are worth a mapping of their own.

Where the kernel has no THP the advice is refused, and under its policy "never" it is taken
and has no effect: either way the memory is ordinary 4 KB pages, as zeros, lazily committed
(`calloc`-like), and still correct. Depends on NumPy only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
from typing import Any

import numpy as np

# <linux/mman.h>; the mmap module exposes them only where Python was built against a kernel
# header that has them.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
MADV_NOHUGEPAGE = getattr(mmap, "MADV_NOHUGEPAGE", 15)


def huge_page_size() -> int:
    """The transparent huge page size (the PMD size: 2 MiB on x86-64)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20


def thp_policy() -> str | None:
    """The kernel's transparent huge page policy ("always", "madvise" or "never"), or None
    where it has none to read."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def libc_madvise() -> Any | None:
    """libc's madvise through ctypes (which lets other threads run during the call), or
    None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _private() -> dict[str, int]:
    # MAP_SHARED, mmap's default on Unix, would make the memory shared with children.
    return {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}


def zeros_mapping(nbytes: int) -> np.ndarray:
    """`nbytes` zero bytes (uint8) in an anonymous mapping of their own, on 4 KB pages."""
    return np.frombuffer(mmap.mmap(-1, max(int(nbytes), 1), **_private()), dtype=np.uint8)[
        : int(nbytes)
    ]


def huge_page_zeros(nbytes: int) -> tuple[np.ndarray, bool]:
    """`nbytes` zero bytes (uint8) starting on a huge-page boundary, advised `MADV_HUGEPAGE`;
    and whether the kernel took the advice.

    One spare huge page of address space finds the boundary and the end is rounded up to a
    whole huge page, so every page of the array can be huge; the spare part is never
    touched and costs no memory. The array owns the mapping (it lives as long as the array
    or any view of it)."""
    huge = huge_page_size()
    length = -(-max(int(nbytes), 1) // huge) * huge + huge
    buf = mmap.mmap(-1, length, **_private())
    base = np.frombuffer(buf, dtype=np.uint8, count=1).ctypes.data
    offset = -base % huge
    madvise = libc_madvise()
    advised = madvise is not None and madvise(base + offset, length - huge, MADV_HUGEPAGE) == 0
    return np.frombuffer(buf, dtype=np.uint8, count=int(nbytes), offset=offset), advised


def huge_page_bytes(arrays: list[np.ndarray]) -> int:
    """How many bytes of the mappings holding `arrays` are on huge pages now (the kernel's
    `AnonHugePages` in /proc/self/smaps; 0 where it cannot be read). Whole mappings are
    counted, so a mapping shared by several arrays counts once."""
    ranges = [(a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays if a.nbytes]
    total = 0
    lo = hi = 0
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0] if line.strip() else ""
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                elif head == "AnonHugePages:" and any(lo < b and a < hi for a, b in ranges):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return 0
    return total
