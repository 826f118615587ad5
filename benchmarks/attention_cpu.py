"""The native CPU decode kernel against an earlier version of itself, in the same process.

    python benchmarks/attention_cpu.py
    python benchmarks/attention_cpu.py --batch-sizes 16,128 --contexts 64 --rounds 30
    python benchmarks/attention_cpu.py --baseline-rev HEAD~3 --json out.json
    python benchmarks/attention_cpu.py --batch-sizes 1,16 --contexts 192 --profile --stat min

`csrc/paged_decode_cpu.cpp` as it is now and as it was at --baseline-rev (read with
`git show`, built into the kernel cache like the current one) run the same decode batches,
alternated call by call for --rounds rounds, so a load that comes and goes on a shared
machine hits both alike. Per case: the median time per layer of each, the median of the
per-round ratios old / new, and the K/V bytes per second of the new one, also as a share of
the read bandwidth measured at the start of the run (a sum over a large buffer). Timed twice: the
calling thread's CPU time with one thread (`time.thread_time`, immune to other processes
taking the core), and wall time with --threads threads.

Each case is SmolLM2-135M's attention (9 query heads, 3 KV heads of 64, bf16, block size
16) by default: --batch-sizes requests of --contexts tokens each, their blocks shuffled
over the pool as after a while of serving. Several layers' caches are cycled through (up to
--pool-mb of K/V in all) so a call does not find the previous call's K/V in the cache.
--huge-pages asks the kernel for transparent huge pages on the caches before they are first
written (`madvise(MADV_HUGEPAGE)`, what a KV cache allocated that way would get where THP
is in "madvise" mode): blocks scattered over 4 KB pages cost a TLB miss each.

Both timings include the Python call (ctypes, or the torch operator with --operator); the
cost of a call that reads nothing (one request of one token) is printed first, to be taken
off small cases. --stat min reports each kernel's fastest round instead of the median (and
the ratio of the two fastest), the closer to the quiet machine when others take the cores
part of the time (wall time with threads then suffers most: a thread that loses its core
stalls the other at the barrier).

--profile builds a second copy of the current kernel with PAGEMILL_DECODE_PROFILE (TSC
cycle counters per phase of the vectorised path, in the calling thread) and runs each case
once more on one thread through it: the split of the kernel's time into per-pair setup,
scores, weights (softmax), weighted values (PV), output, the merge of split contexts, and
what lies outside the pairs (the loop, the prefetch stream's start), with the cycles per
pair (or per part of a split context).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagemill.kernels import cpu_native

# The kernel before contexts of few requests were split across threads.
DEFAULT_BASELINE = "ad54a2e"
_REL_SOURCE = "packages/kernels/src/pagemill/kernels/csrc/paged_decode_cpu.cpp"
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


_PHASES = ("setup", "scores", "weights", "values", "output", "merge")


def load_profiled() -> ctypes.CDLL:
    """The current kernel built with its phase counters (PAGEMILL_DECODE_PROFILE)."""
    current = cpu_native.load()
    if current is None:
        raise SystemExit("the native CPU kernel cannot be built here")
    root = Path(__file__).resolve().parent.parent
    lib = cpu_native.build_library(
        root / _REL_SOURCE,
        "the decode kernel with phase counters",
        "no profile",
        ["-DPAGEMILL_DECODE_PROFILE=1"],
    )
    if lib is None:
        raise SystemExit("the profiled kernel did not build")
    lib.pagemill_paged_decode.restype = ctypes.c_int
    lib.pagemill_paged_decode.argtypes = current.pagemill_paged_decode.argtypes
    lib.pagemill_paged_decode_profile.restype = None
    lib.pagemill_paged_decode_profile.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


def profile_case(lib: ctypes.CDLL, layers: list[Layer], out: torch.Tensor, rounds: int) -> str:
    """One thread's split of the kernel's cycles by phase in the quietest of `rounds` passes
    over the layers (after one pass to warm up)."""
    torch.set_num_threads(1)
    scale = layers[0][0].shape[-1] ** -0.5
    counters = (ctypes.c_double * 8)()

    def go() -> None:
        for q, kc, vc, tables, lens in layers:
            cpu_native.paged_decode(lib, q, kc, vc, out, tables, lens, None, scale)

    go()
    lib.pagemill_paged_decode_profile(counters, 1)
    best: list[float] = []
    for _ in range(rounds):  # the round with the fewest cycles: the TSC counts preemptions
        go()
        lib.pagemill_paged_decode_profile(counters, 1)
        if not best or counters[6] < best[6]:
            best = list(counters)
    total, items = best[6], best[7]
    if not total or not items:
        return "(no fast-path calls)"
    inside = sum(best[:6])
    parts = [f"{name} {best[i] / total:.0%}" for i, name in enumerate(_PHASES)]
    parts.append(f"outside pairs {(total - inside) / total:.0%}")
    calls = len(layers)
    return f"{total / items:.0f} cycles per pair/part, {items / calls:.0f} per call: " + ", ".join(
        parts
    )


def call_overhead(lib: ctypes.CDLL, clock: Callable[[], float], calls: int = 2000) -> float:
    """Seconds per call of a decode that reads one token of one request."""
    torch.set_num_threads(1)
    layers, out, _ = make_case(1, 1, 9, 3, 64, 16, torch.bfloat16, 0.0, 0)
    q, kc, vc, tables, lens = layers[0]
    best = float("inf")
    for _ in range(3):
        t0 = clock()
        for _ in range(calls):
            cpu_native.paged_decode(lib, q, kc, vc, out, tables, lens, None, 0.125)
        best = min(best, (clock() - t0) / calls)
    return best


def load_baseline(rev: str) -> ctypes.CDLL:
    """The kernel's source at ``rev``, built and loaded with the current one's signature."""
    root = Path(__file__).resolve().parent.parent
    text = subprocess.run(
        ["git", "show", f"{rev}:{_REL_SOURCE}"], cwd=root, check=True, capture_output=True
    ).stdout
    current = cpu_native.load()
    if current is None:
        raise SystemExit("the native CPU kernel cannot be built here")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "paged_decode_cpu_baseline.cpp"
        src.write_bytes(text)
        lib = cpu_native.build_library(src, f"the decode kernel at {rev}", "no baseline")
    if lib is None:
        raise SystemExit(f"the kernel at {rev} did not build")
    fn = lib.pagemill_paged_decode
    fn.restype = ctypes.c_int
    fn.argtypes = current.pagemill_paged_decode.argtypes
    return lib


_MADV_HUGEPAGE = 14
# One layer's decode inputs: q, k_cache, v_cache, block tables, context lengths.
Layer = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def cache_tensor(shape: tuple[int, ...], dtype: torch.dtype, huge: bool) -> torch.Tensor:
    """An uninitialised cache tensor, advised to huge pages before anything touches it."""
    t = torch.empty(shape, dtype=dtype)
    if huge:
        libc = ctypes.CDLL(None)
        page = 2 << 20
        start = -(-t.data_ptr() // page) * page
        end = (t.data_ptr() + t.nbytes) // page * page
        if end > start:
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
    return t


def make_case(
    n: int,
    ctx: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    pool_mb: float,
    seed: int,
    huge: bool = False,
) -> tuple[list[Layer], torch.Tensor, float]:
    """Layers of (q, k_cache, v_cache, tables, lens), and the K/V bytes one layer reads."""
    g = torch.Generator().manual_seed(seed)
    nblk = -(-ctx // block_size)
    layer_bytes = 2 * n * ctx * kv_heads * head_dim * dtype.itemsize
    layers = max(1, min(30, int(pool_mb * 2**20 // max(1, layer_bytes))))
    out: list[Layer] = []
    for _ in range(layers):
        shape = (n * nblk, block_size, kv_heads, head_dim)
        kc = cache_tensor(shape, dtype, huge)
        vc = cache_tensor(shape, dtype, huge)
        kc.copy_(torch.randn(shape, generator=g))
        vc.copy_(torch.randn(shape, generator=g))
        tables = torch.randperm(n * nblk, generator=g).to(torch.int32).view(n, nblk)
        q = torch.randn(n, heads, head_dim, generator=g).to(dtype)
        lens = torch.full((n,), ctx, dtype=torch.int32)
        out.append((q, kc, vc, tables.contiguous(), lens))
    return out, torch.empty_like(out[0][0]), float(layer_bytes)


def timed(fn: Callable[[], None], clock: Callable[[], float]) -> float:
    t0 = clock()
    fn()
    return clock() - t0


def run_case(
    libs: dict[str, ctypes.CDLL],
    layers: list[Layer],
    out: torch.Tensor,
    rounds: int,
    threads: int,
    clock: Callable[[], float],
) -> dict[str, list[list[float]]]:
    """Per kernel, round and layer: seconds of that call (one call per layer, all layers in
    turn, the kernels alternating round by round)."""
    torch.set_num_threads(threads)
    scale = layers[0][0].shape[-1] ** -0.5

    def call(lib: ctypes.CDLL) -> Callable[[], list[float]]:
        def go() -> list[float]:
            got = []
            for q, kc, vc, tables, lens in layers:
                t0 = clock()
                cpu_native.paged_decode(lib, q, kc, vc, out, tables, lens, None, scale)
                got.append(clock() - t0)
            return got

        return go

    fns = {name: call(lib) for name, lib in libs.items()}
    for fn in fns.values():  # warm-up: caches built, pages touched
        fn()
    times: dict[str, list[list[float]]] = {name: [] for name in libs}
    names = list(libs)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(fns[name]())
    return times


def per_layer(rounds: list[list[float]], stat: str) -> list[float]:
    """Seconds per layer: each round's mean over its layers (median: the rounds as they
    came), or (min) one figure, every layer's fastest call averaged over the layers, which a
    preempted call does not reach."""
    if stat == "min":
        return [statistics.fmean(min(col) for col in zip(*rounds, strict=True))]
    return [statistics.fmean(r) for r in rounds]


def read_bandwidth(threads: int, clock: Callable[[], float], mb: int = 256) -> float:
    """Bytes per second this box reads now (a sum over a buffer far larger than the caches),
    the bound the kernel's K/V traffic is measured against; the best of three."""
    torch.set_num_threads(threads)
    buf = torch.ones(mb << 18, dtype=torch.float32)
    best = 0.0
    for _ in range(3):
        t = timed(lambda: buf.sum(), clock)
        best = max(best, buf.nbytes / t)
    return best


