"""Where a compiled decode step's time goes, by torch.profiler, at a few batch sizes.

    python benchmarks/step_profile.py --batch-sizes 16,64,128
    python benchmarks/step_profile.py --temperature 0.8 --top-ops 25

The default model with default flags (as `pagemill serve` would load it), N requests with
random prompts of --context tokens, all decoding; --steps engine steps are profiled. The
step's phases are marked with `record_function` around the engine's own methods
(monkeypatched on this process's objects: no source changes): scheduling, input
preparation, the model forward, the LM head, sampling, and the rest of the step (output
processing: scheduler update, outputs). Inside the forward, the profiler's ops are
grouped by name (or by the pagemill custom op they run inside) into linears, attention,
KV write, the compiled graph's own C++ code
(inductor's fused loops: norms, rotary, activation, residual adds, and the matmuls it
lowers itself, e.g. `_weight_int8pack_mm` of Q8_0 layers: one profiler entry per graph
call, not per kernel) and the rest. Graph
breaks are dynamo's counters over the profiled steps.

Printed per batch size: ms per step in each phase and category, with its share of the
step. Times are the calling thread's wall time inside each op (intra-op threads run
inside it), so they add up to the step.

The CPU KV cache is zero-filled memory the OS maps lazily: the first write into each page
(2 MB with transparent huge pages) takes a page fault that zeroes it, and the profiler
charges that to the KV write (`aten::index_copy_`). Batches that decode into blocks no
request has used yet pay it; a long-running server pays it once per page. --prefault-kv
writes every page of the cache before profiling, to show the step without that cost.

On a machine with more runnable threads than cores, every OpenMP region of the step (each
fused loop, each GEMM, the attention op, the residual copy in `addmm`) waits at its barrier
for a thread the OS has descheduled, and that wait is charged to whichever op is running:
the many short fused loops then take a share of the step they do not take on a quiet
machine. Compare categories only between runs made under the same load.

--inductor-kernels compiles with inductor's per-kernel profiling (a `record_function` in
each generated C++ loop; its own compile-cache folder, `compiled-kernel-profile`, since the
generated code differs) and prints each loop's time per step, calls per step and time per
call, and what is left of the graph call's own time: the Python wrapper that calls the
loops and the library ops (buffer allocation, size asserts, argument handling).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

# Time compiled steps: a cold compile cache compiles before the engine is ready, not beside
# eager steps (the engine's default on a cold start).
os.environ.setdefault("PAGEMILL_COMPILE_BACKGROUND", "0")

PHASES = ("schedule", "input preparation", "forward", "LM head", "sampling")
# Forward ops by name (lower case), first match wins; checked against --top-ops output.
FORWARD_GROUPS: list[tuple[str, tuple[str, ...]]] = [
    # inductor's generated C++ (not an op the profiler sees, or with --inductor-kernels one
    # `graph_<n>_cpp_fused_...` range per loop, named after the ops it fused, so possibly
    # "..._int4pack_mm_..."): the fused norms, rotary, activations and residual adds, and
    # any matmul inductor lowers itself (int8 weights)
    ("inductor C++ (fused loops, lowered mm)", ("cpp_fused", "compiledfxgraph", "kernel_")),
    # entering the compiled graph: dynamo's guard check, its bytecode around the call, AOT
    # autograd's prologue (before the KV write's "cache": dynamo's lookup is no KV write)
    (
        "graph entry",
        ("torchdynamo cache lookup", "pregraph", "torch-compiled region", "aotdispatcher"),
    ),
    ("KV write", ("cache", "kv_write", "reshape_and")),
    ("attention", ("attention", "attn", "sdpa", "paged_decode")),
    (
        "linears",
        (
            "mm",
            "linear",
            "matmul",
            "gemm",
            "gemv",
            "gguf",
            "int4",
            "int8",
            "qlinear",
            "onednn",
            "mkldnn",
        ),
    ),
]


def _wrap(obj: Any, name: str, label: str) -> None:
    """obj.name runs inside record_function(label) (an instance attribute shadows it)."""
    original = getattr(obj, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            return original(*args, **kwargs)

    setattr(obj, name, wrapped)


class _Sampler:
    """The engine's sampler inside record_function("sampling")."""

    def __init__(self, sampler: Callable[..., Any]) -> None:
        self._sampler = sampler

    def __call__(self, *args: Any) -> Any:
        with record_function("sampling"):
            return self._sampler(*args)


