"""SmolLM2-135M's Q8_0 LM head (49152 x 576) on the CPU at a few rows: the Q8_0 x int8-
activation GEMV (`gemv_q8`) against the path it replaces (the same rows as two int4 planes
on PyTorch's int4 kernel), int8 per channel (`_weight_int8pack_mm`) and a dense bf16 GEMM,
measured interleaved in one process.

    uv run python benchmarks/gemv_q8_cpu.py [--rows 1,4,16] [--rounds 20] [--threads N]

Every path is a real `Linear` (or its weights) built from the same random Q8_0 rows, and
is called the way `compute_logits` calls it (`Linear._packed`: what the packed/dense
crossover measures too). `--copies` heads per path are run in turn, so that each call
streams its weights from memory as in a decode step (a step reads ~100 MB; one head would
stay in a large L3). With --threads 1 each path is timed by this thread's CPU time
(`time.thread_time`), which other processes on a shared box do not inflate; otherwise by
wall clock. The table gives each path's median ms per head call, the paired ratio to
`gemv_q8` x2, and the GB/s it read.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagemill.kernels import gemv_q8_cpu
from pagemill.runtime.model_executor.layers import Linear
from pagemill.runtime.model_executor.quantization import WeightScheme
from pagemill.runtime.model_executor.quantization.formats import (
    Int8Blocks,
    quantize_int8_per_channel,
)

VOCAB, HIDDEN = 49152, 576


def _head(planes: int, q: torch.Tensor, d: torch.Tensor) -> Linear:
    Linear.int8_activations = planes
    layer = Linear(HIDDEN, VOCAB, False, torch.bfloat16)
    layer.scheme = WeightScheme("native")
    layer.load_rows(0, Int8Blocks(q, d, 32))
    return layer


def _bytes(layer: Linear) -> int:
    return layer.packed_nbytes()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--copies", type=int, default=4, help="heads per path, run in turn")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    lib = gemv_q8_cpu.load()
    assert lib is not None, "the kernel did not build"
    isa = gemv_q8_cpu.ISA_NAMES[lib.pagemill_gemv_q8_isa()]
    paths: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {}
    nbytes: dict[str, int] = {}
    saved = Linear.int8_activations
    with torch.inference_mode():
        for c in range(args.copies):
            gen = torch.Generator().manual_seed(c)
            q = torch.randint(-127, 128, (VOCAB, HIDDEN), generator=gen, dtype=torch.int8)
            d = (torch.rand(VOCAB, HIDDEN // 32, generator=gen) * 0.01 + 1e-3).half().float()
            new2, new1, old = _head(2, q, d), _head(1, q, d), _head(0, q, d)
            assert new2.weight_format == "q8_0" and old.weight_format == "int4x2"
            dense = Int8Blocks(q, d, 32).dequantize(torch.float32).to(torch.bfloat16)
            q8pc, s8pc = quantize_int8_per_channel(dense, torch.bfloat16)
            entries = {
                "gemv_q8 x2": (new2._packed, _bytes(new2)),
                "gemv_q8 x1": (new1._packed, _bytes(new1)),
                "int4x2 torch": (old._packed, _bytes(old)),
                "int8 per chan": (
                    lambda x, q8pc=q8pc, s8pc=s8pc: torch.ops.aten._weight_int8pack_mm(
                        x, q8pc, s8pc
                    ),
                    q8pc.numel() + s8pc.numel() * 2,
                ),
                "dense bf16": (lambda x, w=dense: F.linear(x, w), dense.numel() * 2),
            }
            for name, (fn, nb) in entries.items():
                paths.setdefault(name, []).append(fn)
                nbytes[name] = nb
    Linear.int8_activations = saved
    print(
        f"threads {torch.get_num_threads()}, gemv_q8 build {isa}, {args.copies} heads per "
        f"path in turn; clock {clock.__name__}"
    )
    print(f"{'rows':>4} {'path':>14} {'ms/head':>8} {'x q8x2':>7} {'GB/s':>6}")
    with torch.inference_mode():
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, HIDDEN, dtype=torch.bfloat16)
            times: dict[str, list[float]] = {name: [] for name in paths}
            for fns in paths.values():
                for fn in fns:
                    fn(x)
            for _ in range(args.rounds):
                for name, fns in paths.items():
                    for fn in fns:
                        t0 = clock()
                        fn(x)
                        times[name].append(clock() - t0)
            ref = times["gemv_q8 x2"]
            for name, ts in times.items():
                med = statistics.median(ts)
                ratio = statistics.median(t / r for t, r in zip(ts, ref, strict=True))
                print(
                    f"{rows:4d} {name:>14} {med * 1e3:8.3f} {ratio:7.2f} "
                    f"{nbytes[name] / med / 1e9:6.1f}"
                )


if __name__ == "__main__":
    main()
