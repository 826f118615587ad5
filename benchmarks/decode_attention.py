"""The native CPU decode kernel over a paged cache laid out like the engine's, against the
machine's plain read rate of the same bytes and against an earlier version of the kernel.

    python benchmarks/decode_attention.py
    python benchmarks/decode_attention.py --batch-sizes 128,256 --contexts 90 --rounds 9
    python benchmarks/decode_attention.py --baseline HEAD~2 --layouts scattered
    python benchmarks/decode_attention.py --baseline /tmp/paged_decode_cpu_old.cpp
    python benchmarks/decode_attention.py --pages --batch-sizes 128,256 --contexts 90
    python benchmarks/decode_attention.py --huge-pages --baseline /tmp/variant.cpp

The cache is what `KVStorage` makes on the CPU: one private anonymous mapping per layer
for K and one for V, [num_blocks, 16, kv_heads, head_dim] bf16, every page populated up
front (`MADV_POPULATE_WRITE`), the pool larger than the batch needs; on 4 KB pages unless
--huge-pages (both kernels over caches that asked for transparent huge pages, as
`KVStorage` makes them by default) or --pages (the current kernel over 4 KB pages as
"base" and over huge pages as "new"). The batch's block
tables come from a FIFO free queue like the block pool's (`--layouts scattered`: after a
churn of requests of random lengths coming and going, each request takes its first blocks
at its prefill and then one block at a time, interleaved with the others, as decode grows
it; `contiguous`: each request's blocks one run in the pool, for comparison).

Each case (requests x context) calls the kernel once per layer, all layers in turn (so a
call does not find its K/V in the caches from the call before), the current kernel and the
baseline (`--baseline`: a git revision or a source file; built into the kernel cache like
the current one) alternating round by round, and a plain read of the same number of bytes
(a torch sum over one contiguous array, with the same threads) in the same rounds. Printed
per case: each kernel's median time per call (one layer), the median of the per-round
ratios baseline / current, the K/V bytes per second the current kernel reads, and the plain
read rate with the current kernel's share of it. Wall time with --threads threads; the box
may be shared, so compare within a line, not across runs.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import ctypes.util
import mmap
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from pagemill.kernels import cpu_native

_REL_SOURCE = "packages/kernels/src/pagemill/kernels/csrc/paged_decode_cpu.cpp"
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_HUGE = 2 << 20
populate_s: dict[bool, float] = {False: 0.0, True: 0.0}
populate_bytes: dict[bool, int] = {False: 0, True: 0}


def load_baseline(spec: str) -> ctypes.CDLL:
    """The kernel from a source file or a git revision, with the current one's signature."""
    root = Path(__file__).resolve().parent.parent
    path = Path(spec)
    if path.is_file():
        text = path.read_bytes()
    else:
        text = subprocess.run(
            ["git", "show", f"{spec}:{_REL_SOURCE}"], cwd=root, check=True, capture_output=True
        ).stdout
    current = cpu_native.load()
    if current is None:
        raise SystemExit("the native CPU kernel cannot be built here")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "paged_decode_cpu_baseline.cpp"
        src.write_bytes(text)
        lib = cpu_native.build_library(src, f"the decode kernel at {spec}", "no baseline")
    if lib is None:
        raise SystemExit(f"the kernel at {spec} did not build")
    lib.pagemill_paged_decode.restype = ctypes.c_int
    lib.pagemill_paged_decode.argtypes = current.pagemill_paged_decode.argtypes
    return lib


