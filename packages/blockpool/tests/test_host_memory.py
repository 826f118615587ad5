from __future__ import annotations

import sys

import numpy as np
import pytest

from pagemill.blockpool import host_memory
from pagemill.blockpool.host_memory import (
    huge_page_bytes,
    huge_page_size,
    huge_page_zeros,
    thp_policy,
    zeros_mapping,
)

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux mappings")


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 3 << 20])
def test_huge_page_zeros_are_aligned_zeros_of_the_size_asked(nbytes: int) -> None:
    a, _ = huge_page_zeros(nbytes)
    assert a.dtype == np.uint8 and a.shape == (nbytes,)
    assert a.ctypes.data % huge_page_size() == 0 or nbytes == 0
    assert not a.any()
    if nbytes:
        a[-1] = 7  # writable, and the last byte is inside the mapping
        assert a[-1] == 7


@pytest.mark.parametrize("nbytes", [0, 1, 5000])
def test_zeros_mapping_is_zeros_of_the_size_asked(nbytes: int) -> None:
    a = zeros_mapping(nbytes)
    assert a.dtype == np.uint8 and a.shape == (nbytes,) and not a.any()
    if nbytes:
        assert a.ctypes.data % 4096 == 0


@linux_only
@pytest.mark.skipif(thp_policy() in (None, "never"), reason="no transparent huge pages here")
def test_written_huge_page_zeros_are_backed_by_huge_pages() -> None:
    """Once written, most of an advised mapping is on huge pages (all of it on a machine
    with memory to spare; the kernel may give fewer when memory is fragmented)."""
    a, advised = huge_page_zeros(8 << 20)
    assert advised
    a[:] = 1
    assert huge_page_bytes([a]) >= (8 << 20) // 2
    assert huge_page_bytes([a, a[: 1 << 20]]) == huge_page_bytes([a])  # a mapping counts once


@linux_only
def test_refused_advice_still_gives_usable_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_memory, "libc_madvise", lambda: lambda addr, n, advice: -1)
    a, advised = huge_page_zeros(3 << 20)
    assert not advised
    a[:] = 3
    assert int(a.sum()) == 3 * (3 << 20)
    monkeypatch.setattr(host_memory, "libc_madvise", lambda: None)  # no libc madvise at all
    b, advised = huge_page_zeros(100)
    assert not advised and b.shape == (100,)


def test_thp_policy_is_one_of_the_kernels_words() -> None:
    assert thp_policy() in (None, "always", "madvise", "never")


def test_huge_page_bytes_of_unmapped_or_empty_arrays_is_zero() -> None:
    assert huge_page_bytes([]) == 0
    assert huge_page_bytes([np.zeros(0, dtype=np.uint8)]) == 0
