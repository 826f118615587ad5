"""KV storage: shapes and dtypes, the NumPy fallback, and zero-copy DLPack export to torch."""

from __future__ import annotations

import importlib.util
import threading
import time

import numpy as np
import pytest

from pagemill.blockpool import KVStorage, kv_bytes_per_token
from pagemill.blockpool.host_memory import huge_page_bytes, thp_policy

HAS_CUPY_DEVICE = False
if importlib.util.find_spec("cupy") is not None:  # pragma: no cover - only with a CUDA extra
    import cupy

    HAS_CUPY_DEVICE = bool(cupy.is_available())


def test_cpu_storage_layout_and_size() -> None:
    s = KVStorage(
        num_layers=3, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=8, device="cpu"
    )
    assert s.backend == "numpy"
    assert len(s.k_caches) == len(s.v_caches) == 3
    for a in s.k_caches + s.v_caches:
        assert isinstance(a, np.ndarray) and a.shape == (5, 4, 2, 8) and a.dtype == np.float16
        assert not a.any()
    # Every layer is its own buffer.
    s.k_caches[0][0, 0, 0, 0] = 1
    assert s.k_caches[1][0, 0, 0, 0] == 0 and s.v_caches[0][0, 0, 0, 0] == 0
    assert s.nbytes == 5 * 4 * kv_bytes_per_token(3, 2, 8, "float16")


def test_bf16_is_stored_in_uint16_containers() -> None:
    s = KVStorage(1, 2, 4, 1, 8, dtype="bfloat16", device="cpu")
    assert s.dtype == "bfloat16" and s.k_caches[0].dtype == np.uint16
    assert s.nbytes == 2 * 4 * kv_bytes_per_token(1, 1, 8, "bfloat16")


@pytest.mark.skipif(HAS_CUPY_DEVICE, reason="a CUDA device is present")
def test_auto_falls_back_to_numpy_and_cuda_is_refused_without_a_device() -> None:
    assert KVStorage(1, 1, 1, 1, 1).backend == "numpy"
    with pytest.raises(RuntimeError, match="CuPy and a CUDA device"):
        KVStorage(1, 1, 1, 1, 1, device="cuda")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_blocks": 0}, "num_blocks"),
        ({"block_size": -1}, "block_size"),
        ({"head_dim": 2.0}, "head_dim"),
        ({"dtype": "float64"}, "unsupported KV dtype"),
        ({"device": "tpu"}, "device must be"),
    ],
)
def test_bad_input(kwargs: dict, match: str) -> None:
    args = {"num_layers": 1, "num_blocks": 2, "block_size": 4, "num_kv_heads": 1, "head_dim": 8}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        KVStorage(**args)


def test_dlpack_export_is_zero_copy_with_torch() -> None:
    torch = pytest.importorskip("torch")
    s = KVStorage(2, 3, 4, 2, 8, dtype="float16", device="cpu")
    k = torch.from_dlpack(s.k_caches[1])
    assert k.dtype == torch.float16 and tuple(k.shape) == (3, 4, 2, 8)
    k[2, 1, 0, 3] = 1.5
    assert s.k_caches[1][2, 1, 0, 3] == np.float16(1.5)
    assert k.data_ptr() == s.k_caches[1].ctypes.data


def test_dlpack_bf16_view_writes_through() -> None:
    torch = pytest.importorskip("torch")
    s = KVStorage(1, 2, 4, 1, 8, dtype="bfloat16", device="cpu")
    v = torch.from_dlpack(s.v_caches[0]).view(torch.bfloat16)
    assert v.dtype == torch.bfloat16
    v[1, 3, 0, 7] = 2.0
    bits = int(s.v_caches[0][1, 3, 0, 7])
    # bf16 is the top half of the float32 bit pattern.
    assert bits == np.array([2.0], dtype=np.float32).view(np.uint32)[0] >> 16


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise AssertionError("no RssAnon in /proc/self/status")


linux_only = pytest.mark.skipif(
    not __import__("sys").platform.startswith("linux"), reason="page residency read from /proc"
)


@linux_only
@pytest.mark.parametrize("background", [False, True])
def test_prefault_maps_the_pool_and_keeps_its_contents(background: bool) -> None:
    """The pool is lazily zero-filled (an idle pool costs no memory); `prefault` commits its
    pages without changing what a running engine already wrote there."""
    s = KVStorage(2, 256, 16, 4, 64, dtype="bfloat16", device="cpu")  # 2 MiB per array
    before = _rss_kib()
    s.k_caches[1][3, 5, 2, :] = np.arange(64, dtype=np.uint16)
    s.v_caches[0][255, 15, 3, 7] = 12345
    assert _rss_kib() - before < s.nbytes // 1024 // 4  # still mostly unmapped
    assert s.prefault(background=background)
    s.wait_prefaulted()
    assert s.prefaulted
    assert _rss_kib() - before >= s.nbytes // 1024 * 9 // 10
    assert (s.k_caches[1][3, 5, 2, :] == np.arange(64)).all()
    assert s.v_caches[0][255, 15, 3, 7] == 12345
    assert int(s.k_caches[0].astype(np.int64).sum()) == 0


