"""PNG figures of a plan and of the simulated comparisons.

matplotlib is imported inside the functions (with the Agg backend) so that planning and
simulating never pay for it, and a headless machine never needs a display.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagemill.server.sim.experiments import Comparison
from pagemill.server.sim.plan import CapacityPlan


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_roofline(plan: CapacityPlan, path: str | Path) -> Path:
    """Decode step time and throughput vs batch size, with the crossover batch marked."""
    plt = _pyplot()
    sizes = [p.batch_size for p in plan.roofline]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ctx = f"{plan.context_len:,} ctx"
    pts = plan.roofline
    ax1.plot(sizes, [p.weights_only.time_s * 1e3 for p in pts], "o-", label="step, weights only")
    ax1.plot(
        sizes,
        [p.weights_only.memory_time_s * 1e3 for p in pts],
        "--",
        lw=0.8,
        label="weight streaming",
    )
    ax1.plot(sizes, [p.weights_only.compute_time_s * 1e3 for p in pts], ":", label="arithmetic")
    ax1.plot(sizes, [p.cost.time_s * 1e3 for p in pts], "s-", ms=4, label=f"step at {ctx}")
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("decode batch size")
    ax1.set_ylabel("ms per step")
    ax1.set_title("decode step roofline")
    ax2.plot(sizes, [p.weights_only_tokens_per_s for p in pts], "o-", label="weights only")
    ax2.plot(sizes, [p.tokens_per_s for p in pts], "s-", ms=4, label=f"at {ctx}")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("decode batch size")
    ax2.set_ylabel("tokens / s")
    ax2.set_title("decode throughput")
    ax2.legend(fontsize=8, loc="upper left")
    for ax in (ax1, ax2):
        if plan.crossover_batch:
            ax.axvline(plan.crossover_batch, color="grey", lw=0.8)
        if plan.max_concurrent_seqs:
            ax.axvline(plan.max_concurrent_seqs, color="red", lw=0.8, ls="--")
        ax.grid(True, which="both", alpha=0.3)
    ax1.legend(
        fontsize=7,
        loc="upper left",
        title=f"grey: crossover (weights only)\nred: max seqs at {ctx}",
        title_fontsize=7,
    )
    fig.suptitle(f"{plan.model.name} on {plan.gpu.name} ({plan.weight_dtype})")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_comparison(c: Comparison, path: str | Path) -> Path:
    """Right: the latency distribution the experiment is about (TTFT for static/prefix,
    inter-token latency for the budget sweep); left: KV memory holding real tokens over time,
    or for the budget sweep the latency percentiles of each budget side by side."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    if c.key == "budget":
        _latency_bars(ax1, c)
    else:
        _kv_timeline(ax1, c)
    use_itl = c.key == "budget"
    for r in c.runs:
        values = sorted(r.itls if use_itl else r.ttfts)
        if not values:
            continue
        stride = max(1, len(values) // 4000)
        idx = [*range(0, len(values), stride), len(values) - 1]
        ax2.plot(
            [values[i] * 1e3 for i in idx], [(i + 1) / len(values) for i in idx], lw=1, label=r.name
        )
    ax2.set_xscale("log")
    ax2.set_xlabel("inter-token latency (ms)" if use_itl else "time to first token (ms)")
    ax2.set_ylabel("CDF")
    if use_itl:
        ax2.set_ylim(0.9, 1.001)
        ax2.set_title("tail of the ITL distribution")
    ax2.legend(fontsize=7, loc="lower right")
    ax2.grid(True, which="both", alpha=0.3)
    fig.suptitle(c.title, fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _kv_timeline(ax: Any, c: Comparison) -> None:
    for r in c.runs:
        if r.timeline:
            points = r.timeline[:: max(1, len(r.timeline) // 1500)]  # plenty for a 1000 px plot
            ax.step(
                [t for t, _, _ in points],
                [u * 100 for _, u, _ in points],
                where="pre",
                lw=0.8,
                label=f"{r.name} ({r.kv_utilization:.0%})",
            )
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("% of reserved KV holding real tokens")
    ax.set_ylim(0, 105)
    ax.legend(fontsize=7, loc="center right")
    ax.grid(True, alpha=0.3)


def _latency_bars(ax: Any, c: Comparison) -> None:
    names = [r.name.replace(", ", "\n") for r in c.runs]
    xs = range(len(c.runs))
    width = 0.27
    series = [
        ("ITL p50", [r.itl_p50_s * 1e3 for r in c.runs]),
        ("ITL p99", [r.itl_p99_s * 1e3 for r in c.runs]),
        ("TTFT mean", [r.ttft_mean_s * 1e3 for r in c.runs]),
    ]
    for k, (label, values) in enumerate(series):
        ax.bar([x + (k - 1) * width for x in xs], values, width, label=label)
    ax.set_xticks(list(xs), names, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("ms")
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", which="both", alpha=0.3)