def instrument(core: Any) -> None:
    runner = core.model_runner
    _wrap(core.scheduler, "schedule", "schedule")
    _wrap(runner, "_prepare_batch", "input preparation")
    _wrap(runner, "_step_inputs", "input preparation")
    _wrap(runner, "_forward", "forward")
    _wrap(runner.model, "compute_logits", "LM head")
    core.sampler = _Sampler(core.sampler)


def group_of(op: str) -> str:
    name = op.lower()
    for group, needles in FORWARD_GROUPS:
        if any(n in name for n in needles):
            return group
    return "other forward ops"


def _owner(ev: Any) -> str:
    """The name an op is grouped by: its own, or that of the pagemill custom op or linear
    it runs inside (the KV write's `aten::index_copy_` is the KV write's, and the
    `aten::copy_` of the residual into `addmm`'s output, where inductor folds the residual
    add into the GEMM, is that linear's: neither is an "other" op)."""
    parent = ev.cpu_parent
    while parent is not None:
        if parent.name.startswith("pagemill::") or (
            parent.name.startswith("aten::") and group_of(parent.name) == "linears"
        ):
            return str(parent.name)
        parent = parent.cpu_parent
    return str(ev.name)


def breakdown(prof: Any, steps: int, top_ops: int) -> tuple[dict[str, float], list[str]]:
    """ms per step by phase ("forward: <group>" inside the forward), and the top ops."""
    totals: dict[str, float] = defaultdict(float)
    by_op: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.name in PHASES or ev.name == "step":
            continue
        phase, parent = None, ev.cpu_parent
        while parent is not None:
            if parent.name in PHASES:
                phase = parent.name
                break
            parent = parent.cpu_parent
        self_ms = ev.self_cpu_time_total / 1e3 / steps
        if phase is None:
            phase = "output processing & rest"
        if phase == "forward":
            phase = f"forward: {group_of(_owner(ev))}"
        totals[phase] += self_ms
        by_op[f"[{phase}] {ev.name}"] += self_ms
    # Python between ops (no op running) is charged to the innermost phase range.
    for ev in prof.events():
        if ev.name in PHASES:
            child_time = sum(c.cpu_time_total for c in ev.cpu_children)
            python_ms = (ev.cpu_time_total - child_time) / 1e3 / steps
            key = "forward: python & dispatch" if ev.name == "forward" else ev.name
            totals[key] += python_ms
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:top_ops]
    return dict(totals), [f"{ms:9.3f} ms  {name}" for name, ms in top]


def kernel_table(prof: Any, steps: int) -> list[str]:
    """Per generated C++ loop: ms per step, calls per step, us per call (self time, so
    intra-op threads count inside); then the graph call's own time left over."""
    ms: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    wrapper_ms = 0.0
    for ev in prof.events():
        name = str(ev.name)
        if "cpp_fused" in name or name.startswith("graph_"):
            ms[name] += ev.self_cpu_time_total / 1e3 / steps
            calls[name] += 1
        elif "CompiledFxGraph" in name:
            wrapper_ms += ev.self_cpu_time_total / 1e3 / steps
    rows = sorted(ms.items(), key=lambda kv: -kv[1])
    total = sum(ms.values())
    n_calls = sum(calls.values()) / steps
    lines = [f"  inductor loops: {total:.2f} ms in {n_calls:.0f} calls per step"]
    lines += [
        f"    {t:8.3f} ms {calls[k] / steps:5.0f} x {t * 1e3 / max(calls[k] / steps, 1):7.1f} us  "
        f"{k}"
        for k, t in rows
    ]
    lines.append(f"  graph call's own time (Python wrapper): {wrapper_ms:.2f} ms")
    return lines


