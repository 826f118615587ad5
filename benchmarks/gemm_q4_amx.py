"""Packed int4 linears of SmolLM2-135M on the AMX tiles against the other CPU paths, whole
model per batch size, interleaved in one process.

    uv run python benchmarks/gemm_q4_amx.py [--rows 1,8,16,32,64,128,256,1024,2048]
        [--rounds 7] [--threads N] [--paths amx_bf16,amx_int8,vnni,dense,torch_int4]
        [--reference OLD.cpp]

Paths, each over all 120 packed linears of the model (30 layers of qkv 576->960, o
576->576, gate_up 576->3072, down 1536->576; the Q8_0 LM head is not int4 and is left out):

    amx_bf16    gemm_q4_amx planes=0: weight blocks decompressed to bf16 tiles, AMX-BF16
    amx_int8    gemm_q4_amx planes=1: gemv_q4's int8 activations on AMX-INT8 tiles
    amx_int8x2  the same with two activation planes
    vnni        gemv_q4 planes=1 (AVX512-VNNI), the packed path below the crossover
    vnni2       gemv_q4 planes=2
    dense       F.linear on a dense bf16 copy (oneDNN, AMX-BF16): the path above it today
    torch_int4  aten._weight_int4pack_mm_for_cpu, PyTorch's int4 kernel (the default)
    ref_bf16    amx_bf16 built from another source of the kernel (--reference, e.g. a copy
                of `csrc/gemv_q4_cpu.cpp` from before a change): an A/B in one process

Each layer has its own random Q4_1-like weights, so a sweep streams the model's weight bytes
as a step does. Each round times one sweep per path in turn (A B C A B C ...); the table
gives the median sweep ms per path and its ratio to dense, paired per round. With
--threads 1 a sweep is timed by this thread's CPU time (`time.thread_time`), which other
processes on a shared box inflate less; otherwise by wall clock. The load average is
printed with the table: on a shared box every number is under that load.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pagemill.kernels import cpu_native, gemv_q4_cpu

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
LAYERS = 30
G = 32
PATHS = ("amx_bf16", "amx_int8", "amx_int8x2", "vnni", "vnni2", "dense", "torch_int4")
DEFAULT_PATHS = PATHS
_REF: list[Any] = []  # the --reference build


def _weights(k: int, n: int, gen: torch.Generator) -> dict[str, Any]:
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n, k // G, generator=gen) * 0.01 + 1e-3).half().float()
    m = (-8 * d * torch.rand(n, k // G, generator=gen)).half().float()
    zeros = m + 8 * d
    blocks = gemv_q4_cpu.pack_q4_blocks(q, d, zeros, G)
    return {
        "blocks": blocks,
        "packed": torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2),
        "sz": torch.stack([d, zeros], -1).transpose(0, 1).contiguous().to(torch.bfloat16),
        "dense": gemv_q4_cpu.dequantize_q4_blocks(blocks, n).to(torch.bfloat16),
        "n": n,
    }


def _sweep(path: str, layers: list[dict[str, Any]], xs: dict[int, torch.Tensor]) -> None:
    for w in layers:
        x = xs[w["blocks"].shape[1] * G]
        if path == "dense":
            F.linear(x, w["dense"])
        elif path == "torch_int4":
            torch.ops.aten._weight_int4pack_mm_for_cpu(x, w["packed"], G, w["sz"])
        elif path == "ref_bf16":
            gemv_q4_cpu.gemm_q4_amx(x, w["blocks"], w["n"], lib=_REF[0], planes=0)
        elif path.startswith("vnni"):
            gemv_q4_cpu.gemv_q4(x, w["blocks"], w["n"], planes=2 if path == "vnni2" else 1)
        else:
            planes = {"amx_bf16": 0, "amx_int8": 1, "amx_int8x2": 2}[path]
            gemv_q4_cpu.gemm_q4_amx(x, w["blocks"], w["n"], planes=planes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,16,32,64,128,256,1024,2048")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="0: torch's default")
    ap.add_argument("--paths", default=",".join(DEFAULT_PATHS))
    ap.add_argument(
        "--reference", default=None, help="another kernel source: adds the path ref_bf16"
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    paths = [p for p in args.paths.split(",") if p]
    if args.reference:
        ref = cpu_native.load_gemv(
            Path(args.reference),
            "pagemill_gemv_q4",
            [
                ctypes.c_int,
                ctypes.c_void_p,
                ctypes.c_int64,
                ctypes.c_void_p,
                ctypes.c_int,
                ctypes.c_void_p,
            ]
            + [ctypes.c_int64] * 4
            + [ctypes.c_int] * 2,
            "the reference int4 kernel",
            "no reference",
        )
        if ref is None:
            raise SystemExit(f"{args.reference} did not build")
        _REF.append(ref)
        if "ref_bf16" not in paths:
            paths.insert(paths.index("amx_bf16") + 1 if "amx_bf16" in paths else 0, "ref_bf16")
    unknown = set(paths) - set(PATHS) - ({"ref_bf16"} if _REF else set())
    if unknown:
        raise SystemExit(f"unknown paths {sorted(unknown)}; known: {', '.join(PATHS)}")
    if not gemv_q4_cpu.amx_available():
        print("no AMX here: the amx_* paths run their fallbacks (gemv_q4 / a dequantized copy)")
    clock: Callable[[], float] = (
        time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    )
    gen = torch.Generator().manual_seed(0)
    layers = [_weights(k, n, gen) for _ in range(LAYERS) for k, n in SHAPES.values()]
    print(
        f"threads {torch.get_num_threads()}, clock {clock.__name__}, {len(layers)} linears, "
        f"int4 blocks {sum(w['blocks'].numel() for w in layers) / 1e6:.1f} MB, "
        f"dense bf16 {sum(w['dense'].numel() * 2 for w in layers) / 1e6:.1f} MB"
    )
    print(f"{'rows':>5} " + " ".join(f"{p:>17}" for p in paths) + "   load average")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for k in (576, 1536)}
        for p in paths:  # warm: builds, first-touch, oneDNN primitives
            _sweep(p, layers, xs)
        times: dict[str, list[float]] = {p: [] for p in paths}
        for _ in range(args.rounds):
            for p in paths:
                t0 = clock()
                _sweep(p, layers, xs)
                times[p].append((clock() - t0) * 1e3)
        cells = []
        for p in paths:
            med = statistics.median(times[p])
            if "dense" in times:
                ratio = statistics.median(a / b for a, b in zip(times[p], times["dense"]))
                cells.append(f"{med:8.2f} ({ratio:4.2f}x)")
            else:
                cells.append(f"{med:17.2f}")
        load = " ".join(f"{v:.2f}" for v in os.getloadavg())
        print(f"{rows:>5} " + " ".join(f"{c:>17}" for c in cells) + f"   {load}", flush=True)
    print("ms per whole-model sweep (median), (x dense: median of per-round ratios)")


if __name__ == "__main__":
    main()
