"""The KV cache memory itself: per-layer K and V arrays of shape
[num_blocks, block_size, num_kv_heads, head_dim].

Arrays are CuPy on a CUDA device and NumPy otherwise, and both export DLPack, so the
runtime wraps them with `torch.from_dlpack` without a copy and without this package ever
importing torch. bfloat16 has no NumPy dtype: it is stored in uint16 containers holding the
raw bf16 bits, and the torch side reinterprets with `.view(torch.bfloat16)`. float8 formats
are likewise stored as uint8 containers.

On the CPU every array is a view of one anonymous memory mapping (`mapping`), each starting
on a page of its own: zero pages the kernel fills in on first write, like `calloc`, so an
idle pool costs no memory. A page's first write,
though, is a page fault that costs far more than the write; without `prefault` those
faults land inside the first steps that reach each block (a 2,048-token prefill then
spends most of its KV write time faulting). `prefault` maps every page writable up front
without touching its contents (Linux `MADV_POPULATE_WRITE`), so it is safe while the pool
is in use.

`huge_pages` asks the kernel for transparent huge pages on the CPU mapping (`MADV_HUGEPAGE`,
before anything populates it; the mapping is laid out on whole, aligned huge pages, and each
array starts on one). A block (a few KB) then never straddles a 4 KB page boundary, which is where
the CPU's hardware prefetchers stop, and the decode kernel's scattered block reads miss the
TLB far less. Populating huge pages costs more up front (the kernel may compact memory to
find them), which `prefault` pays in its background thread. Where the kernel has no THP the
advice is refused, and under the policy "never" it is taken and has no effect: either way
the pool is ordinary 4 KB pages.
"""

from __future__ import annotations

import mmap
import sys
import threading
from typing import Any

import numpy as np

from pagemill.blockpool.host_memory import (
    MADV_NOHUGEPAGE,
    MADV_POPULATE_WRITE,
    huge_page_size,
    huge_page_zeros,
    libc_madvise,
    zeros_mapping,
)
from pagemill.blockpool.sizing import canonical_dtype

# Element type actually allocated for each logical KV dtype.
_CONTAINER: dict[str, str] = {
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "uint16",
    "float8_e4m3fn": "uint8",
    "float8_e5m2": "uint8",
    "int8": "int8",
    "uint8": "uint8",
}


def _cupy_if_available() -> Any | None:
    """CuPy module when it is installed and sees a CUDA device, else None."""
    try:
        import cupy
    except Exception:  # not installed, or a broken CUDA install: fall back to NumPy
        return None
    try:
        return cupy if cupy.is_available() else None
    except Exception:
        return None


def _parse_device(device: str) -> tuple[str, int]:
    name = str(device).lower()
    if name in ("auto", "cpu", "cuda"):
        return name, 0
    if name.startswith("cuda:") and name[5:].isdigit():
        return "cuda", int(name[5:])
    raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")