def pool_array(shape: tuple[int, ...], huge: bool = False) -> torch.Tensor:
    """A bf16 array in its own private anonymous mapping, every page populated (as
    `KVStorage` then `prefault` make it), filled with small random values. `huge`: the
    mapping asks for transparent huge pages (`MADV_HUGEPAGE`) before it is populated, its
    length rounded up to whole 2 MB pages (the kernel aligns such mappings to them)."""
    nbytes = int(np.prod(shape)) * 2
    length = -(-nbytes // _HUGE) * _HUGE if huge else nbytes
    buf = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE)
    arr = np.frombuffer(buf, dtype=np.uint16, count=nbytes // 2)
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if huge:
        libc.madvise(arr.ctypes.data, length, _MADV_HUGEPAGE)
    t0 = time.perf_counter()
    libc.madvise(arr.ctypes.data, length, _MADV_POPULATE_WRITE)
    populate_s[huge] += time.perf_counter() - t0
    populate_bytes[huge] += length
    t = torch.from_numpy(arr).view(torch.bfloat16)
    g = torch.Generator().manual_seed(nbytes)  # the same contents for either page size
    chunk = torch.randn(min(t.numel(), 1 << 20), generator=g).to(torch.bfloat16)
    for i in range(0, t.numel(), chunk.numel()):
        n = min(chunk.numel(), t.numel() - i)
        t[i : i + n].copy_(chunk[:n])
    return t.view(shape)


def scattered_tables(
    n: int, nblk: int, num_blocks: int, prompt_blocks: int, rng: random.Random
) -> list[list[int]]:
    """Block ids as a FIFO free queue hands them out after a churn of requests: each of
    the n requests takes `prompt_blocks` at once (its prefill), then the rest one block at
    a time, round robin over the requests (decode growing them)."""
    free = collections.deque(range(num_blocks))
    live: list[list[int]] = []
    for _ in range(4 * num_blocks // 8):
        if live and (rng.random() < 0.45 or len(free) < 64):
            blocks = live.pop(rng.randrange(len(live)))
            free.extend(reversed(blocks))
        else:
            live.append([free.popleft() for _ in range(rng.randint(1, 16))])
    for blocks in live:
        free.extend(reversed(blocks))
    tables: list[list[int]] = [[] for _ in range(n)]
    for t in tables:
        t.extend(free.popleft() for _ in range(min(nblk, prompt_blocks)))
    for _ in range(nblk - prompt_blocks):
        for t in tables:
            t.append(free.popleft())
    return tables


Caches = list[tuple[torch.Tensor, torch.Tensor]]


def run_case(
    libs: dict[str, ctypes.CDLL],
    cache_sets: dict[str, Caches],
    tables: torch.Tensor,
    lens: torch.Tensor,
    heads: int,
    rounds: int,
    clock: Callable[[], float],
    pick: Callable[[list[float]], float],
) -> dict[str, float]:
    """One case: each kernel's time per call (one layer), the median per-round ratio
    base / new, the plain read rate of the same bytes, and the largest |base - new|."""
    n = tables.shape[0]
    caches = cache_sets["new"]
    _, _, kv_heads, head_dim = caches[0][0].shape
    g = torch.Generator().manual_seed(n)
    qs = [
        torch.randn(n, heads, head_dim, generator=g).to(torch.bfloat16) for _ in range(len(caches))
    ]
    out = torch.empty(n, heads, head_dim, dtype=torch.bfloat16)
    kv_bytes = 2 * int(lens.sum()) * kv_heads * head_dim * 2  # per layer
    plain = torch.ones(kv_bytes * len(caches) // 4, dtype=torch.float32)
    scale = head_dim**-0.5
    got = []
    for name, lib in libs.items():
        kc0, vc0 = cache_sets[name][0]
        o = torch.empty_like(out)
        cpu_native.paged_decode(lib, qs[0], kc0, vc0, o, tables, lens, None, scale)
        got.append(o.float())
    diff = float((got[0] - got[-1]).abs().max())

    def call(name: str) -> float:
        lib = libs[name]
        t0 = clock()
        for (kc, vc), q in zip(cache_sets[name], qs, strict=True):
            cpu_native.paged_decode(lib, q, kc, vc, out, tables, lens, None, scale)
        return (clock() - t0) / len(caches)

    def read() -> float:
        t0 = clock()
        plain.sum()
        return clock() - t0

    names = list(libs)
    for name in names:  # warm-up
        call(name)
    read()
    times: dict[str, list[float]] = {name: [] for name in names}
    reads = []
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(call(name))
        reads.append(read())
    base, new = pick(times["base"]), pick(times["new"])
    return {
        "base_s": base,
        "new_s": new,
        "ratio": statistics.median(a / b for a, b in zip(times["base"], times["new"], strict=True)),
        "new_gbps": kv_bytes / new / 1e9,
        "read_gbps": plain.nbytes / pick(reads) / 1e9,
        "max_abs_diff": diff,
    }


def populated(caches: Caches) -> str:
    """Populate time per GB so far, 4 KB pages against huge, and how much of `caches` the
    kernel backs with huge pages (AnonHugePages of the mappings in /proc/self/smaps)."""
    ranges = [(t.data_ptr(), t.data_ptr() + t.nbytes) for pair in caches for t in pair]
    total = sum(b - a for a, b in ranges)
    huge_kb = 0
    start = end = 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            start, end = lo, hi
        elif head == "AnonHugePages:" and any(start < b and a < end for a, b in ranges):
            huge_kb += int(line.split()[1])
    rate = {
        k: populate_s[k] / (populate_bytes[k] / 2**30) if populate_bytes[k] else 0.0
        for k in (False, True)
    }
    return (
        f"populate: {rate[False]:.2f} s/GB 4 KB pages, {rate[True]:.2f} s/GB huge;"
        f" huge pages back {huge_kb * 1024 / total:.0%} of the huge-page cache"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--baseline", default="HEAD", help="git revision or source file")
    ap.add_argument("--batch-sizes", default="1,16,64,128,256")
    ap.add_argument("--contexts", default="64,128,512")
    ap.add_argument("--layouts", default="scattered,contiguous")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--max-gb", type=float, default=3.0, help="fewer layers past this pool")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="one thread, timed by its CPU time (time.thread_time): less hit by a busy box",
    )
    ap.add_argument("--stat", choices=("median", "min"), default="median")
    ap.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head dim")
    ap.add_argument("--prompt", type=int, default=64, help="tokens each request prefilled")
    ap.add_argument(
        "--pages",
        action="store_true",
        help="base and new are both the current kernel, base over a cache of 4 KB pages and"
        " new over one that asked for transparent huge pages (MADV_HUGEPAGE); also prints the"
        " populate time per GB of each and how much of the second got huge pages",
    )
    ap.add_argument(
        "--huge-pages",
        action="store_true",
        help="every cache asks for transparent huge pages (as KVStorage's by default)",
    )
    args = ap.parse_args(argv)
    # Kernel against kernel through ctypes: the same calling cost for both.
    cpu_native.load_attention_ops = lambda: False  # type: ignore[assignment]
    heads, kv_heads, head_dim = (int(x) for x in args.heads.split(","))
    bs = 16
    current = cpu_native.load()
    if current is None:
        raise SystemExit("the native CPU kernel cannot be built here")
    libs = {"base": current if args.pages else load_baseline(args.baseline), "new": current}
    if args.cpu_time:
        args.threads = 1
    clock = time.thread_time if args.cpu_time else time.perf_counter
    pick = min if args.stat == "min" else statistics.median
    torch.set_num_threads(args.threads)
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    slot = kv_heads * head_dim * 2
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"load average {' '.join(load)}; {args.threads} thread(s)")
    print(
        f"{'layout':>10} {'rows':>5} {'ctx':>5} | {'base us':>8} {'new us':>8} {'base/new':>8} |"
        f" {'new GB/s':>8} {'read GB/s':>9} {'of read':>7} | max|diff|"
    )
    for ctx in (int(x) for x in args.contexts.split(",")):
        nblk = -(-ctx // bs)
        num_blocks = max(4096, max(batch_sizes) * nblk * 3 // 2)
        layer_bytes = 2 * num_blocks * bs * slot
        layers = max(2, min(args.layers, int(args.max_gb * 2**30 // layer_bytes)))
        shape = (num_blocks, bs, kv_heads, head_dim)
        huge = args.huge_pages
        caches = [(pool_array(shape, huge), pool_array(shape, huge)) for _ in range(layers)]
        cache_sets = {"base": caches, "new": caches}
        if args.pages:
            cache_sets["new"] = [
                (pool_array(shape, True), pool_array(shape, True)) for _ in range(layers)
            ]
            print(populated(cache_sets["new"]), flush=True)
        for layout in args.layouts.split(","):
            if layout == "scattered":
                prompt_blocks = -(-args.prompt // bs)
                rng = random.Random(0)
                all_tables = scattered_tables(
                    max(batch_sizes), nblk, num_blocks, prompt_blocks, rng
                )
            else:
                all_tables = [
                    list(range(r * nblk, (r + 1) * nblk)) for r in range(max(batch_sizes))
                ]
            for n in batch_sizes:
                tables = torch.tensor(all_tables[:n], dtype=torch.int32)
                lens = torch.full((n,), ctx, dtype=torch.int32)
                res = run_case(libs, cache_sets, tables, lens, heads, args.rounds, clock, pick)
                print(
                    f"{layout:>10} {n:>5} {ctx:>5} |"
                    f" {res['base_s'] * 1e6:>8.0f} {res['new_s'] * 1e6:>8.0f}"
                    f" {res['ratio']:>7.2f}x | {res['new_gbps']:>8.1f} {res['read_gbps']:>9.1f}"
                    f" {res['new_gbps'] / res['read_gbps']:>7.0%} | {res['max_abs_diff']:.1e}",
                    flush=True,
                )
        del caches, cache_sets


if __name__ == "__main__":
    main()
