"""The Q8_0 LM head of SmolLM2-135M (49152 x 576) on the AMX-BF16 tiles from its packed
blocks against oneDNN on the bf16 embedding (the large-row head of a tied model today),
interleaved in one process.

    uv run python benchmarks/gemm_q8_amx.py [--rows 16,32,64,128,256,512,2048]
        [--rounds 9] [--threads N] [--paths amx,dense,prepacked,gemv] [--reference OLD.cpp]

Paths, each one head call on the same random Q8_0 weights (and their bf16 values):

    amx         torch.ops.pagemill_native.gemm_q8_amx on gemv_q8's tiles (bf16(q * bf16(d))
                B tiles made per call, fp32 sums): the new large-row head
    dense       F.linear on the bf16 [49152, 576] weight (oneDNN): the large-row head today
    prepacked   the same through oneDNN's prepacked twin (PAGEMILL_PREPACK_DENSE=1)
    gemv        gemv_q8 with two activation planes (AMX-INT8 from a few rows): the head
                below its packed row limit
    ref_amx     amx built from another source of the kernel (--reference, e.g. a copy of
                `csrc/gemv_q8_cpu.cpp` from before a change): an A/B in one process

Each round times every path once in turn (A B C A B C ...), several calls per timing for
small row counts; the table gives the median ms per call, the fastest run (other jobs only
ever add time) and the ratio to dense, paired per round, and the load average: on a shared
box every number is under that load. With --threads 1 a call is timed by this thread's CPU
time (`time.thread_time`), which other processes on a shared box inflate less; otherwise
by wall clock. The amx and dense outputs are compared once per row count (max abs
difference, argmax agreement).
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

from pagemill.kernels import cpu_native, gemv_q8_cpu
from pagemill.runtime.model_executor.layers.prepacked import prepack, prepacked_linear

N, K = 49152, 576
PATHS = ("amx", "dense", "prepacked", "gemv")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="16,32,64,128,256,512,2048")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=0, help="0: torch's default")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument(
        "--reference", default=None, help="another kernel source: adds the path ref_amx"
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    paths = [p for p in args.paths.split(",") if p]
    ref = None
    if args.reference:
        i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        ref = cpu_native.load_gemv(
            Path(args.reference),
            "pagemill_gemv_q8",
            [i32, ptr, i64, ptr, ptr, i64, i64, i64, i64, i32, i32],
            "the reference Q8_0 kernel",
            "no reference",
        )
        if ref is None or not gemv_q8_cpu.gemm_amx_available(ref):
            raise SystemExit(f"{args.reference} did not build with gemm_q8_amx")
        if "ref_amx" not in paths:
            paths.insert(paths.index("amx") + 1 if "amx" in paths else 0, "ref_amx")
    unknown = set(paths) - set(PATHS) - ({"ref_amx"} if ref is not None else set())
    if unknown:
        raise SystemExit(f"unknown paths {sorted(unknown)}; known: {', '.join(PATHS)}")
    if not gemv_q8_cpu.gemm_amx_available() or not cpu_native.load_gemv_ops():
        raise SystemExit("gemm_q8_amx needs AMX-BF16 and the native operators here")
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=gen)
    d = (torch.rand(N, K // 32, generator=gen) * 2e-3 + 1e-4).half().float()
    blocks = gemv_q8_cpu.pack_q8_blocks(q, d)
    # The embedding as the loader makes it (scales rounded to bf16), which the AMX side then
    # makes too (bf16_scales, as a tied head's layer asks for).
    dense = gemv_q8_cpu.gemm_q8_amx_weights(blocks, N, bf16_scales=True)
    if "prepacked" in paths:
        prepack(dense)

    def run(path: str, x: torch.Tensor) -> torch.Tensor:
        if path == "amx":
            return torch.ops.pagemill_native.gemm_q8_amx(x, blocks, N, True)
        if path == "ref_amx":
            return gemv_q8_cpu.gemm_q8_amx(x, blocks, N, lib=ref, bf16_scales=True)
        if path == "dense":
            return F.linear(x, dense)
        if path == "prepacked":
            return prepacked_linear(x, dense, None)
        return torch.ops.pagemill_native.gemv_q8(x, blocks, N, 2)

    clock: Callable[[], float] = (
        time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    )
    print(
        f"threads {torch.get_num_threads()}, clock {clock.__name__}, head {N} x {K}: Q8_0 tiles "
        f"{blocks.numel() / 1e6:.1f} MB, bf16 {dense.numel() * 2 / 1e6:.1f} MB"
    )
    print(f"{'rows':>5} " + " ".join(f"{p:>21}" for p in paths) + "   amx-dense  load average")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, K, generator=gen).to(torch.bfloat16)
            for p in paths:  # warm: builds, first touch, oneDNN primitives
                run(p, x)
            a, b = run("amx", x).float(), run("dense", x).float()
            agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
            diff = f"{(a - b).abs().max().item():.3g}/{agree:.2f}"
            calls = max(1, 256 // rows)
            times: dict[str, list[float]] = {p: [] for p in paths}
            for _ in range(args.rounds):
                for p in paths:
                    t0 = clock()
                    for _ in range(calls):
                        run(p, x)
                    times[p].append((clock() - t0) * 1e3 / calls)
            cells = []
            for p in paths:
                med, low = statistics.median(times[p]), min(times[p])
                if "dense" in times:
                    ratio = statistics.median(u / v for u, v in zip(times[p], times["dense"]))
                    cells.append(f"{med:6.2f} {low:6.2f} ({ratio:4.2f}x)")
                else:
                    cells.append(f"{med:6.2f} {low:6.2f}")
            load = " ".join(f"{v:.2f}" for v in os.getloadavg())
            print(
                f"{rows:>5} " + " ".join(f"{c:>21}" for c in cells) + f"  {diff:>10}  {load}",
                flush=True,
            )
    print(
        "ms per head call: median, fastest (x dense: median of per-round ratios); "
        "amx-dense: max |difference| / argmax agreement"
    )


if __name__ == "__main__":
    main()
