"""Where a batch-1 decode step of the default model goes, against its weight-streaming floor,
in one process: PyTorch's int4 kernel (`PAGEMILL_CPU_INT8_ACTIVATIONS=0`) and pagemill's
`gemv_q4` / `gemv_q8` with two int8 activation planes (`=2`) through the Python custom ops
and through the C++ operators, all compiled.

    uv run python benchmarks/gemv_batch1.py [--pairs 20] [--sweeps 20] [--profile] [--regional]

Measured, interleaved where they compete for the same machine:
- the floor: the bytes a small step reads (`weight_report`) / large-tensor read bandwidth
  (`x.sum()` over 512 MiB, best of a few), taken again at the end (a loaded box moves it);
- the compiled batch-1 step of each engine (`engine.step()` wall time, steps alternated);
- the packed matmuls alone at one row: every packed linear of each engine, LM head included,
  called as the compiled graph calls it (`torch.ops.pagemill[_native].gemv_q4` / `gemv_q8`,
  or the int4 op) in one sweep, and the same sweep on the kernels' own entry points
  (ctypes, aten): the difference is the op's per-call cost times the calls;
- the per-call cost of each path on a tiny input (one tile, one block), and of a plain
  aten op for scale.
`--profile` adds a torch.profiler table of a few steps per engine (self CPU by op).

Each engine compiles into its own cache folder under --cache-root (kept, so a second run
loads its graphs). Figures are printed (and written to --json); nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# Time compiled steps: a cold compile cache compiles before the engine is ready, not beside
# eager steps (the engine's default on a cold start).
os.environ.setdefault("PAGEMILL_COMPILE_BACKGROUND", "0")

sys.path.insert(0, str(Path(__file__).parent))
from compile_cache import start_decoding, stop
from throughput import machine_limits, resolve_model_dir

from pagemill.kernels import cpu_native, gemv_q4_cpu, gemv_q8_cpu
from pagemill.runtime.model_executor.layers import Linear
from pagemill.runtime.model_executor.quantization.report import weight_report

# name -> (PAGEMILL_CPU_INT8_ACTIVATIONS, the GEMV kernels as C++ torch operators)
MODES = {
    "int4 (=0)": (0, False),
    "=2, Python ops": (2, False),
    "=2, C++ ops": (2, True),
}


def make_engine(args: argparse.Namespace, planes: int, native: bool, root: Path) -> Any:
    from pagemill.runtime import LLM
    from pagemill.runtime.worker import compilation

    saved_root = compilation.CompileCache.root
    saved_planes = Linear.int8_activations
    where = root / f"planes{planes}{'-cxx' if native else ''}"
    compilation.CompileCache.root = staticmethod(lambda: where)  # type: ignore[method-assign]
    Linear.int8_activations = planes
    if args.regional:
        os.environ[compilation.REGIONAL_ENV] = "1"
    # The operators load once per process: the engine without them is built first.
    if not native:
        os.environ[cpu_native.GEMV_OPS_ENV] = "0"
    cpu_native.load_gemv_ops.cache_clear()
    t0 = time.perf_counter()
    try:
        llm = LLM(
            model=args.model,
            dtype="bfloat16",
            max_num_seqs=1,
            max_model_len=512,
            kv_cache_memory_bytes=64 << 20,
            seed=0,
        )
    finally:
        compilation.CompileCache.root = saved_root  # type: ignore[method-assign]
        Linear.int8_activations = saved_planes
        os.environ.pop(cpu_native.GEMV_OPS_ENV, None)
        cpu_native.load_gemv_ops.cache_clear()
    runner = llm.llm_engine.engine_core.model_runner
    for k, v in runner.kv_cache.caches:  # pre-fault the pool
        k.view(torch.uint8).zero_()
        v.view(torch.uint8).zero_()
    print(
        f"engine planes={planes} native={native}: ready in {time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
    )
    return llm


def packed_layers(llm: Any) -> list[Linear]:
    model = llm.llm_engine.engine_core.model_runner.model
    return [m for m in model.modules() if isinstance(m, Linear) and m.format != "dense"]


def op_sweep(layers: list[Linear], direct: bool) -> Callable[[], None]:
    """One row through every packed layer, the ops called as the compiled graph calls them,
    or (`direct`) the kernels' own entry points (ctypes for gemv_q4 / gemv_q8, aten for
    PyTorch's int4 kernel)."""
    calls: list[Callable[[], Any]] = []
    for m in layers:
        x = torch.randn(1, m.in_features, dtype=torch.bfloat16)
        assert m.qweight is not None
        if m.int8_act:
            q8 = m.format == "q8_0"
            if direct:
                fn = gemv_q8_cpu.gemv_q8 if q8 else gemv_q4_cpu.gemv_q4
                calls.append(
                    lambda fn=fn, x=x, m=m: fn(x, m.qweight, m.out_features, planes=m.int8_act)
                )
                continue
            ns = torch.ops.pagemill_native if m.native_gemv else torch.ops.pagemill
            op = ns.gemv_q8 if q8 else ns.gemv_q4
            calls.append(lambda op=op, x=x, m=m: op(x, m.qweight, m.out_features, m.int8_act))
        else:
            if m.int4_planes == 2:
                x = torch.cat([x, x], dim=-1).contiguous()
            op = (
                torch.ops.aten._weight_int4pack_mm_for_cpu
                if direct
                else torch.ops.pagemill.weight_int4pack_mm
            )
            calls.append(lambda op=op, x=x, m=m: op(x, m.qweight, m.group_size, m.scales_and_zeros))

    def run() -> None:
        for c in calls:
            c()

    return run