def _profile_kernels() -> None:
    """Inductor's per-kernel `record_function`, compiled into a compile-cache folder of
    its own (a cached graph without it would load otherwise)."""
    import torch._inductor.config as inductor_config

    from pagemill.runtime.worker import compilation

    inductor_config.cpp.enable_kernel_profile = True
    default_root = compilation.CompileCache.root

    def root() -> Any:
        return default_root().with_name("compiled-kernel-profile")

    compilation.CompileCache.root = staticmethod(root)  # type: ignore[method-assign]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="16,64,128")
    ap.add_argument("--context", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=5, help="profiled steps per batch size")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--top-ops", type=int, default=15)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--kv-cache-dtype", default=None, help="auto | fp8 | fp8_e5m2 | int8 | ...")
    ap.add_argument("--dtype", default="auto", help="compute dtype (default: the engine's auto)")
    ap.add_argument(
        "--prefault-kv",
        action="store_true",
        help="write every page of the KV cache first (no first-touch page faults profiled)",
    )
    ap.add_argument(
        "--inductor-kernels",
        action="store_true",
        help="time each generated C++ loop (compiles with inductor's kernel profiling)",
    )
    args = ap.parse_args()
    if args.inductor_kernels:
        _profile_kernels()
    if args.threads:
        torch.set_num_threads(args.threads)
    import torch._dynamo.utils as dynamo_utils

    from pagemill.runtime import LLM, SamplingParams
    from pagemill.runtime.model_executor.default_model import ensure_default_model

    t0 = time.perf_counter()
    kwargs: dict[str, Any] = {}
    if args.kv_cache_dtype is not None:
        kwargs["kv_cache_dtype"] = args.kv_cache_dtype
    llm = LLM(
        model=str(ensure_default_model()),
        dtype=args.dtype,
        enforce_eager=args.enforce_eager,
        seed=0,
        **kwargs,
    )
    print(f"engine ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    engine = llm.llm_engine
    core = engine.engine_core
    instrument(core)
    storage = getattr(core.model_runner.kv_cache, "storage", None)
    if storage is not None:  # steady state: the pool's background prefault has finished
        storage.wait_prefaulted()
    if args.prefault_kv:
        t0 = time.perf_counter()
        for k, v in core.model_runner.kv_cache.caches:
            k.view(torch.uint8).zero_()
            v.view(torch.uint8).zero_()
        print(f"KV cache pre-faulted in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    params = SamplingParams(temperature=args.temperature, max_tokens=4096, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    vocab = core.model_runner.vocab_size
    live: list[str] = []
    for n in sorted(int(b) for b in args.batch_sizes.split(",")):
        while len(live) < n:
            rid = f"p{len(live)}"
            engine.add_request(
                rid, torch.randint(3, vocab, (args.context,), generator=g).tolist(), params
            )
            live.append(rid)
        for _ in range(n // 8 + 4):  # prefills, then a few decode steps to settle
            engine.step()
        walls = []
        graph_breaks_before = sum(dynamo_utils.counters["graph_break"].values())
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                t = time.perf_counter()
                with record_function("step"):
                    outs = engine.step()
                walls.append(time.perf_counter() - t)
                if len(outs) != n:
                    print(f"warning: a step returned {len(outs)} outputs for {n}", file=sys.stderr)
        graph_breaks = sum(dynamo_utils.counters["graph_break"].values()) - graph_breaks_before
        totals, top = breakdown(prof, args.steps, args.top_ops)
        step_ms = statistics.median(walls) * 1e3
        accounted = sum(totals.values())
        print(
            f"\nbatch {n}: step {step_ms:.2f} ms (median of {args.steps}, profiled), "
            f"{accounted:.2f} ms accounted, {graph_breaks} graph breaks"
        )
        for key, ms in sorted(totals.items(), key=lambda kv: -kv[1]):
            print(f"  {key:<46}{ms:9.2f} ms {ms / accounted:7.1%}")
        print("  top ops:")
        for line in top:
            print("   ", line)
        if args.inductor_kernels:
            print("\n".join(kernel_table(prof, args.steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
