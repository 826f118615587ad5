"""The `pagemill plan` and `pagemill simulate` subcommands.

``register(subparsers)`` adds both to the `pagemill` CLI's subparsers; each sets
``func`` to a handler taking the parsed namespace and returning the exit status, so the main
CLI only does ``return args.func(args)``. ``main()`` runs them alone
(``python -m pagemill.server.sim plan ...``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pagemill.blockpool.config import CacheConfig
from pagemill.scheduler.config import SchedulerConfig
from pagemill.server.config_args import add_config_args, config_kwargs, positive_int
from pagemill.server.sim.experiments import (
    DEFAULT_BUDGETS,
    EXPERIMENTS,
    default_workloads,
    run_experiments,
)
from pagemill.server.sim.hardware import Deployment
from pagemill.server.sim.plan import DEFAULT_BATCH_SIZES, GIB, format_plan, make_plan
from pagemill.server.sim.replicas import ROUTERS
from pagemill.server.sim.report import format_comparison
from pagemill.server.sim.specs import known_gpus, known_models, load_gpu, load_model
from pagemill.server.sim.workload import DISTRIBUTIONS, ChatSpec, LengthDist


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'inf', got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0, got {text!r}")
    return value


def _routers(text: str) -> tuple[str, ...]:
    if text == "all":
        return ROUTERS
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [n for n in names if n not in ROUTERS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"{', '.join(bad) or repr(text)}: choose from {', '.join(ROUTERS)} (comma-separated) "
            "or 'all'"
        )
    return tuple(dict.fromkeys(names))


def _experiments(text: str) -> tuple[str, ...]:
    if text == "all":
        return EXPERIMENTS
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [n for n in names if n not in EXPERIMENTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"experiments: choose from {', '.join(EXPERIMENTS)} or 'all'"
        )
    return names


# The engine knobs each command models, as the engine's own flags (same names, types,
# defaults and help: derived from the config dataclasses).
_CACHE_FLAGS = ("block_size", "gpu_memory_utilization")
_PLAN_SCHEDULER_FLAGS = ("max_num_seqs", "max_num_batched_tokens")
_SIM_SCHEDULER_FLAGS = ("max_model_len", *_PLAN_SCHEDULER_FLAGS)
# A simulated deployment defaults to a 4k context (the scheduler's own default is 2048).
_SIM_DEFAULTS = {"max_model_len": 4096}


def _add_hardware_args(
    p: argparse.ArgumentParser,
    gpu: str,
    scheduler_flags: tuple[str, ...],
    defaults: Mapping[str, object] | None = None,
) -> None:
    p.add_argument(
        "--model",
        default="llama-3.1-8b",
        help=f"one of {', '.join(known_models())}, or a path to a HF config.json",
    )
    p.add_argument(
        "--gpu",
        default=gpu,
        help=f"one of {', '.join(known_gpus())}, or a JSON file with memory_bytes, "
        "bandwidth_bytes_per_s, bf16_flops",
    )
    p.add_argument("--weight-dtype", default="bf16", help="bf16 | fp16 | fp32 | fp8 | int8 | int4")
    p.add_argument(
        "--kv-dtype",
        "--kv-cache-dtype",
        default="bf16",
        help="bf16 | fp16 | fp32 | fp8 | fp8_e4m3 | fp8_e5m2 | int8 (8-bit: one byte per "
        "element, as the engine's --kv-cache-dtype fp8 / int8 stores it)",
    )
    add_config_args(p.add_argument_group("KV cache"), CacheConfig, _CACHE_FLAGS)
    add_config_args(
        p.add_argument_group("scheduler"), SchedulerConfig, scheduler_flags, defaults=defaults
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=positive_int,
        default=1,
        metavar="N",
        help="split the model over N GPUs (the engine's --tensor-parallel-size): "
        "per-GPU weights and KV heads, plus two all-reduces per layer costed "
        "from the GPU's link bandwidth and latency (default 1)",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `plan` and `simulate` to a CLI's subparsers."""
    plan = subparsers.add_parser(
        "plan",
        help="capacity plan: KV bytes, blocks, concurrent sequences, decode roofline",
        description="How many requests fit on a GPU and how fast a decode step can be "
        "(pure arithmetic; no GPU needed).",
    )
    _add_hardware_args(plan, "h200", _PLAN_SCHEDULER_FLAGS)
    plan.add_argument(
        "--context-len",
        type=int,
        default=None,
        help="context length per sequence (default min(8192, model limit))",
    )
    plan.add_argument(
        "--activation-reserve-gib",
        type=float,
        default=None,
        help="memory kept for activations (default: estimated from the token budget)",
    )
    plan.add_argument(
        "--batch-sizes",
        type=_int_list,
        default=DEFAULT_BATCH_SIZES,
        help="comma-separated decode batch sizes of the roofline table",
    )
    plan.add_argument(
        "--step-overhead-ms", type=float, default=0.0, help="fixed time added to every step"
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--plot", type=Path, default=None, help="write the roofline as a PNG here")
    plan.add_argument("--list", action="store_true", help="list the shipped models and GPUs")
    plan.set_defaults(func=cmd_plan)

    sim = subparsers.add_parser(
        "simulate",
        help="simulate serving on a GPU with the real scheduler and block pool",
        description="Deterministic discrete-event simulation of pagemill's scheduler and block "
        "pool with a roofline step-cost model: static vs paged batching, prefix caching, "
        "token budget vs inter-token latency.",
    )
    _add_hardware_args(sim, "h100", _SIM_SCHEDULER_FLAGS, _SIM_DEFAULTS)
    sim.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV pool size in blocks (default: what `plan` computes)",
    )
    sim.add_argument(
        "--step-overhead-ms",
        type=float,
        default=1.0,
        help="fixed time added to every step (launches, scheduling, sampling)",
    )
    sim.add_argument(
        "--experiments",
        type=_experiments,
        default=None,
        help=f"comma-separated subset of {', '.join(EXPERIMENTS)}, or 'all' (default all)",
    )
    sim.add_argument("--num-requests", type=int, default=None, help="(default 600)")
    sim.add_argument(
        "--request-rate",
        type=_rate,
        default=40.0,
        help="Poisson arrival rate in requests/s ('inf': all at t=0)",
    )
    sim.add_argument("--prompt-len", type=int, default=256, help="mean prompt length")
    sim.add_argument("--output-len", type=int, default=256, help="mean output length")
    sim.add_argument("--length-dist", choices=DISTRIBUTIONS, default="lognormal")
    sim.add_argument(
        "--length-spread",
        type=float,
        default=0.6,
        help="lognormal sigma / uniform relative half-width",
    )
    sim.add_argument(
        "--system-prompt-len",
        type=int,
        default=1024,
        help="shared system prompt of the prefix-caching experiment",
    )
    sim.add_argument(
        "--budgets",
        type=_int_list,
        default=None,
        help="token budgets of the chunked-prefill experiment (default "
        f"{','.join(map(str, DEFAULT_BUDGETS))})",
    )
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument(
        "--out-dir",
        type=Path,
        default=Path("pagemill-sim"),
        help="folder for the PNG plots and results.json",
    )
    sim.add_argument("--no-plots", action="store_true")
    sim.add_argument(
        "--html",
        type=Path,
        default=None,
        metavar="OUT",
        help="also write OUT, one self-contained page that replays every paged "
        "run in the dashboard's view (block pool, requests, charts); opens "
        "from disk, no server or network needed",
    )
    rep = sim.add_argument_group(
        "replicas behind a router (--replicas N)",
        "N copies of the deployment behind the engine's own router (the policy of "
        "`serve -dp N --data-parallel-routing` and of the Ray Serve replicas), each with its "
        "own scheduler and KV pool, on multi-turn chats over shared system prompts "
        "(--system-prompt-len tokens each; messages of --prompt-len and answers of "
        "--output-len tokens, clipped so a whole chat fits --max-model-len); reports each "
        "router's prefix-cache hit rate, prefill tokens, TTFT, throughput and requests per "
        "replica, and the routers side by side. Runs instead of the one-engine experiments.",
    )
    rep.add_argument(
        "--replicas", type=positive_int, default=None, metavar="N", help="number of replicas"
    )
    rep.add_argument(
        "--router",
        type=_routers,
        default=None,
        help=f"{' | '.join(ROUTERS)}, several comma-separated, or 'all' (default all)",
    )
    rep.add_argument(
        "--prefixes", type=positive_int, default=None, help="distinct system prompts (default 6)"
    )
    rep.add_argument(
        "--users-per-prefix",
        type=positive_int,
        default=None,
        help="chat users on each system prompt (default 8)",
    )
    rep.add_argument("--turns", type=positive_int, default=None, help="turns per chat (default 2)")
    sim.set_defaults(func=cmd_simulate)