def per_call_us(fn: Callable[[], Any], n: int = 2000) -> float:
    for _ in range(50):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def tiny_calls() -> dict[str, float]:
    x = torch.randn(1, 32, dtype=torch.bfloat16)
    q = torch.randint(0, 16, (16, 32), dtype=torch.uint8)
    blocks = gemv_q4_cpu.pack_q4_blocks(q, torch.rand(16, 1), torch.rand(16, 1), 32)
    q8 = gemv_q8_cpu.pack_q8_blocks(
        torch.randint(-127, 128, (16, 32), dtype=torch.int8), torch.rand(16, 1).half().float()
    )
    lib4 = gemv_q4_cpu.load()
    assert lib4 is not None
    y = torch.empty(1, 16, dtype=torch.bfloat16)
    xp, bp, yp = x.data_ptr(), blocks.data_ptr(), y.data_ptr()
    out = {
        "aten.add (tiny)": per_call_us(lambda: torch.ops.aten.add(x, x)),
        "ops.pagemill.gemv_q4": per_call_us(lambda: torch.ops.pagemill.gemv_q4(x, blocks, 16, 2)),
        "ops.pagemill.gemv_q8": per_call_us(lambda: torch.ops.pagemill.gemv_q8(x, q8, 16, 2)),
        "ops.pagemill_native.gemv_q4": per_call_us(
            lambda: torch.ops.pagemill_native.gemv_q4(x, blocks, 16, 2)
        ),
        "gemv_q4_cpu.gemv_q4": per_call_us(lambda: gemv_q4_cpu.gemv_q4(x, blocks, 16)),
    }
    for threads in (1, torch.get_num_threads()):
        out[f"ctypes pagemill_gemv_q4, {threads} thr"] = per_call_us(
            lambda threads=threads: lib4.pagemill_gemv_q4(
                1, xp, 32, bp, 2, yp, 16, 1, 16, 32, threads, 2
            )
        )
    return out


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--pairs", type=int, default=20, help="timed step pairs")
    ap.add_argument("--sweeps", type=int, default=20, help="timed sweeps of the linears")
    ap.add_argument("--cache-root", type=Path, default=Path("/tmp/pagemill-gemv-batch1"))
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--regional",
        action="store_true",
        help="one graph per group of identical layers (PAGEMILL_COMPILE_REGIONAL=1): compiles "
        "in a fraction of the time, the step calls that graph once per layer",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    # Each engine packs its own layers: a weight-cache entry written by one would give the
    # next its choice of operators.
    os.environ["PAGEMILL_WEIGHT_CACHE"] = "0"
    model_dir = resolve_model_dir(args.model)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    engines = {
        name: make_engine(args, planes, native, args.cache_root)
        for name, (planes, native) in MODES.items()
    }
    limits = machine_limits("cpu")
    step_bytes = {
        name: weight_report(llm.llm_engine.engine_core.model_runner.model).step_bytes
        for name, llm in engines.items()
    }
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (32,), generator=g).tolist()
    ids = {
        name: start_decoding(llm.llm_engine, [prompt], 4 * args.pairs + 64)
        for name, llm in engines.items()
    }
    sweeps = {
        (name, direct): op_sweep(packed_layers(llm), direct)
        for name, llm in engines.items()
        for direct in (False, True)
    }
    steps: dict[str, list[float]] = {name: [] for name in engines}
    lin: dict[tuple[str, bool], list[float]] = {key: [] for key in sweeps}
    with torch.inference_mode():
        for fn in sweeps.values():
            fn()
        for llm in engines.values():
            for _ in range(3):
                llm.llm_engine.step()
        for i in range(max(args.pairs, args.sweeps)):
            order = list(engines) if i % 2 == 0 else list(reversed(engines))
            if i < args.pairs:
                for name in order:
                    steps[name].append(timed(engines[name].llm_engine.step))
            if i < args.sweeps:
                for key in sweeps if i % 2 == 0 else reversed(list(sweeps)):
                    lin[key].append(timed(sweeps[key]))
        calls = tiny_calls()
    limits_end = machine_limits("cpu")
    gbs = max(limits["read_gb_s"], limits_end["read_gb_s"])
    print(
        f"\nread bandwidth {limits['read_gb_s']:.1f} GB/s at the start, "
        f"{limits_end['read_gb_s']:.1f} at the end (the floor uses the better); "
        f"threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}"
    )
    result: dict[str, Any] = {
        "torch": torch.__version__,
        "platform": platform.platform(),
        "read_gb_s": [limits["read_gb_s"], limits_end["read_gb_s"]],
        "modes": {},
        "per_call_us": calls,
    }
    for name in engines:
        floor = step_bytes[name] / (gbs * 1e9) * 1e3
        step = statistics.median(steps[name]) * 1e3
        op = statistics.median(lin[(name, False)]) * 1e3
        nat = statistics.median(lin[(name, True)]) * 1e3
        n_layers = len(packed_layers(engines[name]))
        print(
            f"{name:14s} step {step:6.2f} ms = {step / floor:4.2f}x floor {floor:5.2f} ms "
            f"({step_bytes[name] / 1e6:.1f} MB) | packed linears alone ({n_layers} calls) "
            f"as the graph calls them {op:6.2f} ms = {op / floor:4.2f}x floor, "
            f"direct {nat:6.2f} ms "
            f"| step - linears {step - op:6.2f} ms"
        )
        result["modes"][name] = {
            "floor_ms": floor,
            "step_ms": step,
            "x_floor": step / floor,
            "linears_op_ms": op,
            "linears_direct_ms": nat,
            "packed_calls": n_layers,
            "step_bytes": step_bytes[name],
        }
    print("per call (tiny input), µs:")
    for k, v in calls.items():
        print(f"  {k:36s} {v:7.2f}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for name, llm in engines.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    llm.llm_engine.step()
            print(f"\n{name}: 5 steps")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
    for name, llm in engines.items():
        stop(llm.llm_engine, ids[name])
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