@linux_only
def test_background_prefault_maps_only_while_its_gate_is_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a gate (an engine's idle flag) the background thread maps a chunk at a time,
    and only while the gate is set: requests in flight are not slowed by it."""
    import pagemill.blockpool.kv_storage as kv_storage

    real = kv_storage.libc_madvise()
    if real is None or real(0, 0, kv_storage.MADV_POPULATE_WRITE) != 0:
        pytest.skip("no MADV_POPULATE_WRITE here")
    calls: list[int] = []

    def madvise(addr: int, n: int, advice: int) -> int:
        if n:
            calls.append(n)
        return real(addr, n, advice)

    monkeypatch.setattr(kv_storage, "libc_madvise", lambda: madvise)
    monkeypatch.setattr(kv_storage, "_PREFAULT_CHUNK", 1 << 20)
    s = KVStorage(2, 256, 16, 4, 64, dtype="bfloat16", device="cpu")  # 2 MiB per array
    gate = threading.Event()
    before = _rss_kib()
    assert s.prefault(background=True, gate=gate)
    time.sleep(0.3)
    assert not calls and not s.prefaulted  # closed: nothing mapped
    assert _rss_kib() - before < s.nbytes // 1024 // 4
    gate.set()
    s.wait_prefaulted()
    assert s.prefaulted
    assert len(calls) == 8 and max(calls) <= 1 << 20  # 8 MiB in 1 MiB calls
    assert _rss_kib() - before >= s.nbytes // 1024 * 9 // 10


@linux_only
def test_prefault_without_populate_writes_zeros(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel without MADV_POPULATE_WRITE: every page is written once, at once."""
    import pagemill.blockpool.kv_storage as kv_storage

    monkeypatch.setattr(kv_storage, "libc_madvise", lambda: None)
    s = KVStorage(1, 256, 16, 4, 64, dtype="bfloat16", device="cpu")
    before = _rss_kib()
    assert s.prefault(background=True)
    assert s._prefault_thread is None and s.prefaulted
    assert _rss_kib() - before >= s.nbytes // 1024 * 9 // 10
    assert not s.k_caches[0].any() and not s.v_caches[0].any()


@linux_only
def test_background_prefault_never_writes_when_the_kernel_refuses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A range the kernel refuses to populate in the background is left to fault in on
    demand: writing zeros there could erase what the running engine already stored."""
    import pagemill.blockpool.kv_storage as kv_storage

    monkeypatch.setattr(kv_storage, "libc_madvise", lambda: lambda addr, n, advice: -1 if n else 0)
    s = KVStorage(1, 256, 16, 4, 64, dtype="bfloat16", device="cpu")
    s.k_caches[0][0, 0, 0, 0] = 777  # the first byte of a page
    assert s.prefault(background=True)
    s.wait_prefaulted()
    assert s.k_caches[0][0, 0, 0, 0] == 777


def _anon_huge_kib(arrays: list[np.ndarray]) -> int:
    return huge_page_bytes(arrays) // 1024


thp_only = pytest.mark.skipif(
    not __import__("sys").platform.startswith("linux") or thp_policy() in (None, "never"),
    reason="no transparent huge pages here",
)


@thp_only
@pytest.mark.parametrize("background", [False, True])
def test_huge_pages_back_the_prefaulted_pool_and_keep_its_contents(background: bool) -> None:
    """With `huge_pages` each array starts on a huge-page boundary and, once prefaulted, is
    backed by huge pages (where the kernel has them free: most of it, on a machine with
    memory to spare), with what was written before the prefault unchanged."""
    s = KVStorage(2, 512, 16, 4, 64, dtype="bfloat16", device="cpu", huge_pages=True)  # 4 MiB
    assert s.huge_pages and "huge_pages=True" in repr(s)
    arrays = s.k_caches + s.v_caches
    assert all(a.ctypes.data % (2 << 20) == 0 for a in arrays)
    assert all(a.shape == (512, 16, 4, 64) and a.dtype == np.uint16 for a in arrays)
    assert s.nbytes == 4 * 512 * 16 * 4 * 64 * 2
    s.k_caches[1][3, 5, 2, :] = np.arange(64, dtype=np.uint16)
    s.v_caches[0][511, 15, 3, 7] = 12345
    before = _rss_kib()
    assert s.prefault(background=background)
    s.wait_prefaulted()
    assert _rss_kib() - before >= s.nbytes // 1024 * 7 // 10
    assert _anon_huge_kib(arrays) >= s.nbytes // 1024 // 2
    assert (s.k_caches[1][3, 5, 2, :] == np.arange(64)).all()
    assert s.v_caches[0][511, 15, 3, 7] == 12345
    assert int(s.k_caches[0].astype(np.int64).sum()) == 0


@pytest.mark.skipif(thp_policy() != "madvise", reason="huge pages only where asked for")
def test_without_huge_pages_the_pool_has_none() -> None:
    s = KVStorage(2, 512, 16, 4, 64, dtype="bfloat16", device="cpu")
    assert not s.huge_pages
    assert s.prefault(background=False)
    assert _anon_huge_kib(s.k_caches + s.v_caches) == 0


@linux_only
def test_refused_huge_page_advice_leaves_ordinary_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel that refuses MADV_HUGEPAGE: the pool is allocated all the same."""
    import pagemill.blockpool.host_memory as host_memory

    monkeypatch.setattr(host_memory, "libc_madvise", lambda: lambda addr, n, advice: -1)
    s = KVStorage(1, 256, 16, 4, 64, dtype="bfloat16", device="cpu", huge_pages=True)
    assert not s.huge_pages
    s.k_caches[0][255, 15, 3, 63] = 9
    assert s.k_caches[0].shape == (256, 16, 4, 64) and s.k_caches[0][255, 15, 3, 63] == 9


def _mappings(lo: int, hi: int) -> list[tuple[int, int, int, str]]:
    """(start, end, AnonHugePages KiB, VmFlags) of each of this process's mappings
    overlapping [lo, hi), from /proc/self/smaps."""
    out: list[tuple[int, int, int, str]] = []
    start = end = huge = 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0] if line.strip() else ""
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
            elif head == "AnonHugePages:":
                huge = int(line.split()[1])
            elif head == "VmFlags:" and start < hi and lo < end:
                out.append((start, end, huge, line.split(":", 1)[1].strip()))
    return out


