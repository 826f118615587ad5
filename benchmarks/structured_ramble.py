"""How often the default model rambles under a JSON schema, with int8 activations and without.

    python benchmarks/structured_ramble.py                          # 40 seeds, modes 0 and 2
    python benchmarks/structured_ramble.py --seeds 60 --modes 0,2 --json out.json
    python benchmarks/structured_ramble.py --samples out.jsonl      # every text, to read them

The cases are those of `tests/test_structured_smollm2.py::test_many_json_schemas_validate`
(its 8 schemas and prompts, chat template, max_tokens 200) at temperatures 0.7 and 1.0,
each over `--seeds` seeds. A *ramble* is an answer that is not a valid instance of its
schema: it hit max_tokens ("length") or, which the grammar should make impossible, stopped
on text that does not parse or validate. One seeded sample is a coin flip, so the rates are
reported with Wilson 95% intervals, and the two modes are compared by a two-sided Fisher
exact test on the pooled counts.

`PAGEMILL_CPU_INT8_ACTIVATIONS` is read at import, so each mode's engine is built after
setting `Linear.int8_activations` (the layers keep the format they were finalized with);
both engines live in this process and take turns by chunks of seeds (ABAB), so load on the
box falls on both alike. The engines use the test server's `max_model_len` (1024) and at most
`--max-num-seqs` rows a step (16 by default: the int4 layers' packed path, where the
activation rounding differs, on every decode step; the test's 24 requests go dense while
more than the packed limit run); eager by default (the packed/dense choice per step is the
same Python branch as in a compiled graph), `--compile` for the compiled forward.

Each ramble is sorted by how it fails, from its text: "string" (it ends inside a string
that never closes), "number" (it ends in a run of digits), "whitespace" (at least half of
its characters are whitespace, or it ends in a whitespace run between tokens), or "other".
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_structured_smollm2 import PROMPTS, SCHEMAS  # the test's own cases

TEMPERATURES = (0.7, 1.0)
MAX_TOKENS = 200


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion k/n (95% by default)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def fisher_exact(a: int, n_a: int, b: int, n_b: int) -> float:
    """Two-sided Fisher exact test p-value of a/n_a vs b/n_b (sum of the tables at most as
    likely as the observed one, margins fixed)."""
    k, n = a + b, n_a + n_b

    def log_p(x: int) -> float:
        return (
            math.lgamma(k + 1)
            - math.lgamma(x + 1)
            - math.lgamma(k - x + 1)
            + math.lgamma(n - k + 1)
            - math.lgamma(n_a - x + 1)
            - math.lgamma(n_b - (k - x) + 1)
            - (math.lgamma(n + 1) - math.lgamma(n_a + 1) - math.lgamma(n_b + 1))
        )

    lo, hi = max(0, k - n_b), min(k, n_a)
    observed = log_p(a)
    return min(
        1.0, sum(math.exp(lp) for x in range(lo, hi + 1) if (lp := log_p(x)) <= observed + 1e-9)
    )


_DIGITS = re.compile(r"[0-9.eE+-]{16,}$")
_WS_RUN = re.compile(r"\s+$")


def open_string(text: str) -> str | None:
    """The unterminated string literal the text ends in, or None (JSON escapes honoured)."""
    inside, start, i = False, 0, 0
    while i < len(text):
        c = text[i]
        if inside and c == "\\":
            i += 2
            continue
        if c == '"':
            inside = not inside
            start = i
        i += 1
    return text[start:] if inside else None


def failure(text: str, reason: str | None, schema: dict[str, Any]) -> str | None:
    """None for a valid answer, else how it failed (see the module docstring)."""
    if reason not in ("stop", "length"):
        return "error"  # not run (e.g. a grammar compile past its deadline): not counted
    if reason == "stop":
        try:
            jsonschema.validate(json.loads(text), schema)
            return None
        except (ValueError, jsonschema.ValidationError):
            return "invalid"
    if open_string(text) is not None:
        return "string"
    if _DIGITS.search(text):
        return "number"
    ws = sum(c.isspace() for c in text)
    tail = _WS_RUN.search(text)
    if ws * 2 >= len(text) or (tail and len(tail.group(0)) >= 8):
        return "whitespace"
    return "other"


def build(planes: int, compile_: bool, max_num_seqs: int) -> Any:
    from pagemill.runtime import DEFAULT_MODEL, LLM
    from pagemill.runtime.model_executor.layers.linear import Linear

    Linear.int8_activations = planes
    if not compile_:
        os.environ["PAGEMILL_ENFORCE_EAGER"] = "1"
    llm = LLM(
        model=DEFAULT_MODEL,
        max_model_len=1024,
        kv_cache_memory_bytes=96 << 20,
        max_num_seqs=max_num_seqs,
        structured_outputs_compile_timeout=300.0,  # a loaded box: no request lost to it
    )
    model = llm.llm_engine.engine_core.model_runner.model
    formats = Counter(
        f"{m.format}" + (f" x{m.int8_act}" if m.int8_act else "")
        for m in model.modules()
        if isinstance(m, Linear)
    )
    print(f"mode {planes}: linear formats {dict(formats)}", flush=True)
    return llm


def run_chunk(llm: Any, seeds: range) -> list[dict[str, Any]]:
    from pagemill.runtime import SamplingParams, StructuredOutputsParams

    cases = [(name, t, seed) for seed in seeds for name in SCHEMAS for t in TEMPERATURES]
    defaults = llm.get_default_sampling_params()
    params = [
        SamplingParams(
            **{
                **{k: getattr(defaults, k) for k in ("top_p", "top_k", "min_p")},
                "temperature": t,
                "seed": seed,
                "max_tokens": MAX_TOKENS,
                "structured_outputs": StructuredOutputsParams(json=SCHEMAS[name]),
            }
        )
        for name, t, seed in cases
    ]
    convs = [
        [{"role": "user", "content": PROMPTS[name] + " Answer in JSON."}] for name, _, _ in cases
    ]
    outs = llm.chat(convs, params, use_tqdm=False)
    rows = []
    for (name, t, seed), out in zip(cases, outs):
        c = out.outputs[0]
        rows.append(
            {
                "schema": name,
                "temperature": t,
                "seed": seed,
                "finish_reason": c.finish_reason,
                "tokens": len(c.token_ids),
                "failure": failure(c.text, c.finish_reason, SCHEMAS[name]),
                "text": c.text,
            }
        )
    return rows


def summarize(rows: list[dict[str, Any]], modes: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in modes:
        errors = sum(1 for r in rows if r["mode"] == m and r["failure"] == "error")
        mine = [r for r in rows if r["mode"] == m and r["failure"] != "error"]
        bad = [r for r in mine if r["failure"]]
        lo, hi = wilson(len(bad), len(mine))
        per = {}
        for name, t in itertools.product(SCHEMAS, TEMPERATURES):
            cell = [r for r in mine if r["schema"] == name and r["temperature"] == t]
            per[f"{name}@{t}"] = f"{sum(1 for r in cell if r['failure'])}/{len(cell)}"
        out[str(m)] = {
            "n": len(mine),
            "not_run": errors,
            "rambles": len(bad),
            "rate": len(bad) / max(1, len(mine)),
            "wilson95": [lo, hi],
            "how": dict(Counter(r["failure"] for r in bad)),
            "per_case": per,
            "mean_tokens": sum(r["tokens"] for r in mine) / max(1, len(mine)),
        }
    if len(modes) == 2:
        a, b = (out[str(m)] for m in modes)
        out["fisher_p"] = fisher_exact(a["rambles"], a["n"], b["rambles"], b["n"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=40, help="seeds per schema and temperature")
    ap.add_argument("--chunk", type=int, default=4, help="seeds per turn of one mode")
    ap.add_argument("--modes", default="0,2", help="PAGEMILL_CPU_INT8_ACTIVATIONS values")
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument(
        "--max-num-seqs",
        type=int,
        default=16,
        help="rows of a decode step (16: the int4 layers' packed path on every step)",
    )
    ap.add_argument("--compile", action="store_true", help="compiled forward (default eager)")
    ap.add_argument("--json", help="write the summary here")
    ap.add_argument("--samples", help="write every answer here (JSON lines)")
    args = ap.parse_args()
    modes = [int(m) for m in args.modes.split(",")]
    engines = {m: build(m, args.compile, args.max_num_seqs) for m in modes}
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for start in range(args.first_seed, args.first_seed + args.seeds, args.chunk):
        seeds = range(start, min(start + args.chunk, args.first_seed + args.seeds))
        order = modes if (start // args.chunk) % 2 == 0 else modes[::-1]
        for m in order:
            chunk = run_chunk(engines[m], seeds)
            for r in chunk:
                r["mode"] = m
            rows += chunk
            bad = sum(1 for r in chunk if r["failure"])
            print(
                f"[{time.perf_counter() - t0:6.0f}s] mode {m} seeds "
                f"{seeds.start}-{seeds.stop - 1}: {bad}/{len(chunk)} rambles",
                flush=True,
            )
        if args.samples:
            with open(args.samples, "w") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
    summary = {
        "cases": "test_many_json_schemas_validate's 8 schemas x T 0.7, 1.0",
        "seeds": [args.first_seed, args.first_seed + args.seeds - 1],
        "max_tokens": MAX_TOKENS,
        "compiled": args.compile,
        "modes": summarize(rows, modes),
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
