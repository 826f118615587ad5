"""N-gram speculation vs plain decoding at concurrency 1 on an input-grounded workload.

"Rewrite this text" prompts (the answer repeats much of the prompt, which is what prompt
lookup feeds on) through the default model (SmolLM2-135M-Instruct), greedy. Two engines live
in one process, one with `--speculative-config` and one without, and each prompt runs on
both back to back, so a shared, loaded machine slows both alike: compare the ratios.

Per request: inter-token latency (TPOT: (last token - first token) / (tokens - 1), vLLM's
definition, so several tokens landing in one step count as several), time to first token,
and whether the two greedy outputs are equal token for token. Speculation: acceptance rate
(accepted / drafted tokens) and mean accepted length (1 + accepted / drafts, tokens per
verify step).

    python benchmarks/spec_decode.py --json benchmarks/results/spec-decode-cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

TEXTS = [
    "The quarterly report shows that revenue grew by twelve percent, driven mostly by the new "
    "subscription plans. Costs rose more slowly than expected because the team moved the "
    "batch jobs to cheaper machines. The board asked for a plan to keep churn below three "
    "percent next year, and the sales team will present it in March.",
    "To install the tool, download the archive, unpack it into your home folder and add the "
    "bin directory to your PATH. Then run the setup command once; it creates a config file "
    "in your home folder. If the setup command fails, check that you have write access to "
    "that folder and that no older version of the tool is installed.",
    "Our library opens at nine in the morning and closes at six in the evening from Monday "
    "to Friday. On Saturdays it opens at ten and closes at two. Books can be borrowed for "
    "three weeks and renewed twice online. Late returns cost ten cents per day per book.",
    "The function reads the input file line by line, splits each line on commas, and keeps "
    "the rows whose third field is a positive number. It returns the kept rows as a list of "
    "tuples, in the order they appeared, and raises an error if the file does not exist.",
]
INSTRUCTION = "Rewrite the following text with better grammar, keeping its meaning:\n\n"


def tpot(out: Any) -> float | None:
    m = out.metrics
    n = len(out.outputs[0].token_ids)
    if n < 2 or m.first_token_time is None or m.last_token_time is None:
        return None
    return (m.last_token_time - m.first_token_time) / (n - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2, help="passes over the prompts")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=5)
    ap.add_argument("--compiled", action="store_true", help="the compiled step (default: eager)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from pagemill.runtime import LLM, SamplingParams

    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": args.lookup_min,
        "prompt_lookup_max": args.lookup_max,
    }
    common: dict[str, Any] = {"enforce_eager": not args.compiled, "max_num_seqs": 4}
    if args.model:
        common["model"] = args.model
    engines = {"base": LLM(**common), "ngram": LLM(speculative_config=spec, **common)}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    messages = [[{"role": "user", "content": INSTRUCTION + t}] for t in TEXTS]
    # Warm-up: one short request each (first-step costs, allocator).
    for llm in engines.values():
        llm.chat(messages[0], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)

    rows: list[dict[str, Any]] = []
    stats0 = engines["ngram"].llm_engine.get_stats()
    for r in range(args.rounds):
        for i, msg in enumerate(messages):
            row: dict[str, Any] = {"round": r, "prompt": i}
            outs = {}
            # Alternate which engine goes first, so drift on the box hits both alike.
            order = ["base", "ngram"] if (r + i) % 2 == 0 else ["ngram", "base"]
            for name in order:
                before = engines[name].llm_engine.get_stats()
                t0 = time.perf_counter()
                [out] = engines[name].chat(msg, params, use_tqdm=False)
                wall = time.perf_counter() - t0
                after = engines[name].llm_engine.get_stats()
                outs[name] = out
                row[name] = {
                    "tokens": len(out.outputs[0].token_ids),
                    "tpot_s": tpot(out),
                    "wall_s": wall,
                    "drafts": after.spec_num_drafts - before.spec_num_drafts,
                    "draft_tokens": after.spec_num_draft_tokens - before.spec_num_draft_tokens,
                    "accepted": after.spec_num_accepted_tokens - before.spec_num_accepted_tokens,
                }
            row["equal"] = outs["base"].outputs[0].token_ids == outs["ngram"].outputs[0].token_ids
            rows.append(row)
            b, s = row["base"], row["ngram"]
            print(
                f"round {r} prompt {i}: tokens {b['tokens']}/{s['tokens']}  "
                f"TPOT base {1000 * b['tpot_s']:.1f} ms  ngram {1000 * s['tpot_s']:.1f} ms  "
                f"(x{b['tpot_s'] / s['tpot_s']:.2f})  accepted {s['accepted']}/"
                f"{s['draft_tokens']}  equal={row['equal']}",
                flush=True,
            )
    stats1 = engines["ngram"].llm_engine.get_stats()
    drafts = stats1.spec_num_drafts - stats0.spec_num_drafts
    drafted = stats1.spec_num_draft_tokens - stats0.spec_num_draft_tokens
    accepted = stats1.spec_num_accepted_tokens - stats0.spec_num_accepted_tokens
    per_pos = [
        a - (stats0.spec_accepted_per_pos[i] if i < len(stats0.spec_accepted_per_pos) else 0)
        for i, a in enumerate(stats1.spec_accepted_per_pos)
    ]
    base_tpot = statistics.median(r["base"]["tpot_s"] for r in rows)
    spec_tpot = statistics.median(r["ngram"]["tpot_s"] for r in rows)
    ratios = [r["base"]["tpot_s"] / r["ngram"]["tpot_s"] for r in rows]
    summary = {
        "model": args.model or "default (SmolLM2-135M-Instruct)",
        "dtype": str(engines["base"].llm_engine.engine_core.dtype),
        "compiled": args.compiled,
        "speculative_config": spec,
        "max_tokens": args.max_tokens,
        "requests": len(rows),
        "median_tpot_ms": {"base": 1000 * base_tpot, "ngram": 1000 * spec_tpot},
        "tpot_speedup_median_of_ratios": statistics.median(ratios),
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
        "accepted_per_position": per_pos,
        "drafts": drafts,
        "greedy_outputs_equal": sum(r["equal"] for r in rows),
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
