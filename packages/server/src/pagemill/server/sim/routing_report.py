"""What `pagemill simulate --replicas N` prints and writes: each router's totals and replicas,
then the routers side by side (text, JSON, and an HTML section for the `--html` page)."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pagemill.server.sim.metrics import RunResult
from pagemill.server.sim.replicas import ReplicaRun
from pagemill.server.sim.report import format_runs


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:,.0f}"


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.0%}"


def _balance(routed: Sequence[int]) -> str:
    lo, hi = min(routed), max(routed)
    return f"max/min {hi / lo:.2f}" if lo else "a replica got none"


def _hit_rate(run: ReplicaRun, k: int) -> float:
    q = run.prefix_queries[k]
    return run.prefix_hits[k] / q if q else math.nan


def format_router(run: ReplicaRun) -> str:
    """One router: the total over its replicas, then each replica ("done" = its requests)."""
    return "\n".join(
        [
            f"== router {run.router}: {len(run.replicas)} replicas",
            format_runs([_named(run.total, f"{run.router}: total"), *run.replicas]),
            f"requests per replica {run.routed} ({_balance(run.routed)}), prefill tokens "
            f"computed {run.prefill_tokens_computed:,} of {sum(run.prefix_queries):,}",
        ]
    )


def _named(result: RunResult, name: str) -> RunResult:
    return replace(result, name=name)


def format_routers(runs: Sequence[ReplicaRun]) -> str:
    """The routers' totals side by side, and each against round robin when it ran."""
    lines = ["== routers side by side", format_runs([r.total for r in runs])]
    base = next((r for r in runs if r.router == "round_robin"), None)
    for r in runs:
        if base is None or r is base:
            continue
        t, b = r.total, base.total
        lines.append(
            f"{r.router} vs round_robin: prefix hit rate {_pct(t.prefix_cache_hit_rate)} vs "
            f"{_pct(b.prefix_cache_hit_rate)}, prefill tokens computed "
            f"x{r.prefill_tokens_computed / max(base.prefill_tokens_computed, 1):.2f}, "
            f"TTFT p50 {_ms(t.ttft_p50_s)} vs {_ms(b.ttft_p50_s)} ms, p99 {_ms(t.ttft_p99_s)} "
            f"vs {_ms(b.ttft_p99_s)} ms, throughput x{t.throughput_tok_s / b.throughput_tok_s:.2f}"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- HTML

_ROWS: list[tuple[str, Any]] = [
    ("prefix-cache hit rate", lambda r, t: _pct(t.prefix_cache_hit_rate)),
    ("prefill tokens computed", lambda r, t: f"{r.prefill_tokens_computed:,}"),
    ("TTFT p50 / p99 (ms)", lambda r, t: f"{_ms(t.ttft_p50_s)} / {_ms(t.ttft_p99_s)}"),
    ("throughput (tok/s)", lambda r, t: f"{t.throughput_tok_s:,.0f}"),
    ("requests per replica", lambda r, t: " / ".join(map(str, r.routed))),
    ("preemptions", lambda r, t: str(t.num_preemptions)),
]

_STYLE = """
.routers { display: flex; gap: 12px; padding: 8px 16px; flex-wrap: wrap; }
.routers .router { flex: 1; min-width: 260px; background: #fff; border: 1px solid #d5dae1;
  border-radius: 6px; padding: 8px 12px; }
.routers h2 { font-size: 15px; margin: 0 0 6px; }
.routers table { border-collapse: collapse; width: 100%; font-size: 12px; }
.routers td, .routers th { padding: 2px 6px; text-align: right; border-bottom: 1px solid #eef0f3; }
.routers td:first-child, .routers th:first-child { text-align: left; }
"""


def routers_html(runs: Sequence[ReplicaRun], num_replicas: int) -> str:
    """One section per router (its totals, then a row per replica), side by side; every
    string escaped, no script: the replay page's own script draws the replicas' pools."""
    e = html.escape
    parts = [f"<style>{_STYLE}</style>", '<div class="routers" id="routers">']
    for r in runs:
        t = r.total
        parts.append(
            f'<section class="router" id="router-{e(r.router)}" data-router="{e(r.router)}">'
        )
        parts.append(f"<h2>router {e(r.router)} · {num_replicas} replicas</h2><table>")
        parts += [f"<tr><th>{e(label)}</th><td>{e(fmt(r, t))}</td></tr>" for label, fmt in _ROWS]
        parts.append("</table><table><tr><th>replica</th><th>requests</th><th>hit rate</th>")
        parts.append("<th>prefill tok</th><th>TTFT p50 ms</th><th>tok/s</th></tr>")
        for k, rep in enumerate(r.replicas):
            prefill = r.prefix_queries[k] - r.prefix_hits[k]
            cells = (
                str(k),
                str(r.routed[k]),
                _pct(_hit_rate(r, k)),
                f"{prefill:,}",
                _ms(rep.ttft_p50_s),
                f"{rep.throughput_tok_s:,.0f}" if not math.isnan(rep.throughput_tok_s) else "-",
            )
            parts.append("<tr>" + "".join(f"<td>{e(c)}</td>" for c in cells) + "</tr>")
        parts.append("</table></section>")
    parts.append("</div>")
    return "\n".join(parts)
