"""Where a prefill step's time goes, by torch.profiler: N prompts of CTX tokens at once.

    python benchmarks/prefill_profile.py --prompts 16 --context 128
    python benchmarks/prefill_profile.py --prompts 1 --context 2048 --inductor-kernels
    python benchmarks/prefill_profile.py --prompts 16 --context 128 --compare

The default model with default flags (as `pagemill serve` would load it). Each wave adds
--prompts requests of --context random tokens with one output token each and steps the
engine until they finish (one prefill step when the scheduler's token budget holds them
all); --warmup waves run first, then --timed-waves unprofiled ones (wall time only), then
--waves profiled ones. The step's phases and the
forward's op groups are `step_profile`'s (same instrumentation, same grouping), per wave.
The KV cache is pre-faulted (every page written once) unless --no-prefault-kv: a fresh
cache's first-touch page faults would be charged to the KV write.

--compare runs the prefill attention paths in turn, wave after wave (A B C A B C: the
box's speed drifts, so only interleaved runs compare): one SDPA call per prompt (the path
before batching), equal fresh prompts batched into one SDPA call, and the native kernel
(`PAGEMILL_NATIVE_PREFILL`, read when a step is planned). It prints each path's median
wave time and attention time.

--inductor-kernels compiles with inductor's per-kernel profiling (its own compile-cache
folder) and prints each generated loop's time, as `step_profile --inductor-kernels`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_profile  # the sibling benchmark: instrumentation and grouping


@contextmanager
def _path(name: str) -> Iterator[None]:
    """Plan the prefill attention for one of --compare's paths while inside."""
    import pagemill.kernels.attention_cpu as attention_cpu

    saved_env = os.environ.get("PAGEMILL_NATIVE_PREFILL")
    saved_batches = attention_cpu._plan_batches
    os.environ["PAGEMILL_NATIVE_PREFILL"] = "1" if name == "native" else "0"
    if name == "per-prompt SDPA":

        def singles(segs: list[Any], block_size: int) -> tuple[tuple[()], tuple[int, ...]]:
            return (), tuple(range(len(segs)))

        attention_cpu._plan_batches = singles
    try:
        yield
    finally:
        attention_cpu._plan_batches = saved_batches
        if saved_env is None:
            os.environ.pop("PAGEMILL_NATIVE_PREFILL", None)
        else:
            os.environ["PAGEMILL_NATIVE_PREFILL"] = saved_env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--context", type=int, default=128, help="tokens per prompt")
    ap.add_argument("--warmup", type=int, default=3, help="unprofiled waves first")
    ap.add_argument("--waves", type=int, default=3, help="profiled waves (per path)")
    ap.add_argument("--timed-waves", type=int, default=5, help="unprofiled timed waves (per path)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--top-ops", type=int, default=20)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--no-prefault-kv", action="store_true")
    ap.add_argument("--compare", action="store_true", help="the attention paths, interleaved")
    ap.add_argument(
        "--inductor-kernels",
        action="store_true",
        help="time each generated C++ loop (compiles with inductor's kernel profiling)",
    )
    args = ap.parse_args()
    if args.inductor_kernels:
        step_profile._profile_kernels()
    if args.threads:
        torch.set_num_threads(args.threads)

    from pagemill.runtime import LLM, SamplingParams
    from pagemill.runtime.model_executor.default_model import ensure_default_model

    t0 = time.perf_counter()
    llm = LLM(model=str(ensure_default_model()), enforce_eager=args.enforce_eager, seed=0)
    print(f"engine ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    engine = llm.llm_engine
    core = engine.engine_core
    step_profile.instrument(core)
    if not args.no_prefault_kv:
        kv_cache = core.model_runner.kv_cache
        assert kv_cache is not None
        for k, v in kv_cache.caches:
            k.view(torch.uint8).zero_()
            v.view(torch.uint8).zero_()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    vocab = core.model_runner.vocab_size
    count = 0

    def wave() -> list[float]:
        nonlocal count
        for _ in range(args.prompts):
            prompt = torch.randint(3, vocab, (args.context,), generator=g).tolist()
            engine.add_request(f"r{count}", prompt, params)
            count += 1
        walls = []
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t)
        return walls

    paths = ["per-prompt SDPA", "batched SDPA", "native"] if args.compare else [None]

    def run(name: str | None, fn: Callable[[], list[float]]) -> list[float]:
        if name is None:
            return fn()
        with _path(name):
            return fn()

    for i in range(args.warmup):
        for name in paths:
            walls = run(name, wave)
            print(f"warmup {i} {name or ''}: steps {[round(w * 1e3, 1) for w in walls]} ms")
    # Unprofiled waves first: the profiler's own cost per op is not in these.
    timed: dict[str | None, list[float]] = {name: [] for name in paths}
    for _ in range(args.timed_waves):
        for name in paths:
            timed[name].append(sum(run(name, wave)) * 1e3)
    for name in paths:
        if timed[name]:
            print(
                f"unprofiled {name or 'wave'}: median {statistics.median(timed[name]):.1f} ms, "
                f"min {min(timed[name]):.1f} ms ({len(timed[name])} waves)"
            )
    results: dict[str | None, tuple[list[float], list[dict[str, float]]]] = {
        name: ([], []) for name in paths
    }
    for _ in range(args.waves):
        for name in paths:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                walls = run(name, wave)
            totals, top = step_profile.breakdown(prof, 1, args.top_ops)
            results[name][0].append(sum(walls) * 1e3)
            results[name][1].append(totals)
            last = (totals, top, prof)
    for name in paths:
        waves, totals = results[name]
        keys = sorted(
            {k for t in totals for k in t},
            key=lambda k: -statistics.median([t.get(k, 0.0) for t in totals]),
        )
        print(
            f"\n{args.prompts} x {args.context} tokens{' [' + name + ']' if name else ''}: "
            f"wave {statistics.median(waves):.1f} ms (median of {len(waves)}, profiled)"
        )
        for key in keys:
            ms = statistics.median([t.get(key, 0.0) for t in totals])
            print(f"  {key:<46}{ms:9.2f} ms")
    if not args.compare:
        _, top, prof = last
        print("  top ops (last wave):")
        for line in top:
            print("   ", line)
        if args.inductor_kernels:
            print("\n".join(step_profile.kernel_table(prof, 1)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
