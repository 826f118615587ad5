"""Normalized latency vs request rate, static batching vs paged continuous batching (simulated).

The PagedAttention paper's headline figure plots, for each request rate, the mean of
(end-to-end latency / output tokens); a system "sustains" a rate while that stays flat and
explodes past its capacity. This script sweeps the rate on the simulator (the real pagemill
scheduler and block pool, a roofline cost model, no GPU) and prints the curve for both systems
and the highest rate each sustains. It prints figures, it asserts nothing.

    .venv/bin/python benchmarks/simulate.py --model llama-3.1-8b --gpu h100 --max-model-len 4096
"""

from __future__ import annotations

import argparse
import math
import time

from pagemill.blockpool.config import CacheConfig
from pagemill.scheduler.config import SchedulerConfig
from pagemill.server.config_args import add_config_args, config_kwargs
from pagemill.server.sim import (
    Deployment,
    LengthDist,
    PagedSimulator,
    StaticBatchSimulator,
    WorkloadSpec,
    generate_workload,
    load_gpu,
    load_model,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--gpu", default="h100")
    # The deployment's engine knobs, as `pagemill serve` spells and documents them.
    cache_flags = ("block_size", "gpu_memory_utilization")
    scheduler_flags = ("max_model_len", "max_num_seqs", "max_num_batched_tokens")
    add_config_args(ap, CacheConfig, cache_flags)
    add_config_args(ap, SchedulerConfig, scheduler_flags, defaults={"max_model_len": 4096})
    ap.add_argument("--num-requests", type=int, default=500)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--rates", default="5,10,15,20,30,40,50,60,80")
    ap.add_argument(
        "--slo-ms-per-token",
        type=float,
        default=50.0,
        help="a rate is sustained while normalized latency stays under this "
        "(50 ms/token = 20 tokens/s, faster than reading speed)",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    deployment = Deployment(
        load_model(args.model),
        load_gpu(args.gpu),
        **config_kwargs(args, (*cache_flags, *scheduler_flags)),
    )
    rates = [float(r) for r in args.rates.split(",")]
    print(
        f"{deployment.model.name} on {deployment.gpu.name}, max_model_len {args.max_model_len}, "
        f"{deployment.pool_blocks:,} KV blocks; {args.num_requests} requests, lognormal prompt "
        f"{args.prompt_len} / output {args.output_len}"
    )
    print(
        f"{'req/s':>7} {'static ms/tok':>14} {'paged ms/tok':>13} {'static tok/s':>13} "
        f"{'paged tok/s':>12}"
    )
    sustained = {"static": 0.0, "paged": 0.0}
    started = time.perf_counter()
    for rate in rates:
        spec = WorkloadSpec(
            num_requests=args.num_requests,
            prompt_len=LengthDist(args.prompt_len),
            output_len=LengthDist(args.output_len),
            request_rate=rate,
            seed=args.seed,
        )
        requests = generate_workload(spec, deployment.max_model_len)
        static = StaticBatchSimulator(deployment).run(requests)
        paged = PagedSimulator(deployment).run(requests)
        for key, r in (("static", static), ("paged", paged)):
            if r.normalized_latency_s * 1e3 <= args.slo_ms_per_token:
                sustained[key] = max(sustained[key], rate)
        print(
            f"{rate:>7g} {static.normalized_latency_s * 1e3:>14.1f} "
            f"{paged.normalized_latency_s * 1e3:>13.1f} {static.throughput_tok_s:>13,.0f} "
            f"{paged.throughput_tok_s:>12,.0f}"
        )
    ratio = sustained["paged"] / sustained["static"] if sustained["static"] else math.inf
    saturated = WorkloadSpec(
        num_requests=args.num_requests,
        prompt_len=LengthDist(args.prompt_len),
        output_len=LengthDist(args.output_len),
        seed=args.seed,
    )
    requests = generate_workload(saturated, deployment.max_model_len)
    cap_static = StaticBatchSimulator(deployment).run(requests).request_throughput
    cap_paged = PagedSimulator(deployment).run(requests).request_throughput
    print(
        f"capacity (all requests queued at t=0): static {cap_static:.1f}, paged "
        f"{cap_paged:.1f} req/s (x{cap_paged / cap_static:.2f})"
    )
    print(
        f"highest rate under {args.slo_ms_per_token:g} ms/token: static {sustained['static']:g}, "
        f"paged {sustained['paged']:g} req/s (x{ratio:.1f}); "
        f"{time.perf_counter() - started:.0f} s wall"
    )


if __name__ == "__main__":
    main()
