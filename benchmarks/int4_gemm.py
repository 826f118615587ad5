"""The int4-group dequantizing GEMM (AWQ / GPTQ / w4a16 weights) against a dense GEMM of the
same shape, on Llama-3.1-8B's projections.

    python benchmarks/int4_gemm.py [--cpu] [--json out.json]

Per (projection, rows): milliseconds of the Triton kernel and of torch's dense fp16/bf16
matmul, the weight bytes each reads (int4 + scales/zeros vs dense) and the kernel's
effective bandwidth, and its relative error against the torch path. --cpu runs the torch
path on tiny shapes (a dry run of this script; the interpreter is too slow to time).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from pagemill.kernels import int4_group_gemm, int4_group_gemm_torch, pack_int4_groups

LLAMA_8B = {"qkv": (4096, 6144), "gate_up": (4096, 28672), "down": (14336, 4096)}
TINY = {"qkv": (64, 128), "down": (128, 64)}


def _time(fn: Callable[[], object], iters: int, cuda: bool) -> float:
    for _ in range(3):
        fn()
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def run(cpu: bool, rows: tuple[int, ...] = (1, 16, 256), iters: int = 50) -> dict[str, Any]:
    device = torch.device("cpu" if cpu else "cuda")
    dtype = torch.bfloat16
    shapes = TINY if cpu else LLAMA_8B
    g = 32 if cpu else 128
    out: dict[str, Any] = {"device": str(device), "dtype": "bf16", "group_size": g, "rows": []}
    gen = torch.Generator().manual_seed(0)
    for name, (k, n) in shapes.items():
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        scales = torch.rand(n, k // g, generator=gen) * 0.02 + 0.001
        zeros = torch.randn(n, k // g, generator=gen) * 0.01
        qweight, s, z = (t.to(device) for t in pack_int4_groups(q, scales, zeros, dtype))
        dense = torch.randn(k, n, generator=gen).to(dtype).to(device)
        packed_bytes = qweight.numel() * 4 + 2 * s.numel() * s.element_size()
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(dtype).to(device)
            got = int4_group_gemm(x, qweight, s, z, g)
            want = int4_group_gemm_torch(x, qweight, s, z, g)
            err = ((got.double() - want.double()).norm() / want.double().norm()).item()
            ms = _time(partial(int4_group_gemm, x, qweight, s, z, g), iters, not cpu)
            dense_ms = _time(partial(torch.matmul, x, dense), iters, not cpu)
            out["rows"].append(
                {
                    "proj": name,
                    "k": k,
                    "n": n,
                    "m": m,
                    "ms": ms,
                    "dense_ms": dense_ms,
                    "speedup_vs_dense": dense_ms / ms,
                    "weight_bytes": packed_bytes,
                    "dense_weight_bytes": dense.numel() * dense.element_size(),
                    "gb_per_s": packed_bytes / ms / 1e6,
                    "rel_err": err,
                }
            )
    return out


def print_report(report: dict[str, Any]) -> None:
    print(f"# int4-group GEMM, {report['device']}, {report['dtype']}, g={report['group_size']}")
    print(f"{'proj':8s} {'m':>5s} {'ms':>8s} {'dense ms':>9s} {'x dense':>8s} {'GB/s':>8s} err")
    for r in report["rows"]:
        print(
            f"{r['proj']:8s} {r['m']:5d} {r['ms']:8.3f} {r['dense_ms']:9.3f} "
            f"{r['speedup_vs_dense']:8.2f} {r['gb_per_s']:8.1f} {r['rel_err']:.1e}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    report = run(args.cpu, iters=3 if args.cpu else 50)
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