class KVStorage:
    """Zero-initialized K and V caches for every layer, on the GPU when there is one."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str = "float16",
        device: str = "auto",
        huge_pages: bool = False,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.dtype = canonical_dtype(dtype)
        self.container_dtype = _CONTAINER[self.dtype]
        kind, index = _parse_device(device)
        xp: Any = np
        if kind in ("auto", "cuda"):
            cupy = _cupy_if_available()
            if cupy is not None:
                xp = cupy
            elif kind == "cuda":
                raise RuntimeError(
                    "device='cuda' needs CuPy and a CUDA device; install "
                    "pagemill-blockpool[cuda12] or [cuda13], or use device='cpu'"
                )
        self.backend: str = "cupy" if xp is not np else "numpy"
        self.device_index: int | None = index if self.backend == "cupy" else None
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.shape: tuple[int, int, int, int] = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_caches: list[Any] = []
        self.v_caches: list[Any] = []
        # A CPU pool's one mapping (uint8) that every K and V array is a view of (None on
        # CuPy): an embedder can view it once and slice each layer's arrays from it, e.g.
        # so that a compiled graph takes one input for all of them instead of one each.
        self.mapping: np.ndarray | None = None
        self._prefault_thread: threading.Thread | None = None
        self.prefaulted = False
        # Whether every CPU mapping took the huge-page advice (False on CuPy).
        self.huge_pages = False
        self._want_huge = bool(huge_pages) and sys.platform.startswith("linux")
        self._huge_advised: list[bool] = []
        if self.backend == "cupy":
            with xp.cuda.Device(index):
                self._allocate(xp)
        else:
            self._allocate(xp)
        self.huge_pages = bool(self._huge_advised) and all(self._huge_advised)
        self.nbytes: int = sum(int(a.nbytes) for a in self.k_caches + self.v_caches)

    def _allocate(self, xp: Any) -> None:
        if xp is not np:
            for _ in range(self.num_layers):
                self.k_caches.append(xp.zeros(self.shape, dtype=self.container_dtype))
                self.v_caches.append(xp.zeros(self.shape, dtype=self.container_dtype))
            return
        dtype = np.dtype(self.container_dtype)
        nbytes = int(np.prod(self.shape)) * dtype.itemsize
        # One mapping, each array starting on a page of its own (a huge page with huge
        # pages: `keep_small_pages` advises whole huge pages of one array); mappings are
        # page-aligned and read as zeros. The arrays keep the mapping alive.
        align = huge_page_size() if self._want_huge else mmap.PAGESIZE
        span = -(-nbytes // align) * align
        total = span * 2 * self.num_layers
        if self._want_huge:
            raw, advised = huge_page_zeros(total)
            self._huge_advised.append(advised)
        else:
            raw = zeros_mapping(total)
        self.mapping = raw
        for i in range(self.num_layers):
            for j, arrays in enumerate((self.k_caches, self.v_caches)):
                start = (2 * i + j) * span
                arrays.append(raw[start : start + nbytes].view(dtype).reshape(self.shape))

    def prefault(self, background: bool = True, gate: threading.Event | None = None) -> bool:
        """Map every page of a CPU pool writable now, so steps do not pay page faults.

        With `MADV_POPULATE_WRITE` (Linux 5.14+) the contents are left alone, so it may run
        in a background thread while the pool is used (`background`; `wait_prefaulted`
        joins it). Where the kernel lacks it, each page is written with a zero instead:
        done at once, and only correct while the pool holds nothing yet (as at start-up).
        Returns False for a CuPy pool (its memory is committed at allocation).

        `gate`: the background thread maps the next few MB only while it is set (an engine
        sets it while idle). Populating pages, huge ones above all, slows everything else
        the machine runs (in a small VM a 1 GiB pool took seconds, and the first requests
        after a start waited for it), while a step that meets an unmapped page pays for
        that page alone."""
        if self.backend != "numpy":
            return False
        if not background:
            gate = None  # mapping now, whatever the engine is doing
        arrays = self.k_caches + self.v_caches
        madvise = libc_madvise()
        if madvise is not None and madvise(0, 0, MADV_POPULATE_WRITE) == 0:
            page = mmap.PAGESIZE

            def populate() -> None:
                if background:
                    _lowest_priority()
                for a in arrays:
                    start = a.ctypes.data // page * page
                    end = a.ctypes.data + a.nbytes
                    refused = False
                    # A chunk per call: the kernel holds the process's memory-map lock for
                    # a whole call, and every mmap / munmap of the serving threads (torch's
                    # large allocations) waits for it; one call per array held a warm
                    # start's first request back for seconds.
                    for lo in range(start, end, _PREFAULT_CHUNK):
                        if gate is not None:
                            gate.wait()
                        n = min(_PREFAULT_CHUNK, end - lo)
                        if madvise(lo, n, MADV_POPULATE_WRITE) != 0:
                            refused = True
                            break
                    if refused and not background:
                        # Writing zeros is only safe before the pool is used: in the
                        # background, a refused range just faults in on demand.
                        _touch(a)
                self.prefaulted = True

            if background:
                self._prefault_thread = threading.Thread(
                    target=populate, name="kv-prefault", daemon=True
                )
                self._prefault_thread.start()
            else:
                populate()
            return True
        for a in arrays:
            _touch(a)
        self.prefaulted = True
        return True

    def keep_small_pages(self, first_block: int, num_blocks: int) -> bool:
        """Keep the huge pages holding blocks [first_block, first_block + num_blocks) of
        every layer's K and V on 4 KB pages instead (`MADV_NOHUGEPAGE`); whether the kernel
        took the advice everywhere (False for a pool without huge pages: nothing to do).

        For the few blocks an engine writes before the pool is prefaulted (its compile
        warm-up): a huge page's first touch can cost far more than the 4 KB pages a write
        needs. In a VM whose host takes freed huge pages back (free page reporting), every
        huge page is backed anew on its first touch, while freed 4 KB pages are reused
        warm; a warm-up that writes a block per layer touches a huge page in every K and V
        array. Only pages not yet populated change; the rest of the pool keeps its huge
        pages (the decode kernel's reason for them)."""
        if not self.huge_pages or num_blocks <= 0:
            return False
        if not 0 <= first_block < self.num_blocks:
            raise ValueError(f"first_block {first_block} is not a block of {self.num_blocks}")
        madvise = libc_madvise()
        if madvise is None:
            return False
        huge = huge_page_size()
        last = min(first_block + num_blocks, self.num_blocks)
        took = True
        for a in self.k_caches + self.v_caches:
            block_bytes = a.nbytes // self.num_blocks
            # The arrays start on a huge-page boundary (`huge_page_zeros`): whole huge pages
            # around the range, so no huge page is left half advised.
            lo = a.ctypes.data + first_block * block_bytes // huge * huge
            hi = a.ctypes.data + -(-last * block_bytes // huge) * huge
            took = madvise(lo, hi - lo, MADV_NOHUGEPAGE) == 0 and took
        return took

    def wait_prefaulted(self) -> None:
        if self._prefault_thread is not None:
            self._prefault_thread.join()

    def __repr__(self) -> str:
        return (
            f"KVStorage(layers={self.num_layers}, shape={self.shape}, dtype={self.dtype}, "
            f"backend={self.backend}, nbytes={self.nbytes}, huge_pages={self.huge_pages})"
        )


def _touch(array: Any) -> None:
    """Write a zero into every page of a zero-filled array (faults them in)."""
    flat = array.reshape(-1).view(np.uint8)
    flat[:: mmap.PAGESIZE] = 0


# Bytes populated per madvise call in the background (two 2 MB huge pages): small enough
# that the memory-map lock is free again within milliseconds.
_PREFAULT_CHUNK = 4 << 20


def _lowest_priority() -> None:
    """Give the calling thread the lowest CPU priority (Linux: per thread), so the
    background prefault takes the cores only when the serving threads leave them idle."""
    try:
        import os

        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass
