"""Two compiled forwards of the default engine, A vs B, their decode steps interleaved.

A is the engine as it ships; B differs by one --variant of how the forward is compiled:

- `no-mark-static`: `compile_forward` without `_mark_static_attributes` (the model's
  tensor attributes, KV caches and packed weights, get symbolic sizes under `dynamic=True`);
- `kv-static`: only the KV caches are marked static (the packed weights are not);
- `prepack`: dense bf16 weights with their oneDNN-prepacked twins
  (`PAGEMILL_PREPACK_DENSE=1`, off by default, see `model_executor.layers.prepacked`);
- `regional`: one graph per group of identical decoder layers (`PAGEMILL_COMPILE_REGIONAL=1`,
  see `compilation._compile_layers`) against A forced to the whole-model graph;
- `loops-before`: the graph before the fused-loop work: q and k rotated in a loop each
  (`LlamaAttention.rotate_qk_together = False`), inductor's size asserts on and its
  default `cpp.min_chunk_size` (`compilation.INDUCTOR_OPTIONS` empty);
- `python-ops`: the KV write and attention through the Python custom ops in every graph
  (`LlamaAttention.direct_native_ops = False`), as before the graph called the C++
  operators directly;
- `cpp-wrapper-single`: inductor's C++ wrapper for the one-token graph only
  (`PAGEMILL_CPP_WRAPPER=single`), the decode-only graphs of several requests on the Python
  wrapper, against the default's C++ wrapper for every graph without the attention plan;
- `cpp-wrapper-before`: `single`, its wrapper built as one -O3 unit with the fused loops
  (`compilation.CPP_WRAPPER_BUILD_SEPARATE = False`): the default before both;
- `python-wrapper`: no C++ wrapper at all (`PAGEMILL_CPP_WRAPPER=0`);
- `float-inputs`: the model traced without `specialize_float` (`compilation.SPECIALIZE_FLOATS
  = False`): every norm's epsilon a graph input, wrapped in a new tensor per call, as before;
- `host-before`: both of the last two (the one-token graph's host path as before them);
- `per-layer-inputs`: every packed weight, norm weight and K/V cache its own graph input
  (`Linear.read_from_arena = False`, `RMSNorm.gathered_params = ()`,
  `LlamaAttention.read_kv_from_pool = False`), as before the graphs sliced them out of one
  tensor each (`huge_page_weights.arena_view`, `gathered_params.gathered_view`,
  `LlamaAttention._graph_kv`);
- `host-layout-before`: B's decode-only steps laid out and planned on the general host
  path (`ModelRunner.decode_fast_path = False` on B's runner: the tables written by torch
  copies from the attention plan, `_layout`'s numpy calls); the graphs are the same;
- `dispatcher-calls`: B's C++ wrappers call the native operators through
  `aoti_torch_call_dispatcher` (`PAGEMILL_NATIVE_C_SHIMS=0`) instead of their C entry
  points (`cpu_native.c_shims`);
- `explicit-fp32`: B with `dtype="float32"` asked for (a GGUF dequantized to dense fp32)
  against A's --dtype (run it with `--dtype auto` on a CPU without bf16 arithmetic, where
  auto is fp32 with the GGUF's rows packed for few-row steps).

Both engines live in ONE process and their steps alternate (A B, then B A), with dense bf16
`F.linear` over the model's linears and LM head ("linears alone", as in
`throughput.py`) timed between them, so a loaded machine slows all three alike. Each engine
compiles into a compile-cache folder of its own under a temporary directory (the variants
share a cache key, so one must not load the other's graph), and its KV pool is written
once before timing (no first-touch page faults in the step). Reported per batch size:
median and quartiles of each side's step wall time, of the calling thread's CPU time
(`time.thread_time`; with --threads 1 that is all of the step's compute), and the median
of the paired ratios B / A.

    python benchmarks/step_ab.py --variant no-mark-static --batch-sizes 16,64,128
    python benchmarks/step_ab.py --variant kv-static --threads 1 --pairs 30
    python benchmarks/step_ab.py --variant prepack --enforce-eager --threads 1
    python benchmarks/step_ab.py --variant regional --batch-sizes 1,16,128 --threads 1

Figures are printed (and written to --json); nothing is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

# Time compiled steps: a cold compile cache compiles before the engine is ready, not beside
# eager steps (the engine's default on a cold start).
os.environ.setdefault("PAGEMILL_COMPILE_BACKGROUND", "0")

sys.path.insert(0, str(Path(__file__).parent))
from compile_cache import quartiles, start_decoding, stop
from throughput import DenseLinears, linear_shapes, resolve_model_dir

from pagemill.runtime.model_executor.quantization.crossover import PACKED_LIMITS_ENV

VARIANTS = (
    "no-mark-static",
    "kv-static",
    "prepack",
    "regional",
    "loops-before",
    "python-ops",
    "cpp-wrapper-single",
    "cpp-wrapper-before",
    "python-wrapper",
    "float-inputs",
    "host-before",
    "per-layer-inputs",
    "explicit-fp32",
    "host-layout-before",
    "dispatcher-calls",
)


def _mark_kv_static(model: torch.nn.Module) -> None:
    for module in model.modules():
        for key in ("k_cache", "v_cache"):
            t = getattr(module, key, None)
            if isinstance(t, torch.Tensor):
                torch._dynamo.mark_static(t)


@contextlib.contextmanager
def variant(name: str | None, cache_root: Path) -> Iterator[None]:
    """Build an engine inside: A when `name` is None, else B of that variant."""
    from pagemill.kernels.cpu_native import C_SHIMS_ENV
    from pagemill.runtime.model_executor.layers.linear import Linear
    from pagemill.runtime.model_executor.layers.prepacked import PREPACK_ENV
    from pagemill.runtime.model_executor.models.llama import LlamaAttention, RMSNorm
    from pagemill.runtime.worker import compilation

    saved_env = os.environ.get(PREPACK_ENV)
    if name == "prepack":
        os.environ[PREPACK_ENV] = "1"
    saved_root = compilation.CompileCache.root
    saved_mark = compilation._mark_static_attributes
    saved_regional = os.environ.get(compilation.REGIONAL_ENV)
    saved_options = compilation.INDUCTOR_OPTIONS
    compilation.CompileCache.root = staticmethod(lambda: cache_root)  # type: ignore[method-assign]
    if name == "no-mark-static":
        compilation._mark_static_attributes = lambda model: None
    elif name == "kv-static":
        compilation._mark_static_attributes = _mark_kv_static
    elif name == "regional":
        os.environ[compilation.REGIONAL_ENV] = "1"
    elif name == "loops-before":
        LlamaAttention.rotate_qk_together = False
        compilation.INDUCTOR_OPTIONS = {}
    elif name == "python-ops":
        LlamaAttention.direct_native_ops = False
    elif name == "cpp-wrapper-single":
        os.environ[compilation.CPP_WRAPPER_ENV] = "single"
    elif name == "cpp-wrapper-before":
        os.environ[compilation.CPP_WRAPPER_ENV] = "single"
        compilation.CPP_WRAPPER_BUILD_SEPARATE = False
    elif name == "python-wrapper":
        os.environ[compilation.CPP_WRAPPER_ENV] = "0"
    elif name == "float-inputs":
        compilation.SPECIALIZE_FLOATS = False
    elif name == "per-layer-inputs":
        Linear.read_from_arena = False
        RMSNorm.gathered_params = ()
        LlamaAttention.read_kv_from_pool = False
    elif name == "dispatcher-calls":
        os.environ[C_SHIMS_ENV] = "0"
    elif name == "host-before":
        os.environ[compilation.CPP_WRAPPER_ENV] = "0"
        compilation.SPECIALIZE_FLOATS = False
    if name is None:  # A: whole-model, whatever the default; the default wrapper
        os.environ[compilation.REGIONAL_ENV] = "0"
        os.environ.pop(compilation.CPP_WRAPPER_ENV, None)
    try:
        yield
    finally:
        compilation.CompileCache.root = saved_root  # type: ignore[method-assign]
        compilation._mark_static_attributes = saved_mark
        compilation.INDUCTOR_OPTIONS = saved_options
        LlamaAttention.rotate_qk_together = True
        LlamaAttention.direct_native_ops = True
        Linear.read_from_arena = True
        RMSNorm.gathered_params = ("weight",)
        LlamaAttention.read_kv_from_pool = True
        os.environ.pop(compilation.CPP_WRAPPER_ENV, None)
        os.environ.pop(C_SHIMS_ENV, None)
        compilation.SPECIALIZE_FLOATS = True
        compilation.CPP_WRAPPER_BUILD_SEPARATE = True
        if saved_regional is None:
            os.environ.pop(compilation.REGIONAL_ENV, None)
        else:
            os.environ[compilation.REGIONAL_ENV] = saved_regional
        if saved_env is None:
            os.environ.pop(PREPACK_ENV, None)
        else:
            os.environ[PREPACK_ENV] = saved_env


def make_engine(args: argparse.Namespace, name: str | None, root: Path) -> Any:
    from pagemill.runtime import LLM

    t0 = time.perf_counter()
    folder = root / (name or "A")
    if name is None and args.a_cache_dir is not None:
        folder = args.a_cache_dir
    with variant(name, folder):
        llm = LLM(
            model=args.model,
            dtype="float32" if name == "explicit-fp32" else args.dtype,
            max_num_seqs=max(int(s) for s in args.batch_sizes.split(",")),
            kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
            seed=args.seed,
            enforce_eager=args.enforce_eager,
        )
    runner = llm.llm_engine.engine_core.model_runner
    if name == "host-layout-before":
        runner.decode_fast_path = False  # an instance's: A keeps the class default
    for k, v in runner.kv_cache.caches:  # pre-fault the pool (see step_profile.py)
        k.view(torch.uint8).zero_()
        v.view(torch.uint8).zero_()
    print(
        f"{name or 'A (as shipped)'}: ready in {time.perf_counter() - t0:.1f} s "
        f"(compiled {runner.compiled})",
        file=sys.stderr,
    )
    return llm


def timed(engine: Any, n: int) -> tuple[float, float]:
    w0, c0 = time.perf_counter(), time.thread_time()
    outs = engine.step()
    w, c = time.perf_counter() - w0, time.thread_time() - c0
    if len(outs) != n or any(o.finished for o in outs):
        raise RuntimeError(f"a step with {n} decoding requests returned {len(outs)} outputs")
    return w, c


def timed_linears(dense: DenseLinears, n: int) -> tuple[float, float]:
    xs = {w.shape[1]: torch.randn(n, w.shape[1], dtype=dense.dtype) for w in dense.weights}
    with torch.inference_mode():
        w0, c0 = time.perf_counter(), time.thread_time()
        for w in dense.weights:
            torch.nn.functional.linear(xs[w.shape[1]], w)
        return time.perf_counter() - w0, time.thread_time() - c0


def _q(xs: list[float]) -> list[float]:
    return [v * 1e3 for v in quartiles(xs)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--variant", choices=VARIANTS, default="no-mark-static")
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-sizes", default="16,64,128")
    ap.add_argument("--context", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--pairs", type=int, default=30, help="timed A/B pairs per batch size")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--kv-cache-gib", type=float, default=0.5, help="per engine")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument(
        "--enforce-eager",
        action="store_true",
        help="both engines eager (quick; for variants that are not about the graph)",
    )
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--packed-limits", choices=("table", "measure"), default="table")
    ap.add_argument(
        "--a-cache-dir",
        type=Path,
        default=None,
        help="A's compile cache folder, kept across runs (default: a temporary one); B "
        "always compiles into a temporary folder of its own",
    )
    args = ap.parse_args(argv)
    # Both engines must leave packed layers for their dense copies at the same row counts,
    # or their graphs differ by more than the variant: the fixed table, not measurements
    # (unless --packed-limits measure).
    os.environ[PACKED_LIMITS_ENV] = args.packed_limits
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    with tempfile.TemporaryDirectory(prefix="pagemill-step-ab-") as tmp:
        a_llm = make_engine(args, None, Path(tmp))
        b_llm = make_engine(args, args.variant, Path(tmp))
    dense = DenseLinears(linear_shapes(a_llm), "cpu", a_llm.llm_engine.engine_core.dtype)
    a, b = a_llm.llm_engine, b_llm.llm_engine
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
        ids_a = start_decoding(a, prompts, max_tokens)
        ids_b = start_decoding(b, prompts, max_tokens)
        for _ in range(args.warmup):
            timed(a, n), timed(b, n), timed_linears(dense, n)
        aw, ac, bw, bc, lw, lc = [], [], [], [], [], []  # type: ignore[var-annotated]
        for i in range(args.pairs):
            order = (a, b) if i % 2 == 0 else (b, a)
            for eng in order:
                w, c = timed(eng, n)
                (aw if eng is a else bw).append(w)
                (ac if eng is a else bc).append(c)
            w, c = timed_linears(dense, n)
            lw.append(w)
            lc.append(c)
        stop(a, ids_a)
        stop(b, ids_b)
        row = {
            "batch_size": n,
            "a_wall_ms": _q(aw),
            "b_wall_ms": _q(bw),
            "a_cpu_ms": _q(ac),
            "b_cpu_ms": _q(bc),
            "linears_wall_ms": _q(lw),
            "linears_cpu_ms": _q(lc),
            "b_over_a_wall": list(quartiles([y / x for x, y in zip(aw, bw)])),
            "b_over_a_cpu": list(quartiles([y / x for x, y in zip(ac, bc)])),
        }
        result["rows"].append(row)
        print(f"  batch {n}: {json.dumps(row)}", file=sys.stderr)
    result["loadavg_end"] = os.getloadavg()
    print(
        f"\nA = as shipped, B = {args.variant}; {args.pairs} interleaved pairs per row, "
        f"{torch.get_num_threads()} threads; load average "
        f"{result['loadavg_start'][0]:.2f} -> {result['loadavg_end'][0]:.2f}\n"
        f"{'batch':>6} {'A wall':>8} {'B wall':>8} {'B/A wall':>9} {'A cpu':>8} {'B cpu':>8} "
        f"{'B/A cpu':>8} {'lin wall':>9} {'lin cpu':>8} {'A/lin':>6}"
    )
    for r in result["rows"]:
        print(
            f"{r['batch_size']:6d} {r['a_wall_ms'][1]:8.2f} {r['b_wall_ms'][1]:8.2f} "
            f"{r['b_over_a_wall'][1]:9.3f} {r['a_cpu_ms'][1]:8.2f} {r['b_cpu_ms'][1]:8.2f} "
            f"{r['b_over_a_cpu'][1]:8.3f} {r['linears_wall_ms'][1]:9.2f} "
            f"{r['linears_cpu_ms'][1]:8.2f} {r['a_wall_ms'][1] / r['linears_wall_ms'][1]:6.2f}"
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
