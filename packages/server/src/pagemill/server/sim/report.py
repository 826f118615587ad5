"""Plain-text tables of simulated runs (what `pagemill simulate` prints)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from pagemill.server.sim.experiments import Comparison
from pagemill.server.sim.metrics import RunResult

# (header, width, formatter)
_COLUMNS: list[tuple[str, int, Callable[[RunResult], str]]] = [
    ("run", 26, lambda r: r.name),
    ("done", 6, lambda r: f"{r.num_finished}"),
    ("tok/s", 9, lambda r: f"{r.throughput_tok_s:,.0f}"),
    ("req/s", 7, lambda r: f"{r.request_throughput:.2f}"),
    ("TTFT ms", 9, lambda r: _ms(r.ttft_mean_s)),
    ("p99", 9, lambda r: _ms(r.ttft_p99_s)),
    ("TPOT ms", 8, lambda r: _ms(r.tpot_mean_s, 1)),
    ("ITL p50", 8, lambda r: _ms(r.itl_p50_s, 1)),
    ("ITL p99", 8, lambda r: _ms(r.itl_p99_s, 1)),
    ("ITL max", 8, lambda r: _ms(r.itl_max_s, 1)),
    ("KV used", 8, lambda r: _pct(r.kv_utilization)),
    ("batch", 6, lambda r: f"{r.mean_batch_size:.0f}"),
    ("prefill tok", 12, lambda r: f"{r.prompt_tokens_computed:,}"),
    ("hit", 5, lambda r: _pct(r.prefix_cache_hit_rate)),
    ("preempt", 7, lambda r: f"{r.num_preemptions}"),
]


def _ms(seconds: float, digits: int = 0) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:,.{digits}f}"


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.0%}"


def format_runs(runs: Sequence[RunResult]) -> str:
    header = " ".join(
        f"{h:<{w}}" if i == 0 else f"{h:>{w}}" for i, (h, w, _) in enumerate(_COLUMNS)
    )
    lines = [header, "-" * len(header)]
    for r in runs:
        cells = []
        for i, (_, w, fmt) in enumerate(_COLUMNS):
            text = fmt(r)
            cells.append(f"{text:<{w}}" if i == 0 else f"{text:>{w}}")
        lines.append(" ".join(cells))
    return "\n".join(lines)


def _describe(c: Comparison) -> str:
    w = c.workload
    rate = "all at t=0" if math.isinf(w.request_rate) else f"Poisson {w.request_rate:g} req/s"
    system = f", {w.system_prompt_len}-token system prompt" if w.system_prompt_len else ""
    return (
        f"{w.num_requests} requests, {rate}, prompt {w.prompt_len.kind} mean {w.prompt_len.mean}, "
        f"output {w.output_len.kind} mean {w.output_len.mean}{system}, seed {w.seed}"
    )


def _findings(c: Comparison) -> list[str]:
    """One-line ratios under each table: the claim each experiment is about."""
    runs = c.runs
    if c.key == "static" and len(runs) in (2, 4):
        s, p = runs[0], runs[1]
        lines = [
            f"saturated, paged vs static: throughput x{p.throughput_tok_s / s.throughput_tok_s:.2f}"
            f" ({p.throughput_tok_s:,.0f} vs {s.throughput_tok_s:,.0f} tok/s), KV holding real "
            f"tokens {p.kv_utilization:.0%} vs {s.kv_utilization:.0%}, mean batch "
            f"{p.mean_batch_size:.0f} vs {s.mean_batch_size:.0f}"
        ]
        if len(runs) == 4:
            s, p = runs[2], runs[3]
            lines.append(
                f"at {c.workload.request_rate:g} req/s, paged vs static: mean TTFT "
                f"{_ms(p.ttft_mean_s)} vs {_ms(s.ttft_mean_s)} ms, p99 TTFT "
                f"{_ms(p.ttft_p99_s)} vs {_ms(s.ttft_p99_s)} ms"
            )
        return lines
    if c.key == "prefix" and len(runs) == 2:
        off, on = runs
        return [
            f"cache on / off: prefill tokens computed x"
            f"{on.prompt_tokens_computed / max(off.prompt_tokens_computed, 1):.2f}, "
            f"mean TTFT {_ms(on.ttft_mean_s)} vs {_ms(off.ttft_mean_s)} ms, "
            f"throughput x{on.throughput_tok_s / off.throughput_tok_s:.2f}"
        ]
    if c.key == "budget" and runs:
        best = min(runs, key=lambda r: r.itl_p99_s)
        worst = max(runs, key=lambda r: r.itl_p99_s)
        return [
            f"lowest p99 ITL: {best.name} ({_ms(best.itl_p99_s, 1)} ms); "
            f"highest: {worst.name} ({_ms(worst.itl_p99_s, 1)} ms)"
        ]
    return []


def format_comparison(c: Comparison) -> str:
    return "\n".join(
        [f"== {c.title}", f"   workload: {_describe(c)}", format_runs(c.runs), *_findings(c)]
    )
