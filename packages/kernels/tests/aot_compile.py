"""Compile pagemill's Triton kernels for sm_80 / sm_90 without a GPU, as the runtime launches them.

    python packages/kernels/tests/aot_compile.py --grid default --out aot.json
    python packages/kernels/tests/aot_compile.py --grid full --jobs 2 --out aot.json

Run by tests/test_aot_compile.py in a subprocess (see there why), usable by hand. How a
configuration is obtained: the real launchers (`run_triton` with a plan from
`plan_triton`, `rms_norm_triton`, `apply_rotary_triton`, `write_kv_cache_triton`,
`silu_and_mul_triton`, `fused_moe_triton`, `add_lora_triton`) are called with small CPU
tensors of the served shapes, while `JITFunction.run` — what ``kernel[grid](...)`` calls —
is replaced by a recorder. Each recorded launch is then specialised the way Triton's
launcher does it (its own binder: argument types, 16-byte alignment and divisibility of
pointers and integers, constexprs, launch options such as ``num_warps``) for a `GPUTarget`,
and compiled with
``triton.compile(ASTSource(...), target=...)``; the ptxas that ships with Triton builds the
cubin. Nothing here re-states a tile size: change the planner and this compiles the new one.

The result per compiled kernel: shared memory (``metadata.shared`` plus the cubin's static
shared memory), registers and stack bytes per thread (``cuobjdump -res-usage`` on the
cubin; Triton kernels have no local arrays, so stack bytes are spilled registers —
``n_regs`` / ``n_spills`` of a launched kernel need a driver, this needs none).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

# @triton.jit must build JITFunctions (compilable), not interpreter functions.
os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's own default; silences 3.9

import torch

# Most shared memory one block may use (bytes): the opt-in maximum of each architecture.
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

# Shapes the runtime serves: (hidden, heads, kv_heads, head_dim, intermediate) of the model
# families pagemill loads (Llama, Mistral, Qwen2), from their published configs.
MODELS = {
    "smollm2-135m": (576, 9, 3, 64, 1536),
    "llama-3.1-8b": (4096, 32, 8, 128, 14336),
    "llama-3.1-70b": (8192, 64, 8, 128, 28672),
    "qwen2.5-7b": (3584, 28, 4, 128, 18944),
}
# Mixture-of-experts shapes: (hidden, expert intermediate, experts, top-k), published configs.
MOE_MODELS = {
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "olmoe-1b-7b": (2048, 1024, 64, 8),
    "qwen1.5-moe-a2.7b": (2048, 1408, 60, 4),
    "gpt-oss-20b": (2880, 2880, 32, 4),  # biased experts (the kernel's HAS_BIAS variant)
}
# Attention head layouts beyond those models: every head size x GQA group pagemill supports.
HEAD_DIMS = (64, 128, 256)
GROUPS = (1, 2, 4, 8)
# Streaming multiprocessors of the GPUs the split-context planner is checked for.
SM_COUNTS = {"A100": 108, "H100/H200": 132}
BLOCK_SIZE = 16  # CacheConfig's default


@dataclasses.dataclass
class Launch:
    """One recorded ``kernel[grid](*args, **kwargs)`` with what it was for."""

    fn: Any
    args: tuple
    kwargs: dict
    case: dict


_RECORDED: list[Launch] = []
_CASE: dict = {}


def _install_recorder() -> None:
    from triton.runtime.jit import JITFunction

    def record(self, *args, grid, warmup, **kwargs):
        _RECORDED.append(Launch(self, args, dict(kwargs), dict(_CASE)))

    JITFunction.run = record
    # The launchers refuse CPU tensors outside the interpreter; here nothing is launched.
    import pagemill.kernels  # noqa: F401 - loads the op modules

    for op in ("activation", "int4_gemm", "kv_cache", "rms_norm", "rotary", "moe", "lora"):
        # sys.modules: the package rebinds e.g. `pagemill.kernels.rms_norm` to the function.
        sys.modules[f"pagemill.kernels.{op}"].check_triton_device = lambda *tensors: None


# ------------------------------------------------------------------ the served configurations


def _attention(
    dtype: torch.dtype,
    head_dim: int,
    group: int,
    mode: str,
    *,
    kv_heads: int = 2,
    num_seqs: int = 3,
    context: int = 4096,
    sm_count: int | None = None,
    softcap: float = 0.0,
    window: int = 0,
    kv: str = "",
    sinks: bool = False,
    per_head: bool = False,
) -> None:
    """Launch attention for one batch shape through the planner and the launcher (a
    sliding ``window`` is a runtime argument, a ``softcap`` a compiled variant, an fp8
    cache ``kv`` = "e4m3"/"e5m2" another, an int8 cache ``kv`` = "int8" another, attention
    ``sinks`` another; ``per_head`` K/V scales are a runtime stride, the same kernel)."""
    from pagemill.kernels.attention_triton import plan_triton, run_triton, split_count

    heads = kv_heads * group
    q_lens = [1] * num_seqs if mode.startswith("decode") else [300] + [1] * (num_seqs - 1)
    num_tokens = sum(q_lens)
    width = -(-context // BLOCK_SIZE)
    kv_dtype = {
        "": dtype,
        "e4m3": torch.float8_e4m3fn,
        "e5m2": torch.float8_e5m2,
        "int8": torch.int8,
    }[kv]
    k_cache = torch.zeros(4, BLOCK_SIZE, kv_heads, head_dim, dtype=kv_dtype)
    q = torch.zeros(num_tokens, heads, head_dim, dtype=dtype)
    tables = torch.zeros(num_seqs, width, dtype=torch.int32)
    qsl = torch.zeros(num_seqs + 1, dtype=torch.int32)
    lens = torch.zeros(num_seqs, dtype=torch.int32)
    splits = None
    if mode == "decode-split":
        splits = split_count(sm_count or 132, num_seqs * kv_heads, width * BLOCK_SIZE)
        if splits < 2:
            return
    plan = plan_triton(
        num_tokens,
        num_seqs,
        width,
        tuple(k_cache.shape),
        heads,
        dtype,
        torch.device("cpu"),
        num_splits=splits,
    )
    run_triton(
        plan,
        q,
        k_cache,
        k_cache,
        tables,
        qsl,
        lens,
        head_dim**-0.5,
        torch.empty_like(q),
        window=window,
        softcap=softcap,
        k_scale=(torch.ones(kv_heads) if per_head else torch.ones(())) if kv else None,
        v_scale=(torch.ones(kv_heads) if per_head else torch.ones(())) if kv else None,
        sinks=torch.zeros(heads) if sinks else None,
    )


def _small_ops(
    dtype: torch.dtype, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int
) -> None:
    from pagemill.kernels import (
        apply_rotary_triton,
        rms_norm_triton,
        silu_and_mul_triton,
        write_kv_cache_triton,
    )

    t = 3
    x = torch.zeros(t, hidden, dtype=dtype)
    w = torch.zeros(hidden, dtype=dtype)
    rms_norm_triton(x, w, 1e-5)
    rms_norm_triton(x, w, 1e-5, torch.zeros_like(x))
    silu_and_mul_triton(torch.zeros(t, 2 * inter, dtype=dtype))
    q = torch.zeros(t, heads, head_dim, dtype=dtype)
    k = torch.zeros(t, kv_heads, head_dim, dtype=dtype)
    pos = torch.zeros(t, dtype=torch.int64)
    apply_rotary_triton(pos, q, k, torch.zeros(64, head_dim, dtype=torch.float32))
    cache = torch.zeros(4, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype)
    write_kv_cache_triton(k, k, cache, cache, torch.zeros(t, dtype=torch.int64))
    # --kv-cache-dtype fp8 / fp8_e5m2 / int8
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8):
        cache8 = torch.zeros(4, BLOCK_SIZE, kv_heads, head_dim, dtype=fp8)
        one = torch.ones(())
        write_kv_cache_triton(k, k, cache8, cache8, torch.zeros(t, dtype=torch.int64), one, one)
        # --kv-scales-per-head / per-head checkpoint scales: a runtime stride, same kernel.
        heads = torch.ones(kv_heads)
        write_kv_cache_triton(k, k, cache8, cache8, torch.zeros(t, dtype=torch.int64), heads, heads)


def _int4_gemm(dtype: torch.dtype, rows: int, hidden: int, inter: int) -> None:
    """The int4-group GEMM (AWQ / GPTQ / w4a16 weights) for a model's projections: the tile
    height follows the row count (decode: 16, prefill: 64), groups of 128 as published (64
    where the model's sizes are not multiples of 128, e.g. SmolLM2's 576) — and as the
    runtime's `Linear` serves them: fp32 scales, groups of 32 (GGUF Q4_0/Q4_1/Q4_K)."""
    from pagemill.kernels import int4_group_gemm_triton

    g = 128 if hidden % 128 == 0 and inter % 128 == 0 else 64
    for k, n in ((hidden, 3 * hidden), (hidden, 2 * inter), (inter, hidden)):
        qweight = torch.zeros(k // 8, n, dtype=torch.int32)
        x = torch.zeros(rows, k, dtype=dtype)
        for group, sdt in ((g, dtype), (32, torch.float32)):
            scales = torch.zeros(k // group, n, dtype=sdt)
            int4_group_gemm_triton(x, qweight, scales, scales, group)


def _moe(
    dtype: torch.dtype,
    hidden: int,
    inter: int,
    experts: int,
    top_k: int,
    t: int,
    bias: bool = False,
) -> None:
    """The grouped GEMMs of one MoE layer for t tokens (t decides the token-block size).
    Two experts stand for all: the kernel's specialisation does not depend on their count,
    and `torch.empty` of the stacked weights never touches (allocates) their pages."""
    from pagemill.kernels import fused_moe_triton

    e = 2
    x = torch.zeros(t, hidden, dtype=dtype)
    w13 = torch.empty(e, 2 * inter, hidden, dtype=dtype)
    w2 = torch.empty(e, hidden, inter, dtype=dtype)
    ids = (torch.arange(t * top_k) % e).view(t, top_k)
    weights = torch.full((t, top_k), 1.0 / top_k)
    # The runtime's choice of block size compares pairs with experts: pass what it would
    # choose for the real expert count.
    block_m = 16 if t * top_k <= 4 * experts else 64
    b13 = torch.zeros(e, 2 * inter, dtype=dtype) if bias else None
    b2 = torch.zeros(e, hidden, dtype=dtype) if bias else None
    activation = "swigluoai" if bias else "silu"  # gpt-oss: biased experts, clamped SwiGLU
    fused_moe_triton(x, w13, w2, weights, ids, b13, b2, activation, block_m=block_m)


def _lora(dtype: torch.dtype, model: str, rank: int, t: int) -> None:
    """The shrink/expand of a fused q|k|v and gate|up projection with 4 adapter slots;
    the kernels' specialisation depends on dtype, rank and token count, not on the shape's
    values, so one layer of each kind stands for all."""
    from pagemill.kernels import add_lora_triton, lora_segments

    hidden, heads, kv_heads, head_dim, inter = MODELS[model]
    slots = 4
    token_slots = torch.arange(t) % (slots + 1) - 1
    sorted_ids, seg = lora_segments(token_slots, slots)
    x = torch.zeros(t, hidden, dtype=dtype)
    for slices in (
        (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim),
        (inter, inter),
    ):
        out = sum(slices)
        starts = torch.tensor([0, *torch.tensor(slices).cumsum(0).tolist()], dtype=torch.int32)
        a = torch.empty(slots, len(slices) * rank, hidden, dtype=dtype)
        b = torch.empty(slots, out, len(slices) * rank, dtype=dtype)
        y = torch.empty(t, out, dtype=dtype)
        add_lora_triton(y, x, a, b, sorted_ids, seg, starts, max_slice=max(slices))


def record_launches(grid: str) -> list[Launch]:
    """Call the launchers over the grid's configurations; returns the recorded launches."""
    global _CASE
    main = {"dtype": "bf16", "head_dim": 128, "group": 4}  # Llama-3.1-8B in bf16
    if grid == "default":
        attention = [
            dict(main, mode="decode"),
            dict(main, mode="decode-split"),
            dict(main, mode="prefill"),
            dict(dtype="fp16", head_dim=64, group=3, mode="decode"),  # SmolLM2
            dict(dtype="fp32", head_dim=64, group=1, mode="prefill"),
            # Gemma 2 (9B: head_dim 256, GQA 2): soft-capped scores, sliding window.
            dict(dtype="bf16", head_dim=256, group=2, mode="prefill", softcap=50.0, window=4096),
            dict(dtype="bf16", head_dim=256, group=2, mode="decode", softcap=50.0, window=4096),
            # --kv-cache-dtype fp8 (e4m3) and fp8_e5m2 on the main layout.
            dict(main, mode="decode", kv="e4m3"),
            dict(main, mode="decode-split", kv="e4m3"),
            dict(main, mode="prefill", kv="e4m3"),
            dict(main, mode="decode", kv="e5m2"),
            # --kv-cache-dtype int8 on the main layout.
            dict(main, mode="decode", kv="int8"),
            dict(main, mode="decode-split", kv="int8"),
            dict(main, mode="prefill", kv="int8"),
            # One K/V scale per KV head (a runtime stride: must not add a compiled variant).
            dict(main, mode="decode-split", kv="e4m3", per_head=True),
            dict(main, mode="prefill", kv="int8", per_head=True),
            # gpt-oss (head_dim 64, GQA 8): attention sinks, alternating 128-key windows.
            dict(dtype="bf16", head_dim=64, group=8, mode="prefill", sinks=True, window=128),
            dict(dtype="bf16", head_dim=64, group=8, mode="decode", sinks=True),
            dict(dtype="bf16", head_dim=64, group=8, mode="decode-split", sinks=True),
        ]
        models = [("bf16", "llama-3.1-8b")]
        moe = [("bf16", m, t) for m in ("qwen3-30b-a3b", "gpt-oss-20b") for t in (1, 64, 512)]
        lora = [("bf16", "llama-3.1-8b", 16, t) for t in (1, 64, 512)]
    else:
        layouts = {(d, g) for d in HEAD_DIMS for g in GROUPS}
        layouts |= {(m[3], m[1] // m[2]) for m in MODELS.values()}
        attention = [
            dict(dtype=dt, head_dim=d, group=g, mode=mode)
            for dt in DTYPES
            for d, g in sorted(layouts)
            for mode in ("decode", "decode-split", "prefill")
        ]
        # The merge kernel is compiled per power-of-two bucket of the split count: reach
        # every bucket the planner can choose (few long decodes on a large GPU .. many).
        for sms in SM_COUNTS.values():
            for num_seqs in (1, 2, 4, 8, 16, 32):
                for context in (1024, 2048, 4096, 16384):
                    attention.append(
                        dict(
                            main,
                            mode="decode-split",
                            num_seqs=num_seqs,
                            context=context,
                            sm_count=sms,
                            kv_heads=8,
                        )
                    )
        attention += [
            dict(dtype=dt, head_dim=d, group=2, mode=mode, softcap=50.0)
            for dt in DTYPES
            for d in HEAD_DIMS
            for mode in ("decode", "decode-split", "prefill")
        ]
        attention += [  # fp8 and int8 KV caches under 16-bit compute
            dict(dtype=dt, head_dim=d, group=g, mode=mode, kv=kv)
            for dt in DTYPES
            if dt != "fp32"
            for kv in ("e4m3", "e5m2", "int8")
            for d, g in sorted(layouts)
            for mode in ("decode", "decode-split", "prefill")
        ]
        attention += [  # attention sinks (gpt-oss)
            dict(dtype=dt, head_dim=d, group=8, mode=mode, sinks=True)
            for dt in DTYPES
            for d in HEAD_DIMS
            for mode in ("decode", "decode-split", "prefill")
        ]
        models = [(dt, m) for dt in DTYPES for m in MODELS]
        moe = [(dt, m, t) for dt in DTYPES for m in MOE_MODELS for t in (1, 64, 512)]
        lora = [
            (dt, m, r, t) for dt in DTYPES for m in MODELS for r in (8, 16, 64) for t in (1, 512)
        ]
    for case in attention:
        _CASE = dict(case, kernel_family="attention")
        _attention(
            DTYPES[case["dtype"]],
            case["head_dim"],
            case["group"],
            case["mode"],
            **{
                k: case[k]
                for k in (
                    "num_seqs",
                    "context",
                    "sm_count",
                    "kv_heads",
                    "softcap",
                    "window",
                    "kv",
                    "sinks",
                    "per_head",
                )
                if k in case
            },
        )
    for dt, model in models:
        _CASE = {"dtype": dt, "model": model, "kernel_family": "small"}
        _small_ops(DTYPES[dt], *MODELS[model])
        if dt != "fp32":  # w4a16 checkpoints run in fp16 / bf16
            hidden, inter = MODELS[model][0], MODELS[model][4]
            for rows in (1, 256):
                _CASE = {"dtype": dt, "model": model, "rows": rows, "kernel_family": "int4_gemm"}
                _int4_gemm(DTYPES[dt], rows, hidden, inter)
    for dt, model, t in moe:
        _CASE = {"dtype": dt, "model": model, "tokens": t, "kernel_family": "moe"}
        _moe(DTYPES[dt], *MOE_MODELS[model], t, bias=model.startswith("gpt-oss"))
    for dt, model, rank, t in lora:
        _CASE = {"dtype": dt, "model": model, "rank": rank, "tokens": t, "kernel_family": "lora"}
        _lora(DTYPES[dt], model, rank, t)
    return _RECORDED


# ------------------------------------------------------------------ specialise and compile


def specialise(launch: Launch, capability: int) -> dict:
    """What Triton's launcher would compile for this launch on `capability` (plain data)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.fn
    backend = make_backend(GPUTarget("cuda", capability, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(launch.kwargs)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, kwargs, bound, specialization, options
    )
    names = {(i,): name for i, name in enumerate(fn.arg_names)}
    return {
        "module": fn.fn.__module__,
        "kernel": fn.fn.__name__,
        "capability": capability,
        "signature": signature,
        "constexprs": constexprs,
        "attrs": attrs,
        "options": options.__dict__,
        "meta": {
            names.get(k, str(k)): v
            for k, v in constexprs.items()
            if isinstance(v, (bool, int, float, str)) and names.get(k, "").isupper()
        },
        "num_warps": options.num_warps,
        "case": launch.case,
    }


def _key(job: dict) -> str:
    return json.dumps(
        [
            job["module"],
            job["kernel"],
            job["capability"],
            job["signature"],
            sorted((str(k), str(v)) for k, v in job["constexprs"].items()),
            sorted((str(k), str(v)) for k, v in job["attrs"].items()),
            job["num_warps"],
        ]
    )


def _res_usage(cubin: bytes) -> dict:
    """Registers, stack and static shared bytes from the cubin (cuobjdump ships with Triton)."""
    import triton

    try:
        from triton import knobs

        tool = knobs.nvidia.cuobjdump.path
    except Exception:  # pragma: no cover - older layouts
        tool = os.path.join(
            os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"
        )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [tool, "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    for line in text.splitlines():
        if "REG:" in line:
            fields = dict(item.split(":", 1) for item in line.split() if ":" in item)
            return {
                "regs": int(fields["REG"]),
                "stack": int(fields["STACK"]),
                "static_shared": int(fields["SHARED"]),
                "local": int(fields["LOCAL"]),
            }
    raise RuntimeError(f"no resource usage in cuobjdump output:\n{text}")


def compile_job(job: dict) -> dict:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(job["module"]), job["kernel"])
    result = {k: job[k] for k in ("module", "kernel", "capability", "meta", "num_warps", "case")}
    result["signature"] = {k: v for k, v in job["signature"].items() if v != "constexpr"}
    start = time.perf_counter()
    try:
        compiled = triton.compile(
            ASTSource(fn, job["signature"], job["constexprs"], job["attrs"]),
            target=GPUTarget("cuda", job["capability"], 32),
            options=job["options"],
        )
        usage = _res_usage(compiled.asm["cubin"])
    except Exception as exc:  # a kernel that does not compile is the finding
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}"[-4000:])
        return result
    shared = int(compiled.metadata.shared) + usage["static_shared"]
    limit = SHARED_LIMIT.get(job["capability"], 99 * 1024)
    result.update(
        ok=True,
        shared=shared,
        shared_limit=limit,
        regs=usage["regs"],
        spill_bytes=usage["stack"] + usage["local"],
        compile_s=round(time.perf_counter() - start, 3),
    )
    return result


def run(grid: str, capabilities: list[int], jobs: int) -> dict:
    import triton

    _install_recorder()
    launches = record_launches(grid)
    work: dict[str, dict] = {}
    for launch in launches:
        for cap in capabilities:
            job = specialise(launch, cap)
            work.setdefault(_key(job), job)
    todo = list(work.values())
    if jobs > 1:
        import multiprocessing

        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(compile_job, todo))
    else:
        results = [compile_job(job) for job in todo]
    return {
        "triton": triton.__version__,
        "torch": torch.__version__,
        "grid": grid,
        "capabilities": capabilities,
        "launched_kernels": sorted(
            {f"{la.fn.fn.__module__}.{la.fn.fn.__name__}" for la in launches}
        ),
        "defined_kernels": defined_kernels(),
        "results": results,
    }


def defined_kernels() -> list[str]:
    """Every launchable kernel in pagemill.kernels._triton (helpers that only other kernels
    call, such as ``_find_seq``, are not launched on their own)."""
    import importlib

    from triton.runtime.jit import JITFunction

    from pagemill.kernels._triton import MODULES

    found = []
    for name in MODULES:
        module = importlib.import_module(name)
        fns = {n: v for n, v in vars(module).items() if isinstance(v, JITFunction)}
        for n in fns:
            called = any(other != n and f"{n}(" in fns[other].src for other in fns)
            if not called:
                found.append(f"{name}.{n}")
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grid", choices=("default", "full"), default="default")
    ap.add_argument("--capabilities", default="80,90", help="comma list, e.g. 80,90")
    ap.add_argument("--jobs", type=int, default=1, help="compile processes")
    ap.add_argument("--out", default="-", help="JSON file (- for stdout)")
    args = ap.parse_args(argv)
    report = run(args.grid, [int(c) for c in args.capabilities.split(",")], args.jobs)
    text = json.dumps(report, indent=1, default=str)
    if args.out == "-":
        print(text)
    else:
        with open(args.out, "w") as f:
            f.write(text)
    bad = [r for r in report["results"] if not r["ok"]]
    for r in report["results"]:
        status = (
            "FAIL"
            if not r["ok"]
            else (
                f"shared {r['shared']:>6} regs {r['regs']:>3} spill {r['spill_bytes']:>4} "
                f"{r['compile_s']:.2f}s"
            )
        )
        print(
            f"sm_{r['capability']} {r['kernel']:26s} {json.dumps(r['meta'])[:150]} "
            f"w{r['num_warps']} {status}",
            file=sys.stderr,
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
