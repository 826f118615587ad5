"""The three comparisons `pagemill simulate` runs, each on one shared workload.

1. static batching with max-length reservation vs paged continuous batching;
2. prefix caching off vs on when every request starts with the same system prompt;
3. the per-step token budget (chunked prefill) vs inter-token-latency spikes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from pagemill.server.sim.hardware import Deployment
from pagemill.server.sim.metrics import RunResult
from pagemill.server.sim.paged_sim import PagedSimulator, StepObserver
from pagemill.server.sim.static_sim import StaticBatchSimulator
from pagemill.server.sim.workload import LengthDist, WorkloadSpec, generate_workload

EXPERIMENTS = ("static", "prefix", "budget")
DEFAULT_BUDGETS = (256, 512, 2048, 8192)
# Given a paged run's name, the observer to watch it with (or None): `simulate --html`.
ObserverFactory = Callable[[str], StepObserver | None]


def _watch(observe: ObserverFactory | None, name: str) -> StepObserver | None:
    return observe(name) if observe is not None else None


@dataclass
class Comparison:
    """One experiment: a title, the workload it ran, the runs side by side."""

    key: str
    title: str
    workload: WorkloadSpec
    runs: list[RunResult]


def static_vs_paged(
    deployment: Deployment, workload: WorkloadSpec, observe: ObserverFactory | None = None
) -> Comparison:
    """Both systems on the same requests; with a finite arrival rate they also run saturated
    (everything queued at t = 0), where throughput is the system's capacity rather than the
    offered load."""
    loads = [replace(workload, request_rate=math.inf)]
    if math.isfinite(workload.request_rate):
        loads.append(workload)
    runs = []
    for load in loads:
        requests = generate_workload(load, deployment.max_model_len)
        tag = "saturated" if math.isinf(load.request_rate) else f"{load.request_rate:g} req/s"
        runs.append(StaticBatchSimulator(deployment, name=f"static, {tag}").run(requests))
        name = f"paged, {tag}"
        runs.append(
            PagedSimulator(deployment, name=name, observer=_watch(observe, f"static: {name}")).run(
                requests
            )
        )
    return Comparison(
        "static",
        "static batching (max-length reservation) vs paged continuous batching",
        workload,
        runs,
    )


def prefix_caching(
    deployment: Deployment, workload: WorkloadSpec, observe: ObserverFactory | None = None
) -> Comparison:
    """The same paged system with the prefix cache off and on: with a shared system prompt
    every admission after the first reuses its blocks, so prefill work and TTFT drop."""
    if workload.system_prompt_len == 0:
        raise ValueError("the prefix-caching comparison needs a workload with a system prompt")
    requests = generate_workload(workload, deployment.max_model_len)
    runs = [
        PagedSimulator(
            deployment,
            enable_prefix_caching=on,
            name=name,
            observer=_watch(observe, f"prefix: {name}"),
        ).run(requests)
        for on, name in ((False, "prefix cache off"), (True, "prefix cache on"))
    ]
    title = f"prefix caching off vs on ({workload.system_prompt_len}-token shared system prompt)"
    return Comparison("prefix", title, workload, runs)


def token_budget(
    deployment: Deployment,
    workload: WorkloadSpec,
    budgets: Sequence[int] = DEFAULT_BUDGETS,
    observe: ObserverFactory | None = None,
) -> Comparison:
    """Chunked prefill at several budgets, plus whole-prompt prefill.

    A step's duration is set by its biggest prefill, and every running decode waits for it:
    a small budget caps that wait (low p99 ITL) at the cost of slower prompts (TTFT) and, when
    too small to hold all decodes, of throughput. The unchunked run gets a budget of
    max(max_model_len, the largest budget) so any prompt fits one step.
    """
    if not budgets:
        raise ValueError("need at least one token budget")
    requests = generate_workload(workload, deployment.max_model_len)
    runs = []
    for budget in budgets:
        name = f"chunked, budget {budget}"
        sim = PagedSimulator(
            deployment,
            max_num_batched_tokens=budget,
            name=name,
            observer=_watch(observe, f"budget: {name}"),
        )
        runs.append(sim.run(requests))
    unchunked = max(deployment.max_model_len, max(budgets))
    name = f"unchunked, budget {unchunked}"
    sim = PagedSimulator(
        deployment,
        enable_chunked_prefill=False,
        max_num_batched_tokens=unchunked,
        name=name,
        observer=_watch(observe, f"budget: {name}"),
    )
    runs.append(sim.run(requests))
    return Comparison(
        "budget", "token budget / chunked prefill vs inter-token latency", workload, runs
    )


def default_workloads(
    num_requests: int,
    request_rate: float,
    prompt_len: LengthDist,
    output_len: LengthDist,
    system_prompt_len: int,
    seed: int,
) -> dict[str, WorkloadSpec]:
    """The workload of each experiment, derived from the CLI's one description.

    The prefix study prepends the shared system prompt (and shortens the user part so requests
    keep their size); the budget study uses 4x longer prompts so prefills are big enough to
    stall the decodes they share a step with.
    """
    base = WorkloadSpec(
        num_requests=num_requests,
        prompt_len=prompt_len,
        output_len=output_len,
        request_rate=request_rate,
        seed=seed,
    )
    user = replace(prompt_len, mean=max(1, prompt_len.mean // 2))
    long_prompt = replace(prompt_len, mean=prompt_len.mean * 4)
    return {
        "static": base,
        "prefix": replace(base, prompt_len=user, system_prompt_len=system_prompt_len),
        "budget": replace(base, prompt_len=long_prompt),
    }


def run_experiments(
    deployment: Deployment,
    workloads: dict[str, WorkloadSpec],
    which: Sequence[str] = EXPERIMENTS,
    budgets: Sequence[int] = DEFAULT_BUDGETS,
    observe: ObserverFactory | None = None,
) -> list[Comparison]:
    unknown = [w for w in which if w not in EXPERIMENTS]
    if unknown:
        raise ValueError(f"unknown experiment(s) {unknown}; choose from {EXPERIMENTS}")
    out = []
    for key in which:
        if key == "static":
            out.append(static_vs_paged(deployment, workloads["static"], observe))
        elif key == "prefix":
            out.append(prefix_caching(deployment, workloads["prefix"], observe))
        else:
            out.append(token_budget(deployment, workloads["budget"], budgets, observe))
    return out
