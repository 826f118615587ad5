"""Shared-prefix chat traffic over N data-parallel engine cores: prefix hits, prefill, TTFT.

The workload (`chat_workload`): K long system prompts or documents, U users on each, every
user a few turns; a turn's prompt is the system prompt, the user's conversation so far
(messages and answers) and a new message, so a user's later turns share more than the
system prompt with the earlier ones. Users arrive in a random order and take their turns
in order, interleaved with the others. `--prefixes 1` is the single-prefix workload (every
request shares one prompt: routing must then spread the load, there is nothing to keep).

Two ways to run it:

- against a running server (`--url`): each turn a streamed /v1/completions call, sent
  `--concurrency` at a time; TTFT is the first token's arrival, the prefix hit rate and
  the prefill tokens computed come from the server's own counters
  (pagemill:prefix_cache_hits / _queries before and after the run), per engine too.

      pagemill serve MODEL -dp 2 --data-parallel-routing prefix --kv-cache-memory 12MiB &
      python benchmarks/dp_prefix_routing.py --url http://127.0.0.1:8000

- `--simulate`: no model, no server: the real router (`DPRouter`) in front of N real
  schedulers and block pools, one step of each per tick, each core's KV events fed back to
  the router as `DPClient` feeds them; prints every policy's figures on the same workload.
  Deterministic (a seed), a second or two; the routing tests run it. It is
  `pagemill simulate --replicas N --router all`'s loop with a step costing one tick; that
  command adds the roofline step cost of a model on a GPU, TTFT and throughput.

      python benchmarks/dp_prefix_routing.py --simulate --cores 2 --pool-blocks 100
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
import statistics
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class Turn:
    user: int
    prefix: int  # which system prompt
    prompt: list[int]


def chat_workload(
    *,
    prefixes: int = 6,
    prefix_len: int = 400,
    users_per_prefix: int = 8,
    turns: int = 2,
    message_len: int = 24,
    answer_len: int = 24,
    vocab_size: int = 30000,
    seed: int = 0,
) -> list[Turn]:
    """Every user's turns, in arrival order (a user's turns in order, users interleaved):
    `pagemill simulate --replicas`'s chat workload (`pagemill.server.sim.ChatSpec`) with
    fixed lengths."""
    from pagemill.server.sim import ChatSpec, LengthDist, generate_chat_workload

    spec = ChatSpec(
        prefixes=prefixes,
        prefix_len=prefix_len,
        users_per_prefix=users_per_prefix,
        turns=turns,
        message_len=LengthDist(message_len, kind="fixed"),
        answer_len=LengthDist(answer_len, kind="fixed"),
        vocab_size=vocab_size,
        seed=seed,
    )
    return [
        Turn(r.user or 0, r.group or 0, list(r.prompt_token_ids))
        for r in generate_chat_workload(spec)
    ]


# ---------------------------------------------------------------- simulation (no model)


def simulate(
    workload: list[Turn],
    policy: str,
    *,
    cores: int = 2,
    pool_blocks: int = 100,
    block_size: int = 16,
    max_tokens: int = 8,
    arrivals_per_tick: int = 1,
    max_num_batched_tokens: int = 512,
) -> dict[str, Any]:
    """The workload through the real router and N real schedulers and block pools
    (`pagemill.server.sim.ReplicaSimulator`, the loop of `pagemill simulate --replicas`),
    every step costing one tick, so the cores step in lockstep.

    Each tick `arrivals_per_tick` requests arrive and are routed (a turn is sent on its
    tick whether or not the turn before it has finished); then every core with work runs
    one scheduler step, and its KV events go to the router as a core's outputs carry them
    to `DPClient`.
    """
    from pagemill.scheduler.config import SchedulerConfig
    from pagemill.server.sim import ReplicaSimulator, SimRequest

    requests = [
        SimRequest(i, f"u{t.user}-{i}", float(i // arrivals_per_tick), tuple(t.prompt), max_tokens)
        for i, t in enumerate(workload)
    ]
    config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max(len(t.prompt) for t in workload) + max_tokens,
    )
    sim = ReplicaSimulator(
        cores,
        policy,
        num_blocks=pool_blocks,
        block_size=block_size,
        scheduler_config=config,
        step_time=lambda chunks: 1.0,
    )
    run = sim.run(requests)
    queries, hits = sum(run.prefix_queries), sum(run.prefix_hits)
    return {
        "policy": policy,
        "requests": len(workload),
        "routed": run.routed,
        "prefix_hit_rate": round(hits / queries, 4) if queries else None,
        "prefill_tokens_computed": run.prefill_tokens_computed,
        "prompt_tokens": queries,
        "per_engine_hit_rate": [
            round(h / q, 4) if q else None
            for q, h in zip(run.prefix_queries, run.prefix_hits, strict=True)
        ],
        "ticks": round(run.total.duration_s),
    }


# ---------------------------------------------------------------- against a server


def counters(url: str) -> dict[str, float]:
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for m in re.finditer(r"^pagemill:(\w+)_total\{([^}]*)\} (\S+)$", text, re.M):
        name, labels, value = m.groups()
        engine = re.search(r'engine="(\d+)"', labels)
        key = name + (f"[{engine.group(1)}]" if engine else "")
        out[key] = out.get(key, 0.0) + float(value)
    return out


def one(url: str, model: str, prompt: list[int], max_tokens: int) -> float:
    import httpx

    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    t0 = time.perf_counter()
    ttft = None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and ttft is None and line != "data: [DONE]":
                ttft = time.perf_counter() - t0
    assert ttft is not None
    return ttft


def against_server(args: argparse.Namespace, workload: list[Turn]) -> dict[str, Any]:
    import httpx

    model = args.model or httpx.get(args.url + "/v1/models").json()["data"][0]["id"]
    # A user's next turn waits for the previous one's answer, as in a chat.
    done: dict[int, concurrent.futures.Future[float]] = {}

    def turn(t: Turn, before: concurrent.futures.Future[float] | None) -> float:
        if before is not None:
            before.result()
        return one(args.url, model, t.prompt, args.max_tokens)

    before = counters(args.url)
    t0 = time.perf_counter()
    futures = []
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        for t in workload:
            f = pool.submit(turn, t, done.get(t.user))
            done[t.user] = f
            futures.append(f)
        ttfts = sorted(f.result() for f in futures)
    wall = time.perf_counter() - t0
    after = counters(args.url)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    q, h = delta.get("prefix_cache_queries", 0.0), delta.get("prefix_cache_hits", 0.0)
    return {
        "requests": len(ttfts),
        "wall_s": round(wall, 2),
        "ttft_p50_s": round(statistics.median(ttfts), 3),
        "ttft_p99_s": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 3),
        "ttft_mean_s": round(statistics.fmean(ttfts), 3),
        "prefix_hit_rate": round(h / q, 3) if q else None,
        "prefill_tokens_computed": q - h,
        "per_engine": {k: v for k, v in delta.items() if "[" in k and k.startswith("engine_")},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="served model name (default: the first listed)")
    p.add_argument("--prefixes", type=int, default=6, help="distinct system prompts")
    p.add_argument("--prefix-len", type=int, default=400)
    p.add_argument("--users", type=int, default=8, help="users per system prompt")
    p.add_argument("--turns", type=int, default=2, help="turns per user")
    p.add_argument("--message-len", type=int, default=24)
    p.add_argument("--answer-len", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=30000, help="token ids drawn below this")
    p.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("--simulate (no server)")
    s.add_argument("--simulate", action="store_true")
    s.add_argument("--cores", type=int, default=2)
    s.add_argument("--pool-blocks", type=int, default=100, help="blocks per core")
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--arrivals-per-tick", type=int, default=1)
    s.add_argument("--policies", default="round_robin,least_loaded,prefix", help="comma-separated")
    args = p.parse_args()
    workload = chat_workload(
        prefixes=args.prefixes,
        prefix_len=args.prefix_len,
        users_per_prefix=args.users,
        turns=args.turns,
        message_len=args.message_len,
        answer_len=args.answer_len,
        vocab_size=args.vocab_size,
        seed=args.seed,
    )
    if args.simulate:
        for policy in args.policies.split(","):
            result = simulate(
                workload,
                policy,
                cores=args.cores,
                pool_blocks=args.pool_blocks,
                block_size=args.block_size,
                max_tokens=args.max_tokens,
                arrivals_per_tick=args.arrivals_per_tick,
            )
            print(json.dumps(result))
        return
    print(json.dumps(against_server(args, workload), indent=1))


if __name__ == "__main__":
    main()
