"""Cost of grammar-constrained decoding per engine step, at a full batch of constrained requests.

    python benchmarks/structured_output.py                    # SmolLM2, 64 requests, CPU
    python benchmarks/structured_output.py --batch 64 --max-tokens 48 --json out.json

Every request carries a JSON schema (four distinct schemas, so compiles are shared as in
real traffic). The grammar work of a step is timed where it happens: filling the token
bitmask from each request's matcher (`StructuredOutputManager.grammar_bitmask`), applying
it to the logits in the sampler (`apply_token_bitmask`) and advancing every matcher by its
token (`accept_tokens`). Its share of the step is reported over the decode steps in which
every row of the batch is constrained (the target is <= 10%). The same prompts are then run
unconstrained for the plain step time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

from pagemill.runtime import DEFAULT_MODEL, LLMEngine, SamplingParams, StructuredOutputsParams
from pagemill.runtime.sample import sampler as sampler_module
from pagemill.runtime.sampling_params import RequestOutputKind

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 3},
        },
        "required": ["name", "age", "tags"],
    },
    {
        "type": "object",
        "properties": {
            "size": {"enum": ["small", "medium", "large"]},
            "notes": {"type": "array", "items": {"type": "string"}, "minItems": 4},
        },
        "required": ["size", "notes"],
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "lat": {"type": "number"},
            "lon": {"type": "number"},
            "landmarks": {"type": "array", "items": {"type": "string"}, "minItems": 3},
        },
        "required": ["city", "lat", "lon", "landmarks"],
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"type": "string"}, "v": {"type": "integer"}},
            "required": ["k", "v"],
        },
        "minItems": 6,
    },
]
PROMPTS = [
    "Describe a person in JSON.",
    "Order a pizza as JSON.",
    "Describe a city in JSON.",
    "List some key/value pairs in JSON.",
]


class Timer:
    """Wraps a callable and adds up the seconds spent in it during the current step."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.step_s = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.step_s += time.perf_counter() - t0


def run(engine: LLMEngine, batch: int, max_tokens: int, constrained: bool) -> dict[str, Any]:
    manager = engine.engine_core.structured_output
    assert manager is not None
    fill = Timer(manager.grammar_bitmask)
    accept = Timer(manager.accept_tokens)
    apply = Timer(sampler_module.apply_token_bitmask)
    manager.grammar_bitmask, manager.accept_tokens = fill, accept  # type: ignore[method-assign]
    sampler_module.apply_token_bitmask = apply
    try:
        for i in range(batch):
            so = StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)]) if constrained else None
            engine.add_request(
                f"{'c' if constrained else 'u'}{i}",
                engine.apply_chat_template([{"role": "user", "content": PROMPTS[i % 4]}]),
                SamplingParams(
                    temperature=0.8,
                    seed=i,
                    max_tokens=max_tokens,
                    ignore_eos=not constrained,
                    output_kind=RequestOutputKind.FINAL_ONLY,
                    structured_outputs=so,
                ),
            )
        steps: list[tuple[float, float, float, float]] = []
        while engine.has_unfinished_requests():
            fill.step_s = accept.step_s = apply.step_s = 0.0
            t0 = time.perf_counter()
            engine.step()
            step_s = time.perf_counter() - t0
            running = engine.engine_core.scheduler.get_stats().num_running
            if running == batch:
                steps.append((step_s, fill.step_s, apply.step_s, accept.step_s))
    finally:
        del manager.grammar_bitmask, manager.accept_tokens
        sampler_module.apply_token_bitmask = apply.fn
    full = steps[1:]  # the first full step still has prompt chunks in it
    if not full:
        raise SystemExit("no step ran the whole batch: raise --max-tokens or the KV pool")

    def ms(col: int) -> float:
        return 1e3 * statistics.median(s[col] for s in full)

    grammar = [s[1] + s[2] + s[3] for s in full]
    return {
        "steps": len(full),
        "step_ms": ms(0),
        "fill_bitmask_ms": ms(1),
        "apply_bitmask_ms": ms(2),
        "accept_tokens_ms": ms(3),
        "grammar_ms": 1e3 * statistics.median(grammar),
        "grammar_share": statistics.median(g / s[0] for g, s in zip(grammar, full)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--compile", action="store_true", help="compiled forward (default eager)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if not args.compile:
        os.environ["PAGEMILL_ENFORCE_EAGER"] = "1"
    # SmolLM2's KV is 23 KB a token (30 layers x 3 heads x 64 x K,V x bf16): room for
    # every request's prompt and answer at once, so no step preempts.
    per_seq = 64 + args.max_tokens + 16
    engine = LLMEngine(
        model=args.model,
        max_model_len=256,
        max_num_seqs=args.batch,
        kv_cache_memory_bytes=args.batch * per_seq * 64 * 1024 + (8 << 20),
    )
    # Warm-up: compile the four grammars and touch every code path once.
    run(engine, 4, 8, constrained=True)
    constrained = run(engine, args.batch, args.max_tokens, constrained=True)
    plain = run(engine, args.batch, args.max_tokens, constrained=False)
    result = {
        "model": args.model,
        "device": str(engine.device),
        "dtype": str(engine.dtype),
        "threads": torch.get_num_threads(),
        "batch": args.batch,
        "constrained": constrained,
        "unconstrained_step_ms": plain["step_ms"],
    }
    print(json.dumps(result, indent=2))
    share = constrained["grammar_share"]
    print(
        f"grammar + bitmask: {constrained['grammar_ms']:.2f} ms of a "
        f"{constrained['step_ms']:.1f} ms step = {100 * share:.1f}% "
        f"(target <= 10%); unconstrained step {plain['step_ms']:.1f} ms"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
