"""The packed int4 linears of SmolLM2-135M at decode batch sizes (1..64 rows): the AVX-512
GEMV against the AMX-INT8 kernel, and the AMX-INT8 kernel of another source (an older
build) against this one, interleaved in one process.

    uv run python benchmarks/gemv_q4_amx16.py [--rows 1,4,8,16,32,64] [--rounds 30]
        [--old-source PATH] [--planes 2] [--threads N] [--clock wall|cpu]

Per row count, each round times one call per path on each of the four layer shapes (qkv
576->960, o 576->576, gate_up 576->3072, down 1536->576) in turn (A B C A B C ...); the table
gives the median per shape summed: ms per layer. `--old-source` (e.g. the kernel file as
`git show main:...` wrote it) adds its AMX-INT8 kernel as `old_amx`; every path's output is
checked against the GEMV's to the bit first. The load average is printed with the table: on
a shared box every number is under that load. `--clock cpu` times the process's CPU time
(all its threads together: the work, which other processes inflate less than the wall clock;
with OMP_WAIT_POLICY=passive, so that waiting threads do not spin).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time
from pathlib import Path

import torch

from pagemill.kernels import cpu_native
from pagemill.kernels import gemv_q4_cpu as g

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out)


def _load_old(source: Path) -> ctypes.CDLL | None:
    lib = g.load()
    assert lib is not None
    old = cpu_native.load_gemv(
        source,
        "pagemill_gemv_q4",
        lib.pagemill_gemv_q4.argtypes,
        "the old int4 CPU GEMV kernel",
        "leaving it out",
    )
    return g._amx_lib(old)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,8,16,32,64")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--planes", type=int, default=2)
    ap.add_argument("--old-source", type=Path)
    ap.add_argument("--threads", type=int, default=0, help="0: torch's intra-op threads")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    lib = g.load()
    assert lib is not None and g.amx_available(), "needs the AMX-INT8 build"
    old = _load_old(args.old_source) if args.old_source else None
    planes = args.planes
    layers = []
    for k, n in SHAPES:
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        d = (torch.rand(n, k // 32) * 0.01 + 1e-3).half().float()
        m = (-8 * d * torch.rand(n, k // 32)).half().float()
        layers.append((g.pack_q4_blocks(q, d, m + 8 * d, 32), n, k))
    prev = g.set_amx_rows(0)  # `gemv` is the AVX-512 GEMV whatever the default says

    def gemv(x: torch.Tensor, blocks: torch.Tensor, n: int) -> torch.Tensor:
        return g.gemv_q4(x, blocks, n, lib, planes=planes)

    def new_amx(x: torch.Tensor, blocks: torch.Tensor, n: int) -> torch.Tensor:
        return g.gemm_q4_amx(x, blocks, n, lib, planes=planes)

    def old_amx(x: torch.Tensor, blocks: torch.Tensor, n: int) -> torch.Tensor:
        return g.gemm_q4_amx(x, blocks, n, old, planes=planes)

    paths = {"gemv": gemv, "new_amx": new_amx}
    if old is not None:
        paths["old_amx"] = old_amx
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(
        f"planes={planes} threads={torch.get_num_threads()} clock={args.clock} "
        f"load {os.getloadavg()}"
    )
    print("rows  " + "  ".join(f"{p:>9}" for p in paths) + "   gemv/new_amx")
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = [torch.randn(rows, k).to(torch.bfloat16) for _, _, k in layers]
        times: dict[str, list[list[float]]] = {p: [[] for _ in layers] for p in paths}
        for i, (blocks, n, _) in enumerate(layers):
            want = gemv(xs[i], blocks, n)
            for name, fn in paths.items():
                assert torch.equal(fn(xs[i], blocks, n), want), (name, rows, n)
        for _ in range(args.rounds):
            for i, (blocks, n, _) in enumerate(layers):
                for name, fn in paths.items():
                    t0 = clock()
                    fn(xs[i], blocks, n)
                    times[name][i].append(clock() - t0)
        med = {p: sum(statistics.median(t) for t in ts) * 1e3 for p, ts in times.items()}
        print(
            f"{rows:4d}  "
            + "  ".join(f"{med[p]:9.3f}" for p in paths)
            + f"   {med['gemv'] / med['new_amx']:.2f}x"
        )
    g.set_amx_rows(prev)
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
