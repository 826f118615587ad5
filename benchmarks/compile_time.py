"""Where a start's compilation goes: one engine built in this process, its compile timed.

The compile cache's folder is a fresh temporary one (so dynamo traces: a "new key" start),
and inductor's on-disk cache is either pagemill's own (`--inductor warm`: generated code
and C++ builds cached, what a start after a pagemill upgrade sees) or a fresh one too
(`--inductor cold`: a first start). Then, with `--warm`, the same engine is built again
in this process against the folder just written: the compile cache loads instead of tracing.
Reported: each graph's seconds (from the runner's log), torch's own per-phase totals
(`torch._dynamo.utils.compile_times`), and process CPU seconds beside wall seconds, since
on a shared machine the wall clock measures the load as much as the compile.

    python benchmarks/compile_time.py                        # default model, inductor warm
    python benchmarks/compile_time.py --inductor cold --warm
    python benchmarks/compile_time.py --profile prof.out     # cProfile (CPU clock) of it
    python benchmarks/compile_time.py --regional 1 --warm    # one graph per layer group

Figures are printed (and written to --json); nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Time compiled steps: a cold compile cache compiles before the engine is ready, not beside
# eager steps (the engine's default on a cold start).
os.environ.setdefault("PAGEMILL_COMPILE_BACKGROUND", "0")


def build(args: argparse.Namespace) -> tuple[float, float, Any]:
    from pagemill.runtime import LLM

    kwargs: dict[str, Any] = dict(model=args.model, dtype=args.dtype, seed=0)
    if args.max_num_seqs:
        kwargs["max_num_seqs"] = args.max_num_seqs
    w0, c0 = time.perf_counter(), time.process_time()
    llm = LLM(**kwargs)
    return time.perf_counter() - w0, time.process_time() - c0, llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=0)
    ap.add_argument("--inductor", choices=("warm", "cold"), default="warm")
    ap.add_argument(
        "--regional",
        choices=("0", "1"),
        help="PAGEMILL_COMPILE_REGIONAL for this run (default: the environment's)",
    )
    ap.add_argument("--warm", action="store_true", help="then build again, loading the cache")
    ap.add_argument(
        "--compile-dir",
        type=Path,
        help="the compile cache's folder (default: a fresh one); an earlier run's, to time a "
        "warm start in a fresh process",
    )
    ap.add_argument("--profile", help="write a cProfile (process CPU clock) of the cold build")
    ap.add_argument("--json")
    args = ap.parse_args()

    if args.regional is not None:
        os.environ["PAGEMILL_COMPILE_REGIONAL"] = args.regional
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    tmp = Path(tempfile.mkdtemp(prefix="pagemill-compile-time-"))
    if args.inductor == "cold":
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / "inductor")
    import torch

    from pagemill.runtime.worker import compilation

    root = args.compile_dir or tmp / "compiled"
    print(f"compile cache folder: {root}", file=sys.stderr)
    compilation.CompileCache.root = staticmethod(lambda: root)  # type: ignore[method-assign]
    result: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads()}

    if args.profile:
        import cProfile

        prof = cProfile.Profile(time.process_time)
        prof.enable()
    wall, cpu, llm = build(args)
    if args.profile:
        prof.disable()
        prof.dump_stats(args.profile)
    runner = llm.llm_engine.engine_core.model_runner
    result["first"] = {"wall_s": wall, "cpu_s": cpu, "loaded": runner.compile_cache_loaded}
    from torch._dynamo.utils import compile_times

    print(compile_times(repr="str", aggregate=True), file=sys.stderr)
    print(
        f"first build: {wall:.1f} s wall, {cpu:.1f} s CPU (loaded {runner.compile_cache_loaded})",
        file=sys.stderr,
    )
    del llm
    if args.warm:
        torch._dynamo.reset()
        wall, cpu, llm = build(args)
        runner = llm.llm_engine.engine_core.model_runner
        result["warm"] = {"wall_s": wall, "cpu_s": cpu, "loaded": runner.compile_cache_loaded}
        print(
            f"warm build: {wall:.1f} s wall, {cpu:.1f} s CPU "
            f"(loaded {runner.compile_cache_loaded})",
            file=sys.stderr,
        )
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