def check_same(libs: dict[str, ctypes.CDLL], layers: list[Layer]) -> float:
    """Largest |old - new| on the first layer (both fp32-accumulated: small)."""
    q, kc, vc, tables, lens = layers[0]
    got = []
    for lib in libs.values():
        o = torch.empty_like(q)
        cpu_native.paged_decode(lib, q, kc, vc, o, tables, lens, None, q.shape[-1] ** -0.5)
        got.append(o.float())
    return float((got[0] - got[1]).abs().max())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--baseline-rev", default=DEFAULT_BASELINE)
    ap.add_argument("--batch-sizes", default="1,16,64,128,256")
    ap.add_argument("--contexts", default="64,192,512")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2, help="threads of the wall-time run")
    ap.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head dim")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    ap.add_argument("--pool-mb", type=float, default=256.0)
    ap.add_argument("--huge-pages", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--stat",
        choices=("median", "min"),
        default="median",
        help="per kernel: the median round (default) or the fastest (busy machines)",
    )
    ap.add_argument(
        "--profile", action="store_true", help="the new kernel's split of time by phase"
    )
    ap.add_argument(
        "--operator",
        action="store_true",
        help="call the new kernel through its C++ torch operator (default: ctypes, as the old)",
    )
    args = ap.parse_args(argv)
    if not args.operator:  # kernel against kernel: the same calling cost for both
        cpu_native.load_attention_ops = lambda: False  # type: ignore[method-assign]
    heads, kv_heads, head_dim = (int(x) for x in args.heads.split(","))
    current = cpu_native.load()
    if current is None:
        raise SystemExit("the native CPU kernel cannot be built here")
    libs = {"old": load_baseline(args.baseline_rev), "new": current}
    profiled = load_profiled() if args.profile else None
    dtype = _DTYPES[args.dtype]
    rows = []
    overhead = call_overhead(current, time.thread_time)
    print(f"one call reading nothing: {overhead * 1e6:.1f} us CPU (in every figure below)")
    bw_1t = read_bandwidth(1, time.thread_time)
    bw_nt = read_bandwidth(args.threads, time.perf_counter)
    print(
        f"read bandwidth now: {bw_1t / 1e9:.1f} GB/s (1 thread), "
        f"{bw_nt / 1e9:.1f} GB/s ({args.threads} threads)"
    )
    print(
        f"{'batch':>5} {'ctx':>5} | {'1 thread CPU us/layer':^27} | "
        f"{f'{args.threads} threads wall us/layer':^27} | new GB/s (1t, {args.threads}t), of read"
    )
    print(
        f"{'':>11}| {'old':>8} {'new':>8} {'old/new':>8} | {'old':>8} {'new':>8} {'old/new':>8} |"
    )
    for ctx in (int(x) for x in args.contexts.split(",")):
        for n in (int(x) for x in args.batch_sizes.split(",")):
            layers, out, nbytes = make_case(
                n,
                ctx,
                heads,
                kv_heads,
                head_dim,
                args.block_size,
                dtype,
                args.pool_mb,
                0,
                args.huge_pages,
            )
            diff = check_same(libs, layers)
            row: dict[str, object] = {"batch": n, "context": ctx, "max_abs_diff": diff}
            line = f"{n:>5} {ctx:>5} |"
            for label, threads, clock in (
                ("cpu_1t", 1, time.thread_time),
                (f"wall_{args.threads}t", args.threads, time.perf_counter),
            ):
                t = run_case(libs, layers, out, args.rounds, threads, clock)
                t_old, t_new = per_layer(t["old"], args.stat), per_layer(t["new"], args.stat)
                old, new = statistics.median(t_old), statistics.median(t_new)
                ratio = statistics.median(a / b for a, b in zip(t_old, t_new, strict=True))
                row[label] = {"old_us": old * 1e6, "new_us": new * 1e6, "ratio": ratio}
                row[f"{label}_new_gbps"] = nbytes / new / 1e9
                line += f" {old * 1e6:>8.0f} {new * 1e6:>8.0f} {ratio:>7.2f}x |"
            row["read_gbps"] = {"1t": bw_1t / 1e9, f"{args.threads}t": bw_nt / 1e9}
            line += (
                f" {row['cpu_1t_new_gbps']:.1f}, {row[f'wall_{args.threads}t_new_gbps']:.1f}"
                f" ({row['cpu_1t_new_gbps'] * 1e9 / bw_1t:.0%}, "
                f"{row[f'wall_{args.threads}t_new_gbps'] * 1e9 / bw_nt:.0%} of read)"
                f"   (max |old-new| {diff:.1e})"
            )
            print(line, flush=True)
            if profiled is not None:
                row["profile"] = profile_case(profiled, layers, out, args.rounds)
                print(f"{'':>12}new, 1 thread: {row['profile']}", flush=True)
            rows.append(row)
            del layers
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"args": vars(args), "call_overhead_us": overhead * 1e6, "rows": rows}, indent=1
            )
        )


if __name__ == "__main__":
    main()
