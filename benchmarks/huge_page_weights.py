"""Packed weights on 4 KB pages vs in one huge-page mapping (`huge_page_weights`), at one row.

    uv run python benchmarks/huge_page_weights.py [--rounds 8] [--sweeps 15] [--model M]

Loads the default model in bf16 (its layers packed, as served) with the weights left on
the pages loading put them on (`PAGEMILL_HUGE_PAGE_WEIGHTS=0`), then alternates in one
process: every packed linear called once at one row (a batch-1 step's weight stream, LM
head included, eager) with the weights copied to fresh malloc memory (4 KB pages), then
moved by `place_packed_weights` into one huge-page mapping. Each state is timed warm
(weights as the last sweep left them in cache) and cold (a buffer twice the last-level
cache written between sweeps). Also the box's large-tensor read bandwidth, for the floor.
Figures are printed (and written to --json); nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

os.environ["PAGEMILL_HUGE_PAGE_WEIGHTS"] = "0"  # load as before; moved below, in turn


def read_gb_s() -> float:
    x = torch.ones(512 << 20, dtype=torch.uint8).view(torch.float32)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.nbytes / best / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--sweeps", type=int, default=15, help="timed sweeps per state and round")
    ap.add_argument("--flush-mib", type=int, default=96, help="written between cold sweeps")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    from pagemill.runtime import LLM
    from pagemill.runtime.model_executor import huge_page_weights as hpw
    from pagemill.runtime.model_executor.layers.linear import Linear

    kwargs: dict[str, Any] = {"model": args.model} if args.model else {}
    llm = LLM(
        dtype="bfloat16",
        max_num_seqs=1,
        max_model_len=256,
        kv_cache_memory_bytes=16 << 20,
        enforce_eager=True,  # no compile: only the layers are timed
        **kwargs,
    )
    model = llm.llm_engine.engine_core.model_runner.model
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.qweight is not None]
    if not layers:
        print("no packed layers: nothing to compare (a CPU without the packed paths?)")
        return 1
    xs = {m.in_features: torch.randn(1, m.in_features, dtype=torch.bfloat16) for m in layers}
    flush = torch.zeros(args.flush_mib << 20, dtype=torch.uint8)

    def sweep(cold: bool) -> float:
        times = []
        with torch.inference_mode():
            for _ in range(args.sweeps):
                if cold:
                    flush.add_(1)
                t0 = time.perf_counter()
                for m in layers:
                    m(xs[m.in_features])
                times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    def to_small_pages() -> None:
        for module in model.modules():
            for name, t in list(module._buffers.items()):
                if name in hpw.PACKED_BUFFERS and t is not None:
                    module._buffers[name] = t.clone()

    os.environ[hpw.HUGE_PAGE_WEIGHTS_ENV] = "1"
    times: dict[str, dict[str, list[float]]] = {s: {"cold": [], "warm": []} for s in ("4k", "huge")}
    placed = None
    for r in range(args.rounds):
        for state in ("4k", "huge"):
            if state == "huge":
                placed = hpw.place_packed_weights(model)
            else:
                to_small_pages()
            for kind in ("cold", "warm"):
                sweep(kind == "cold")  # settle
                times[state][kind].append(sweep(kind == "cold"))
        print(
            f"round {r}: "
            + ", ".join(f"{s} {k} {v[-1]:.3f} ms" for s, d in times.items() for k, v in d.items()),
            file=sys.stderr,
        )
    bandwidth = read_gb_s()
    nbytes = placed.nbytes if placed is not None else 0
    result: dict[str, Any] = {
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "layers": len(layers),
        "packed_mib": nbytes / 2**20,
        "huge_page_mib": (placed.huge_nbytes / 2**20) if placed is not None else 0,
        "read_gb_s": bandwidth,
        "floor_ms": nbytes / (bandwidth * 1e9) * 1e3,
    }
    print(placed.summary() if placed is not None else "nothing placed")
    print(f"read bandwidth {bandwidth:.1f} GB/s: floor {result['floor_ms']:.2f} ms for the sweep")
    for kind in ("cold", "warm"):
        small = statistics.median(times["4k"][kind])
        huge = statistics.median(times["huge"][kind])
        # Each round's pair ran back to back: the median of their ratios shrugs off a round
        # the box was busy for, which the medians of the times alone do not.
        paired = statistics.median(h / s for s, h in zip(times["4k"][kind], times["huge"][kind]))
        result[kind] = {"4k_ms": small, "huge_ms": huge, "huge_over_4k_paired": paired}
        print(
            f"{kind}: 4 KB pages {small:.3f} ms, huge pages {huge:.3f} ms (medians); "
            f"huge / 4 KB per round, median {paired:.3f}x"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
