"""The compile cache's graph against the frozen graph: decode step time, interleaved.

The compile cache (`pagemill.runtime.worker.compilation.CompileCache`) compiles the forward
without inductor's `freezing` (frozen constants bypass AOT autograd's cache), so its dense
linears are plain GEMMs on the weights as graph inputs rather than oneDNN's prepacked
constants, and its packed matmuls are opaque calls. Whether that costs step time decided
the cache's default (on, since the ratio measured within a few percent); rerun it when
torch or the graph changes. On a shared, loaded machine two runs one after the other measure the
load, not the graphs: here both engines live in ONE process and their steps alternate
(A B B A ...), so every slow-down from other jobs lands on both; reported are each side's
median and interquartile range and the median of the per-pair ratios (cache / frozen).

    python benchmarks/compile_cache.py                       # batch 1, 16, 64, 40 pairs
    python benchmarks/compile_cache.py --batch-sizes 1,16,64,256 --pairs 60 --json out.json
    python benchmarks/compile_cache.py --threads 1            # on a busy machine

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

# Time compiled steps: a cold compile cache compiles before the engine is ready, not beside
# eager steps (the engine's default on a cold start).
os.environ.setdefault("PAGEMILL_COMPILE_BACKGROUND", "0")

sys.path.insert(0, str(Path(__file__).parent))
from throughput import MODES, resolve_model_dir

from pagemill.runtime.model_executor.quantization.crossover import PACKED_LIMITS_ENV
from pagemill.runtime.worker.compilation import COMPILE_CACHE_ENV


def make_engine(args: argparse.Namespace, cache: bool) -> Any:
    """One engine, compiled frozen (`cache` False) or as the compile cache compiles."""
    from pagemill.runtime import LLM

    load_format, quantization, _ = MODES[args.mode]
    saved = os.environ.get(COMPILE_CACHE_ENV)
    os.environ[COMPILE_CACHE_ENV] = "1" if cache else "0"
    try:
        t0 = time.perf_counter()
        llm = LLM(
            model=args.model,
            dtype=args.dtype,
            load_format=load_format,
            quantization=quantization,
            max_num_seqs=max(int(s) for s in args.batch_sizes.split(",")),
            kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
            seed=args.seed,
        )
        runner = llm.llm_engine.engine_core.model_runner
        print(
            f"{'cache' if cache else 'frozen'}: ready in {time.perf_counter() - t0:.1f} s "
            f"(compiled {runner.compiled}, cache loaded {runner.compile_cache_loaded})",
            file=sys.stderr,
        )
    finally:
        if saved is None:
            os.environ.pop(COMPILE_CACHE_ENV, None)
        else:
            os.environ[COMPILE_CACHE_ENV] = saved
    return llm


def start_decoding(engine: Any, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """Add the prompts and step until every request has sampled (all decode from now on)."""
    from pagemill.runtime import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"ab-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    seen: set[str] = set()
    while len(seen) < len(ids):
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids:
                seen.add(out.request_id)
    return ids


def stop(engine: Any, ids: list[str]) -> None:
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()


def timed_step(engine: Any, n: int) -> float:
    t0 = time.perf_counter()
    outs = engine.step()
    dt = time.perf_counter() - t0
    if len(outs) != n or any(o.finished for o in outs):
        raise RuntimeError(f"a step with {n} decoding requests returned {len(outs)} outputs")
    return dt


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, med, q3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--mode", default="gguf", choices=[m for m in MODES if "eager" not in m])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--context", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--pairs", type=int, default=40, help="timed A/B pairs per batch size")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per engine first")
    ap.add_argument("--kv-cache-gib", type=float, default=0.5, help="per engine")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (1 on an oversubscribed machine: a parallel region "
        "waits for its slowest thread, and a loaded box deschedules threads)",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    # Both engines must hand packed layers to their dense copies at the same row counts,
    # or their graphs differ by more than freezing: the fixed table, not two measurements.
    os.environ[PACKED_LIMITS_ENV] = "table"
    if args.threads:
        torch.set_num_threads(args.threads)

    model_dir = resolve_model_dir(args.model)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    frozen = make_engine(args, cache=False).llm_engine
    cached = make_engine(args, cache=True).llm_engine
    g = torch.Generator().manual_seed(args.seed)
    result: dict[str, Any] = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "torch": torch.__version__,
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
        "loadavg_start": os.getloadavg(),
        "rows": [],
    }
    max_tokens = args.warmup + args.pairs * 2 + 16
    for n in sorted(int(s) for s in args.batch_sizes.split(",")):
        prompts = [torch.randint(3, vocab, (args.context,), generator=g).tolist() for _ in range(n)]
        ids_a = start_decoding(frozen, prompts, max_tokens)
        ids_b = start_decoding(cached, prompts, max_tokens)
        for _ in range(args.warmup):
            timed_step(frozen, n)
            timed_step(cached, n)
        a: list[float] = []
        b: list[float] = []
        for i in range(args.pairs):
            # A B, then B A: neither side always runs right after the other's step.
            if i % 2 == 0:
                a.append(timed_step(frozen, n))
                b.append(timed_step(cached, n))
            else:
                b.append(timed_step(cached, n))
                a.append(timed_step(frozen, n))
        stop(frozen, ids_a)
        stop(cached, ids_b)
        qa, qb = quartiles(a), quartiles(b)
        ratios = [y / x for x, y in zip(a, b)]
        qr = quartiles(ratios)
        row = {
            "batch_size": n,
            "frozen_ms": [q * 1e3 for q in qa],
            "cache_ms": [q * 1e3 for q in qb],
            "ratio": list(qr),
        }
        result["rows"].append(row)
        print(
            f"  batch {n:4d}: frozen {qa[1] * 1e3:7.2f} ms, cache {qb[1] * 1e3:7.2f} ms, "
            f"cache/frozen {qr[1]:.3f}",
            file=sys.stderr,
        )
    result["loadavg_end"] = os.getloadavg()

    print(
        f"\ndecode step, {args.mode}, {args.context}-token contexts, {args.pairs} interleaved "
        f"pairs per row, {torch.get_num_threads()} threads; load average "
        f"{result['loadavg_start'][0]:.2f} -> {result['loadavg_end'][0]:.2f}"
    )
    print(
        f"{'batch':>6} {'frozen ms (q1-q3)':>24} {'cache ms (q1-q3)':>24} "
        f"{'cache/frozen (q1-q3)':>22}"
    )
    for row in result["rows"]:
        fa, ca, r = row["frozen_ms"], row["cache_ms"], row["ratio"]
        print(
            f"{row['batch_size']:6d} {fa[1]:8.2f} ({fa[0]:6.2f}-{fa[2]:6.2f}) "
            f"{ca[1]:8.2f} ({ca[0]:6.2f}-{ca[2]:6.2f}) {r[1]:9.3f} ({r[0]:.3f}-{r[2]:.3f})"
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
