"""The Q8_0 LM head (SmolLM2-135M: 49152 x 576) on the CPU at 1-64 rows: `gemv_q8` on its
vector kernel, on the AMX units, and the kernel's own pick (what the model calls), against
the dense bf16 copy (`F.linear`) and the box's read bandwidth measured in the same run.

    uv run python benchmarks/gemv_q8_amx.py [--rows 1,4,8,16,32,64] [--rounds 15] [--mb 1024]
        [--old OLD.cpp]

`--old` adds another build of the kernel (e.g. `git show main:<the kernel source>`), as
"old", for an A/B in one process.

Each path runs over its own copies of the head (`--mb` of weights per path), one call per
copy in turn, so that every call streams its weights from memory as a decode step does
rather than from a large L3. Paths alternate within every round (A B C A B C ...); the table
gives each path's median and least ms per call, the median's ratio to the vector kernel's,
and the GB/s its weights were read at (median). With `--threads 1` calls are timed by the
thread's CPU time, which other processes on a shared box do not inflate (though they still
share its caches and memory); otherwise by wall clock, which a loaded box inflates many times
over (threads wait on each other). The read bandwidth is a sum over a tensor of `--mb` MB,
timed between the rounds (wall clock). Give `uptime` with every figure.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from pagemill.kernels import gemv_q8_cpu as g
from pagemill.kernels.cpu_native import load_gemv

VOCAB, HIDDEN = 49152, 576


def _heads(copies: int, seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (VOCAB, HIDDEN), generator=gen, dtype=torch.int8)
    d = (torch.rand(VOCAB, HIDDEN // 32, generator=gen) * 0.02 + 1e-3).half().float()
    blocks = g.pack_q8_blocks(q, d)
    return [blocks.clone() for _ in range(copies)], q, d


def _time(fn: Callable[[], object], calls: int, clock: Callable[[], float]) -> float:
    t0 = clock()
    fn()
    return (clock() - t0) * 1e3 / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,4,8,16,32,64")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--mb", type=int, default=1024, help="MB of weights per path")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--planes", type=int, default=2)
    ap.add_argument("--no-dense", action="store_true", help="skip the dense bf16 copy")
    ap.add_argument("--old", type=Path, help="another source of the kernel, run as 'old'")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # One thread: its own CPU time, which other processes on a shared box do not inflate.
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    lib = g.load()
    if lib is None:
        raise SystemExit("the Q8_0 kernel is not built here")
    old = None
    if args.old:
        i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        argtypes = [i32, ptr, i64, ptr, ptr, i64, i64, i64, i64, i32, i32]
        old = load_gemv(args.old, "pagemill_gemv_q8", argtypes, "the old kernel", "none")
        if old is None:
            raise SystemExit(f"{args.old} does not build")
    q8_bytes = g.pack_q8_blocks(
        torch.zeros(16, HIDDEN, dtype=torch.int8), torch.zeros(16, HIDDEN // 32)
    ).numel() * (VOCAB // 16)
    dense_bytes = VOCAB * HIDDEN * 2
    n_q8 = max(1, -(-args.mb * 2**20 // q8_bytes))
    heads, q, d = _heads(n_q8)
    dense: list[torch.Tensor] = []
    if not args.no_dense:
        w = (q.view(VOCAB, -1, 32).float() * d[..., None]).view(VOCAB, HIDDEN).bfloat16()
        dense = [w.clone() for _ in range(max(1, -(-args.mb * 2**20 // dense_bytes)))]
        del w
    big = torch.ones(args.mb * 2**20 // 4)
    amx = g.amx_available(lib)
    print(
        f"threads {args.threads}, planes {args.planes}, AMX {'yes' if amx else 'no'} "
        f"(kernel picks it from {g.amx_min_rows(lib)} rows), Q8 head {q8_bytes / 1e6:.1f} MB "
        f"x {len(heads)}, dense {dense_bytes / 1e6:.1f} MB x {len(dense)}, "
        f"load {os.getloadavg()[0]:.2f}"
    )
    print(f"{'rows':>4} {'path':>7} {'ms':>7} {'min ms':>7} {'x vec':>6} {'GB/s':>6}")
    for m in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(m, HIDDEN).bfloat16()

        def q8(
            path: bool | None, build: ctypes.CDLL = lib, x: torch.Tensor = x
        ) -> Callable[[], object]:
            def run() -> None:
                for h in heads:
                    g.gemv_q8(x, h, VOCAB, build, planes=args.planes, amx=path)

            return run

        def lin(x: torch.Tensor = x) -> None:
            for w in dense:
                F.linear(x, w)

        paths: dict[str, tuple[Callable[[], object], int, int]] = {
            "vec": (q8(False), len(heads), q8_bytes)
        }
        if amx:
            paths["amx"] = (q8(True), len(heads), q8_bytes)
        paths["auto"] = (q8(None), len(heads), q8_bytes)
        if old is not None:
            paths["old"] = (q8(None, old), len(heads), q8_bytes)
        if dense:
            paths["dense"] = (lin, len(dense), dense_bytes)
        times: dict[str, list[float]] = {p: [] for p in paths}
        reads: list[float] = []
        for fn, _, _ in paths.values():  # warm up
            fn()
        for _ in range(args.rounds):
            for p, (fn, calls, _) in paths.items():
                times[p].append(_time(fn, calls, clock))
            t0 = time.perf_counter()
            big.sum()
            reads.append(big.numel() * 4 / (time.perf_counter() - t0) / 1e9)
        vec = statistics.median(times["vec"])
        for p, (_, _, nbytes) in paths.items():
            ms = statistics.median(times[p])
            low = min(times[p])
            print(f"{m:>4} {p:>7} {ms:7.3f} {low:7.3f} {vec / ms:6.2f} {nbytes / ms / 1e6:6.1f}")
        print(
            f"{m:>4} {'read':>7} {'':>7} {'':>7} {'':>6} {statistics.median(reads):6.1f}"
            f"  (sum over {args.mb} MB; load {os.getloadavg()[0]:.2f})"
        )


if __name__ == "__main__":
    main()
