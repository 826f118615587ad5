"""The linears of SmolLM2-135M on the CPU: the int4 x int8-activation kernel (`gemv_q4`,
one or two activation planes) against PyTorch's int4 kernel and a dense bf16 GEMM (the
dense copy a packed layer keeps for large batches), measured interleaved in one process.

    uv run python benchmarks/gemv_q4_cpu.py [--rows 1,2,4,8,16] [--rounds 30] [--threads N]
    # large batches, against the dense copy:
    uv run python benchmarks/gemv_q4_cpu.py --rows 16,32,64,128,256 --rounds 9 --threads 1 \
        --no-warm-table
    # a change to the kernel, against the source before it (a copy), fp32 activations:
    uv run python benchmarks/gemv_q4_cpu.py --rows 1,4 --reference OLD.cpp --dtype float32

With --threads 1 each path is timed by this thread's CPU time (`time.thread_time`), which
other processes on a shared box do not inflate; otherwise by wall clock.

All 30 layers' projections (qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576)
get their own random Q4_1-like weights, so one sweep streams ~70 MB the way a decode
step does (no layer stays in cache). Each round runs one sweep per path, in turn; the
table gives each path's median sweep ms, the paired ratios (per round) to the new kernel
with two planes and to dense bf16, and the bytes per second it read against this process's
large-tensor read bandwidth (`x.sum()` over 512 MiB, best of a few; meaningful only where
few rows make a sweep bound by reading the weights). A second table times one projection
repeated (cache-warm, one row; `--no-warm-table` skips it). `--reference` builds another
source of the kernel (the one before a change) beside this one: its paths `ref q4 x int8x2`
and `ref q4 x int8` run in the same rounds. `--dtype` is the activations' (bf16 by default;
fp32 where the model is served in fp32, e.g. a CPU without bf16 arithmetic).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pagemill.kernels import cpu_native, gemv_q4_cpu

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
LAYERS = 30
G = 32


def _weights(k: int, n: int) -> dict[str, Any]:
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    d = (torch.rand(n, k // G) * 0.01 + 1e-3).half().float()
    m = (-8 * d * torch.rand(n, k // G)).half().float()
    zeros = m + 8 * d
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
    sz = torch.stack([d, zeros], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    dense = ((q.view(n, k // G, G).float() - 8) * d[..., None] + zeros[..., None]).view(n, k)
    return {
        "blocks": gemv_q4_cpu.pack_q4_blocks(q, d, zeros, G),
        "packed": packed,
        "sz": sz,
        "dense": dense.to(torch.bfloat16),
        "n": n,
    }


def read_bandwidth(seconds: float = 1.0) -> float:
    x = torch.ones(128 << 20, dtype=torch.float32)
    x.sum()
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--no-warm-table", action="store_true", help="skip the one-row table")
    ap.add_argument("--reference", default=None, help="another source of the kernel: ref paths")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    # One thread: this thread's CPU time, which a loaded box does not inflate much.
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    lib = gemv_q4_cpu.load()
    assert lib is not None, "the kernel did not build"
    isa = gemv_q4_cpu.ISA_NAMES[lib.pagemill_gemv_q4_isa()]
    ref = None
    if args.reference:
        i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        ref = cpu_native.load_gemv(
            Path(args.reference),
            "pagemill_gemv_q4",
            [i32, ptr, i64, ptr, i32, ptr, i64, i64, i64, i64, i32, i32],
            "the reference int4 kernel",
            "no reference",
        )
        if ref is None:
            raise SystemExit(f"{args.reference} did not build")
    layers = [(name, _weights(*shape)) for _ in range(LAYERS) for name, shape in SHAPES.items()]
    packed_bytes = sum(w["blocks"].numel() for _, w in layers)
    bytes_per = {
        "new q4 x int8x2": packed_bytes,
        "new q4 x int8": packed_bytes,
        **({"ref q4 x int8x2": packed_bytes, "ref q4 x int8": packed_bytes} if ref else {}),
        "torch int4": sum(w["packed"].numel() + w["sz"].numel() * 2 for _, w in layers),
        "dense bf16": sum(w["dense"].numel() * 2 for _, w in layers),
    }
    bw = read_bandwidth()
    print(
        f"threads {torch.get_num_threads()}, kernel build {isa}, read bandwidth "
        f"{bw / 1e9:.1f} GB/s; one sweep = {len(layers)} linears; clock {clock.__name__}"
    )

    def sweep(
        kind: str, x: dict[int, torch.Tensor], xb: dict[int, torch.Tensor]
    ) -> Callable[[], None]:
        """`xb`: x in bf16 for PyTorch's paths, converted once outside the timing."""

        def run() -> None:
            for name, w in layers:
                xi, xbi = x[SHAPES[name][0]], xb[SHAPES[name][0]]
                if kind.startswith(("new", "ref")):
                    planes = 2 if kind.endswith("x2") else 1
                    which = lib if kind.startswith("new") else ref
                    gemv_q4_cpu.gemv_q4(xi, w["blocks"], w["n"], which, planes=planes)
                elif kind == "torch int4":
                    torch.ops.aten._weight_int4pack_mm_for_cpu(xbi, w["packed"], G, w["sz"])
                else:
                    F.linear(xbi, w["dense"])

        return run

    print(
        f"{'rows':>4} {'path':>16} {'sweep ms':>9} {'x new':>6} {'x dense':>7} {'GB/s':>6} "
        f"{'% of read bw':>12}"
    )
    for rows in [int(r) for r in args.rows.split(",")]:
        x = {k: torch.randn(rows, k, dtype=dtype) for k in (576, 1536)}
        xb = {k: v.to(torch.bfloat16) for k, v in x.items()}
        runs = {kind: sweep(kind, x, xb) for kind in bytes_per}
        times: dict[str, list[float]] = {kind: [] for kind in runs}
        for fn in runs.values():
            fn()
        for _ in range(args.rounds):
            for kind, fn in runs.items():
                t0 = clock()
                fn()
                times[kind].append(clock() - t0)
        new, dense = times["new q4 x int8x2"], times["dense bf16"]
        for kind, ts in times.items():
            med = statistics.median(ts)
            ratio = statistics.median(t / b for t, b in zip(ts, new, strict=True))
            to_dense = statistics.median(t / b for t, b in zip(ts, dense, strict=True))
            gbs = bytes_per[kind] / med / 1e9
            print(
                f"{rows:4d} {kind:>16} {med * 1e3:9.2f} {ratio:6.2f} {to_dense:7.2f} {gbs:6.1f} "
                f"{100 * gbs * 1e9 / bw:11.0f}%"
            )

    if args.no_warm_table:
        return

    print("\none projection repeated (cache-warm), rows 1, median us per call:")
    for name, (k, _) in SHAPES.items():
        w = next(w for nm, w in layers if nm == name)
        x1 = torch.randn(1, k, dtype=dtype)
        x1b = x1.to(torch.bfloat16)
        fns = {
            "new x2": partial(gemv_q4_cpu.gemv_q4, x1, w["blocks"], w["n"], lib),
            "new x1": partial(gemv_q4_cpu.gemv_q4, x1, w["blocks"], w["n"], lib, planes=1),
            **(
                {
                    "ref x2": partial(gemv_q4_cpu.gemv_q4, x1, w["blocks"], w["n"], ref),
                    "ref x1": partial(gemv_q4_cpu.gemv_q4, x1, w["blocks"], w["n"], ref, planes=1),
                }
                if ref
                else {}
            ),
            "torch int4": partial(
                torch.ops.aten._weight_int4pack_mm_for_cpu, x1b, w["packed"], G, w["sz"]
            ),
            "dense": partial(F.linear, x1b, w["dense"]),
        }
        per_call: dict[str, list[float]] = {kk: [] for kk in fns}
        for _ in range(args.rounds * 10):
            for kk, fn in fns.items():
                t0 = clock()
                fn()
                per_call[kk].append(clock() - t0)
        print(
            f"  {name:>8} "
            + "  ".join(f"{kk} {statistics.median(v) * 1e6:7.1f}" for kk, v in per_call.items())
        )


if __name__ == "__main__":
    main()