@thp_only
def test_keep_small_pages_leaves_the_rest_of_the_pool_on_huge_pages() -> None:
    """The blocks an engine warms up on stay on 4 KB pages (`MADV_NOHUGEPAGE` on the whole
    huge pages around them), in every layer's K and V; the rest of each array still gets
    huge pages from the prefault, and contents written before it are kept."""
    # 8 KiB blocks, 512 of them: two huge pages per array.
    s = KVStorage(2, 512, 16, 4, 64, dtype="bfloat16", device="cpu", huge_pages=True)
    huge = 2 << 20
    assert s.keep_small_pages(250, 10)  # blocks 250-259 straddle the first page boundary
    for a in s.k_caches + s.v_caches:
        a[255, 0, 0, 0] = 7
    assert s.prefault(background=False)
    for a in s.k_caches + s.v_caches:
        base = a.ctypes.data
        maps = _mappings(base, base + 2 * huge)
        small = [m for m in maps if "nh" in m[3].split()]
        # Both huge pages hold a warm-up block: both are small pages, with nothing huge (the
        # arrays share one mapping, so the range the kernel reports may run on into the
        # neighbouring arrays, advised alike).
        assert len(small) == 1, maps
        assert small[0][0] <= base and small[0][1] >= base + 2 * huge, maps
        assert all(m[2] == 0 for m in small)
        assert a[255, 0, 0, 0] == 7 and int(a.astype(np.int64).sum()) == 7


@thp_only
def test_keep_small_pages_takes_only_the_huge_pages_holding_the_blocks() -> None:
    s = KVStorage(1, 1024, 16, 4, 64, dtype="bfloat16", device="cpu", huge_pages=True)  # 8 MiB
    huge = 2 << 20
    assert s.keep_small_pages(0, 3)
    assert s.prefault(background=False)
    for a in s.k_caches + s.v_caches:
        base = a.ctypes.data
        maps = _mappings(base, base + 4 * huge)
        small = [(m[0], m[1]) for m in maps if "nh" in m[3].split()]
        assert small == [(base, base + huge)], maps
        rest = [m for m in maps if m[1] > base + huge]
        assert all("hg" in m[3].split() for m in rest), maps
        # The kernel backs the rest with huge pages where it has them free (most of it).
        assert sum(m[2] for m in rest) * 1024 >= huge, maps


def test_keep_small_pages_without_huge_pages_or_blocks_is_a_no_op() -> None:
    s = KVStorage(1, 64, 16, 4, 64, dtype="bfloat16", device="cpu")
    assert not s.keep_small_pages(0, 8)
    h = KVStorage(1, 64, 16, 4, 64, dtype="bfloat16", device="cpu", huge_pages=True)
    assert not h.keep_small_pages(0, 0)
    if h.huge_pages:
        with pytest.raises(ValueError, match="first_block 64"):
            h.keep_small_pages(64, 1)
