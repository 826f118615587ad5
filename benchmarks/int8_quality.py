"""Quality of the packed int4 / Q8_0 kernels on the default model, judged as llama.cpp's
perplexity tool judges a quantization: next-token distributions over a fixed text, teacher
forced, against a reference.

    uv run python benchmarks/int8_quality.py [--windows 16] [--ctx 512] [--rows 4]
        [--json benchmarks/results/int8-quality-smollm2.json]

Models, all from the default model's Q4_1 GGUF, built in one process and stepped in lockstep:

- `ref fp32`: the GGUF dequantized to fp32, dense, fp32 activations (the reference);
- `dense bf16`: the same dequantized weights as dense bf16 copies (what prefill and large
  batches run), as context for the size of a bf16 rounding;
- `int8 x0`: `PAGEMILL_CPU_INT8_ACTIVATIONS=0`, PyTorch's int4 kernel with bf16 activations
  (the Q8_0 LM head as two int4 planes);
- `int8 x1`, `int8 x2`: pagemill's `gemv_q4` / `gemv_q8` with activations rounded to one
  int8 plane per block of 32 (llama.cpp's rounding) or two (a residual plane);
- `x1 qkv+gate_up`, `x1 o+down`, `x1 head`: two planes but for the named layers, which get
  one: which layers' inputs one plane hurts (one plane halves a compute-bound step's
  integer work, so a group that took it harmlessly would be worth serving that way).

The setting is read at import, so it is set on `Linear` before each model is built, and each
model's layers are checked to be laid out for it. The text is cut into `--windows`
non-overlapping windows of `--ctx` tokens; each window is one request, fed one token per
step as a decode step does (`--rows` requests per step, no more than the smallest
packed-to-dense limit of any layer, the LM head's included), so every packed layer runs its
packed kernel; calls are counted and a dense-copy call on a packed layer fails the run.
Every position but the last of a window is scored (the first predicts the window's
second token from one token of context).

The text ships with the OS: `/usr/share/common-licenses/GPL-3`, then `Apache-2.0`, `MPL-2.0`
while more tokens are needed.

Per model: perplexity of the text, and against the reference the mean and p99 of
KL(ref || model) and top-1 agreement; for x1 and x2, the paired differences from x0 (same
positions). Confidence intervals: bootstrap over windows (positions within a window are not
independent), 95%, percentile.

One thread by default (`--threads`): on a shared machine, OpenMP workers waiting on each
other cost more than they bring at a few rows; the kernels' results do not depend on it.

Eager (`enforce_eager`): the packed kernels are opaque custom operators in a compiled graph
too, so compiling changes only the fusion of the elementwise code around them, the same for
every model.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

# The fixed table of packed-to-dense limits: deterministic, and nothing measured at start.
os.environ.setdefault("PAGEMILL_PACKED_LIMITS", "table")
os.environ.setdefault("PAGEMILL_COMPILE", "0")

from pagemill.runtime import DEFAULT_MODEL, LLM
from pagemill.runtime.model_executor.layers.linear import Linear

TEXTS = [Path("/usr/share/common-licenses") / n for n in ("GPL-3", "Apache-2.0", "MPL-2.0")]
REF = "ref fp32"
BASE = "int8 x0"
# name -> (dtype, PAGEMILL_CPU_INT8_ACTIVATIONS, dense copies only)
MODELS: dict[str, tuple[str, int, bool]] = {
    REF: ("float32", 0, True),
    "dense bf16": ("bfloat16", 0, True),
    BASE: ("bfloat16", 0, False),
    "int8 x1": ("bfloat16", 1, False),
    "int8 x2": ("bfloat16", 2, False),
    "x1 qkv+gate_up": ("bfloat16", 2, False),
    "x1 o+down": ("bfloat16", 2, False),
    "x1 head": ("bfloat16", 2, False),
}
# Two-plane models with some layers moved to one plane: which layers (module name suffixes).
ONE_PLANE: dict[str, tuple[str, ...]] = {
    "x1 qkv+gate_up": ("qkv_proj", "gate_up_proj"),
    "x1 o+down": ("o_proj", "down_proj"),
    "x1 head": ("logits_proj",),
}

CALLS: Counter[tuple[str, str]] = Counter()  # (model, path) -> calls
NOW = {"model": ""}


def _count_calls() -> None:
    packed, dense = Linear._packed, Linear._dense

    def counted_packed(self: Linear, x: torch.Tensor) -> torch.Tensor:
        kind = f"packed {self.weight_format} x{self.int8_act}"
        CALLS[NOW["model"], kind] += 1
        return packed(self, x)

    def counted_dense(self: Linear, x: torch.Tensor) -> torch.Tensor:
        kind = "dense" if self.format == "dense" else f"dense copy of {self.weight_format}"
        CALLS[NOW["model"], kind] += 1
        return dense(self, x)

    Linear._packed = counted_packed  # type: ignore[method-assign]
    Linear._dense = counted_dense  # type: ignore[method-assign]


def build(name: str) -> tuple[Any, Any]:
    """(LLM, its model) for `name`, laid out as the mode asks."""
    dtype, planes, dense_only = MODELS[name]
    Linear.int8_activations = planes
    llm = LLM(
        DEFAULT_MODEL,
        dtype=dtype,
        enforce_eager=True,
        max_model_len=640,
        kv_cache_memory_bytes=64 << 20,
    )
    model = llm.llm_engine.engine_core.model_runner.model
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert layers, "no Linear layers"
    formats = Counter((m.weight_format, m.int8_act) for m in layers)
    if dense_only:
        for m in layers:
            if m.format != "dense":
                m.packed_max_tokens = 0  # every call on its dense copy
                assert m.has_dense_fallback, f"{name}: a packed layer without a dense copy"
    elif planes:
        assert all(m.int8_act == planes for m in layers if m.format != "dense"), formats
        assert model.logits_proj is not None and model.logits_proj.weight_format == "q8_0"
        moved = [
            m
            for path, m in model.named_modules()
            if isinstance(m, Linear) and path.endswith(ONE_PLANE.get(name, ()))
        ]
        assert bool(moved) == (name in ONE_PLANE), (name, len(moved))
        for m in moved:
            m.int8_act = 1
        formats = Counter((m.weight_format, m.int8_act) for m in layers)
    else:
        assert all(m.int8_act == 0 for m in layers), formats
        assert any(m.weight_format == "int4" for m in layers), formats
    print(f"{name}: {dict(formats)}", flush=True)
    return llm, model


def text_tokens(tok: Any, n: int) -> tuple[list[int], list[str]]:
    ids: list[int] = []
    used = []
    for path in TEXTS:
        if len(ids) >= n:
            break
        ids += tok.encode(path.read_text())
        used.append(str(path))
    assert len(ids) >= n, f"{len(ids)} tokens in {used}, {n} wanted"
    return ids[:n], used


class Stepper:
    """Decode steps over windows through a runner of the model's own."""

    def __init__(self, model: Any, dtype: torch.dtype, rows: int, ctx: int) -> None:
        from pagemill.runtime.worker.model_runner import ModelRunner

        self.model, self.ctx = model, ctx
        self.blocks = -(-ctx // 16)
        self.runner = ModelRunner(
            model, model.config, torch.device("cpu"), dtype, 16, rows, rows, ctx + 16
        )
        self.runner.init_kv_cache(self.blocks * rows)
        self.finished: list[str] = []

    def steps(self, windows: list[list[int]], tag: str) -> Any:
        """Yields [rows, vocab] fp32 log-probs after each position of `windows`."""
        from pagemill.runtime.sampling_params import SamplingParams as SP
        from pagemill.scheduler import Request, ScheduledRequest, SchedulerOutput

        reqs = [
            Request(f"{tag}-{i}", w, sampling_params=SP(temperature=0.0))
            for i, w in enumerate(windows)
        ]
        for pos in range(self.ctx - 1):
            sched = [
                ScheduledRequest(
                    r.request_id,
                    [w[pos]],
                    pos,
                    1,
                    list(range(i * self.blocks, (i + 1) * self.blocks)) if pos == 0 else [],
                    True,
                    pos == 0,
                    r,
                )
                for i, (r, w) in enumerate(zip(reqs, windows, strict=True))
            ]
            out = SchedulerOutput(sched, len(sched), [], self.finished if pos == 0 else [])
            batch = self.runner.prepare(out)
            assert batch is not None
            with torch.inference_mode():
                hidden = self.model(batch.input_ids, batch.positions, batch.attn)
                logits = self.model.compute_logits(hidden)
            yield torch.log_softmax(logits.float(), dim=-1)
        self.finished = [r.request_id for r in reqs]


def bootstrap(
    per_window: dict[str, np.ndarray], stat: Any, reps: int, rng: np.random.Generator
) -> tuple[float, float, float]:
    """stat over all windows, and its 95% percentile interval over windows resampled."""
    n = next(iter(per_window.values())).shape[0]
    point = stat({k: v for k, v in per_window.items()})
    samples = []
    for _ in range(reps):
        idx = rng.integers(0, n, n)
        samples.append(stat({k: v[idx] for k, v in per_window.items()}))
    lo, hi = np.percentile(samples, [2.5, 97.5])
    return float(point), float(lo), float(hi)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--rows", type=int, default=4, help="requests per decode step")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--bootstrap", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    names = args.models.split(",")
    assert REF in names and set(names) <= set(MODELS), names
    assert args.windows % args.rows == 0, "--windows must be a multiple of --rows"
    _count_calls()

    built = {n: build(n) for n in names}
    limits = {
        n: min(
            m.packed_max_tokens
            for m in model.modules()
            if isinstance(m, Linear) and m.format != "dense" and m.packed_max_tokens > 0
        )
        for n, (_, model) in built.items()
        if not MODELS[n][2]
    }
    assert all(args.rows <= lim for lim in limits.values()), (
        f"--rows {args.rows} is past a packed-to-dense limit: {limits}"
    )
    tok = built[REF][0].get_tokenizer()
    ids, used = text_tokens(tok, args.windows * args.ctx)
    windows = [ids[i * args.ctx : (i + 1) * args.ctx] for i in range(args.windows)]
    steppers = {
        n: Stepper(model, getattr(torch, MODELS[n][0]), args.rows, args.ctx)
        for n, (_, model) in built.items()
    }

    npos = args.ctx - 1
    nll = {n: np.zeros((args.windows, npos)) for n in names}
    kl = {n: np.zeros((args.windows, npos)) for n in names}
    top1 = {n: np.zeros((args.windows, npos), dtype=bool) for n in names}
    t0 = time.perf_counter()
    for g in range(0, args.windows, args.rows):
        group = windows[g : g + args.rows]
        gens = {n: s.steps(group, f"g{g}") for n, s in steppers.items()}
        target = torch.tensor([[w[p + 1] for w in group] for p in range(npos)])
        for pos in range(npos):
            logp = {}
            for n in names:
                NOW["model"] = n
                logp[n] = next(gens[n])
            ref = logp[REF]
            p_ref = ref.exp()
            ref_top = ref.argmax(-1)
            rows = slice(g, g + len(group))
            for n in names:
                lp = logp[n]
                nll[n][rows, pos] = (-lp.gather(1, target[pos][:, None])[:, 0]).numpy()
                kl[n][rows, pos] = (p_ref * (ref - lp)).sum(-1).clamp_min(0).numpy()
                top1[n][rows, pos] = (lp.argmax(-1) == ref_top).numpy()
        for gen in gens.values():
            assert next(gen, None) is None
        print(
            f"windows {g + len(group)}/{args.windows}  {time.perf_counter() - t0:.0f} s", flush=True
        )

    # Every packed layer ran packed, on every step.
    steps = args.windows // args.rows * npos
    for n in names:
        calls = {k: v for (m, k), v in CALLS.items() if m == n}
        if MODELS[n][2]:
            assert not any(k.startswith("packed") for k in calls), (n, calls)
        else:
            assert not any(k.startswith("dense copy") for k in calls), (n, calls)
            packed = sum(v for k, v in calls.items() if k.startswith("packed"))
            n_packed = sum(
                1 for m in built[n][1].modules() if isinstance(m, Linear) and m.format != "dense"
            )
            assert packed == n_packed * steps, (n, calls, n_packed, steps)
        print(f"{n}: calls {calls}")

    rng = np.random.default_rng(0)
    reps = args.bootstrap
    results: dict[str, Any] = {}
    for n in names:
        w = {"nll": nll[n], "kl": kl[n], "top1": top1[n].astype(float)}
        r: dict[str, Any] = {
            "perplexity": bootstrap(w, lambda d: np.exp(d["nll"].mean()), reps, rng),
        }
        if n != REF:
            r["kl_mean"] = bootstrap(w, lambda d: d["kl"].mean(), reps, rng)
            r["kl_p99"] = bootstrap(w, lambda d: np.percentile(d["kl"], 99), reps, rng)
            r["kl_max"] = float(kl[n].max())
            r["top1_agreement"] = bootstrap(w, lambda d: d["top1"].mean(), reps, rng)
        if n not in (REF, BASE) and BASE in names:
            d = {
                "dnll": nll[n] - nll[BASE],
                "dkl": kl[n] - kl[BASE],
                "dtop1": top1[n].astype(float) - top1[BASE],
            }
            r[f"vs {BASE}"] = {
                "kl_mean_diff": bootstrap(d, lambda d: d["dkl"].mean(), reps, rng),
                "kl_mean_ratio": bootstrap(
                    {"a": kl[n], "b": kl[BASE]},
                    lambda d: d["a"].mean() / d["b"].mean(),
                    reps,
                    rng,
                ),
                "perplexity_ratio": bootstrap(d, lambda d: np.exp(d["dnll"].mean()), reps, rng),
                "top1_diff": bootstrap(d, lambda d: d["dtop1"].mean(), reps, rng),
            }
        results[n] = r

    def fmt(v: tuple[float, float, float], spec: str = ".5f") -> str:
        return f"{v[0]:{spec}} [{v[1]:{spec}}, {v[2]:{spec}}]"

    print(f"\n{args.windows} windows x {args.ctx} tokens ({args.windows * npos} scored), {used}")
    for n, r in results.items():
        line = f"{n:>11}: ppl {fmt(r['perplexity'], '.4f')}"
        if n != REF:
            line += (
                f"  KL mean {fmt(r['kl_mean'])}  p99 {fmt(r['kl_p99'])}"
                f"  top1 {fmt(r['top1_agreement'], '.4f')}"
            )
        print(line)
        for k, v in r.get(f"vs {BASE}", {}).items():
            print(f"{'':>13}{k} vs {BASE}: {fmt(v, '.5f')}")

    if args.json:
        load = os.getloadavg()
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "command": "python benchmarks/int8_quality.py "
                    + " ".join(
                        f"--{k.replace('_', '-')} {v}"
                        for k, v in vars(args).items()
                        if k != "json" and v is not None
                    ),
                    "model": DEFAULT_MODEL + " (Q4_1 GGUF)",
                    "text": used,
                    "windows": args.windows,
                    "ctx": args.ctx,
                    "rows_per_step": args.rows,
                    "scored_positions": args.windows * npos,
                    "ci": "95% percentile bootstrap over windows, "
                    f"{reps} resamples: [point, lo, hi]",
                    "kl": f"KL({REF} || model) in nats per position",
                    "calls": {f"{m}: {k}": v for (m, k), v in sorted(CALLS.items())},
                    "torch": torch.__version__,
                    "cpu": platform.processor() or platform.machine(),
                    "threads": torch.get_num_threads(),
                    "loadavg_at_end": [round(x, 2) for x in load],
                    "seconds": round(time.perf_counter() - t0),
                    "results": results,
                },
                indent=1,
            )
            + "\n"
        )
        print(f"wrote {args.json}")
    for llm, _ in built.values():
        llm.llm_engine.shutdown()


if __name__ == "__main__":
    main()