def cmd_plan(args: argparse.Namespace) -> int:
    if args.list:
        print("models:", ", ".join(known_models()))
        print("gpus:  ", ", ".join(known_gpus()))
        return 0
    try:
        reserve = None
        if args.activation_reserve_gib is not None:
            reserve = int(args.activation_reserve_gib * GIB)
        plan = make_plan(
            load_model(args.model),
            load_gpu(args.gpu),
            weight_dtype=args.weight_dtype,
            kv_dtype=args.kv_dtype,
            context_len=args.context_len,
            activation_reserve_bytes=reserve,
            step_overhead_s=args.step_overhead_ms / 1e3,
            batch_sizes=args.batch_sizes,
            tensor_parallel_size=args.tensor_parallel_size,
            **config_kwargs(args, (*_CACHE_FLAGS, *_PLAN_SCHEDULER_FLAGS)),
        )
    except (ValueError, TypeError) as exc:
        print(f"pagemill plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan.as_dict(), indent=2))
    else:
        print(format_plan(plan))
    if args.plot is not None:
        from pagemill.server.sim.plots import plot_roofline

        args.plot.parent.mkdir(parents=True, exist_ok=True)
        print(
            f"wrote {plot_roofline(plan, args.plot)}", file=sys.stderr if args.json else sys.stdout
        )
    return 0


def _json_safe(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


_REPLICA_ONLY = ("router", "prefixes", "users_per_prefix", "turns")
_ENGINE_ONLY = ("experiments", "num_requests", "budgets")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _deployment(args: argparse.Namespace) -> Deployment:
    return Deployment(
        load_model(args.model),
        load_gpu(args.gpu),
        weight_dtype=args.weight_dtype,
        kv_dtype=args.kv_dtype,
        step_overhead_s=args.step_overhead_ms / 1e3,
        num_blocks=args.num_blocks,
        tensor_parallel_size=args.tensor_parallel_size,
        **config_kwargs(args, (*_CACHE_FLAGS, *_SIM_SCHEDULER_FLAGS)),
    )


def _describe_deployment(args: argparse.Namespace, deployment: Deployment) -> str:
    pool = deployment.pool_blocks
    return (
        f"{deployment.model.name} ({args.weight_dtype}) on "
        + (f"{args.tensor_parallel_size} x " if args.tensor_parallel_size > 1 else "")
        + f"{deployment.gpu.name}: "
        f"KV pool {pool:,} blocks x {args.block_size} = {deployment.kv_token_capacity:,} tokens, "
        f"max_model_len {args.max_model_len}, max_num_seqs {args.max_num_seqs}, "
        f"budget {args.max_num_batched_tokens} tokens/step"
    )


def cmd_simulate(args: argparse.Namespace) -> int:
    if args.replicas is not None:
        given = [_flag(d) for d in _ENGINE_ONLY if getattr(args, d) is not None]
        if given:
            print(
                f"pagemill simulate: error: {', '.join(given)} belong to the one-engine "
                "experiments, which --replicas does not run; run them separately",
                file=sys.stderr,
            )
            return 2
        return cmd_simulate_replicas(args)
    given = [_flag(d) for d in _REPLICA_ONLY if getattr(args, d) is not None]
    if given:
        print(f"pagemill simulate: error: {', '.join(given)} needs --replicas N", file=sys.stderr)
        return 2
    if args.experiments is None:
        args.experiments = EXPERIMENTS
    if args.num_requests is None:
        args.num_requests = 600
    if args.budgets is None:
        args.budgets = DEFAULT_BUDGETS
    try:
        deployment = _deployment(args)
        dist = {"kind": args.length_dist, "spread": args.length_spread}
        workloads = default_workloads(
            num_requests=args.num_requests,
            request_rate=args.request_rate,
            prompt_len=LengthDist(args.prompt_len, **dist),
            output_len=LengthDist(args.output_len, **dist),
            system_prompt_len=args.system_prompt_len,
            seed=args.seed,
        )
        pool = deployment.pool_blocks
    except (ValueError, TypeError) as exc:
        print(f"pagemill simulate: error: {exc}", file=sys.stderr)
        return 2
    print(_describe_deployment(args, deployment) + "\n")
    started = time.perf_counter()
    recorders: dict[str, object] = {}
    observe = None
    if args.html is not None:
        from pagemill.server.dashboard.replay import ReplayRecorder

        def observe(name: str) -> ReplayRecorder:
            return recorders.setdefault(name, ReplayRecorder(name))  # type: ignore[return-value]

    try:
        comparisons = run_experiments(
            deployment, workloads, args.experiments, args.budgets, observe
        )
    except (ValueError, TypeError) as exc:
        print(f"pagemill simulate: error: {exc}", file=sys.stderr)
        return 2
    for c in comparisons:
        print(format_comparison(c))
        print()
    print(f"(simulated in {time.perf_counter() - started:.1f} s of wall time)")

    out_dir: Path = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {
        c.key: {
            "title": c.title,
            "runs": [{k: _json_safe(v) for k, v in r.summary().items()} for r in c.runs],
        }
        for c in comparisons
    }
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n", "utf-8")
    print(f"wrote {out_dir / 'results.json'}")
    if args.html is not None:
        from pagemill.server.dashboard.replay import write_replay_html

        title = (
            f"{deployment.model.name} ({args.weight_dtype}) on {deployment.gpu.name}, "
            f"{pool:,} blocks"
        )
        runs = [r.as_dict() for r in recorders.values()]  # type: ignore[attr-defined]
        print(f"wrote {write_replay_html(args.html, runs, title)}")
    if not args.no_plots:
        from pagemill.server.sim.plots import plot_comparison

        for c in comparisons:
            print(f"wrote {plot_comparison(c, out_dir / f'{c.key}.png')}")
    return 0


def _chat_spec(args: argparse.Namespace) -> ChatSpec:
    """The chat workload of the flags; messages and answers are clipped so that a user's
    last turn (system prompt, every message and answer) fits max_model_len."""
    turns = args.turns or 2
    room = args.max_model_len - args.system_prompt_len
    cap = room // (2 * turns)
    if cap < 1:
        raise ValueError(
            f"--system-prompt-len {args.system_prompt_len} leaves no room for {turns} turns "
            f"under --max-model-len {args.max_model_len}"
        )
    dist = {"kind": args.length_dist, "spread": args.length_spread, "maximum": cap}
    return ChatSpec(
        prefixes=args.prefixes or 6,
        prefix_len=args.system_prompt_len,
        users_per_prefix=args.users_per_prefix or 8,
        turns=turns,
        message_len=LengthDist(min(args.prompt_len, cap), **dist),
        answer_len=LengthDist(min(args.output_len, cap), **dist),
        request_rate=args.request_rate,
        seed=args.seed,
    )


def cmd_simulate_replicas(args: argparse.Namespace) -> int:
    """`simulate --replicas N`: every router on one chat workload over N replicas."""
    from pagemill.server.sim.replicas import compare_routers
    from pagemill.server.sim.routing_report import format_router, format_routers, routers_html
    from pagemill.server.sim.workload import generate_chat_workload

    routers = args.router or ROUTERS
    try:
        deployment = _deployment(args)
        spec = _chat_spec(args)
        requests = generate_chat_workload(spec, deployment.max_model_len)
        header = _describe_deployment(args, deployment)
    except (ValueError, TypeError) as exc:
        print(f"pagemill simulate: error: {exc}", file=sys.stderr)
        return 2
    rate = "all at t=0" if math.isinf(spec.request_rate) else f"Poisson {spec.request_rate:g}/s"
    print(f"{args.replicas} replicas, each {header}")
    print(
        f"workload: {spec.prefixes} system prompts of {spec.prefix_len} tokens x "
        f"{spec.users_per_prefix} users x {spec.turns} turns = {len(requests)} requests "
        f"(users arrive {rate}; a turn is sent when the one before finished; messages "
        f"{args.length_dist} mean {spec.message_len.mean}, answers mean "
        f"{spec.answer_len.mean}), seed {spec.seed}\n"
    )
    started = time.perf_counter()
    recorders: dict[str, Any] = {}
    observe = None
    if args.html is not None:
        from pagemill.server.sim.replica_replay import ReplicaReplayRecorder

        def observe(name: str) -> Any:
            return recorders.setdefault(name, ReplicaReplayRecorder(f"router {name}")).on_step

    try:
        runs = compare_routers(deployment, requests, args.replicas, routers, observe)
    except (ValueError, TypeError, RuntimeError) as exc:
        print(f"pagemill simulate: error: {exc}", file=sys.stderr)
        return 2
    for run in runs:
        print(format_router(run))
        print()
    print(format_routers(runs))
    print(f"(simulated in {time.perf_counter() - started:.1f} s of wall time)")

    out_dir: Path = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {
        "routing": {
            "replicas": args.replicas,
            "num_requests": len(requests),
            "routers": {r.router: _json_tree(r.summary()) for r in runs},
        }
    }
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n", "utf-8")
    print(f"wrote {out_dir / 'results.json'}")
    if args.html is not None:
        from pagemill.server.dashboard.replay import write_replay_html

        title = (
            f"{args.replicas} x {deployment.model.name} ({args.weight_dtype}) on "
            f"{deployment.gpu.name}, {deployment.pool_blocks:,} blocks each"
        )
        recorded = [recorders[r.router].as_dict() for r in runs]
        page = write_replay_html(args.html, recorded, title, routers_html(runs, args.replicas))
        print(f"wrote {page}")
    return 0


def _json_tree(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _json_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_tree(v) for v in value]
    return _json_safe(value)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagemill", description="pagemill capacity tools")
    subparsers = parser.add_subparsers(dest="command", required=True)
    register(subparsers)
    args = parser.parse_args(argv)
    return int(args.func(args))
