"""Shared-prefix chat traffic over N data-parallel engine cores: prefix hits, prefill, TTFT.

The workload (`chat_workload`): K long system prompts or documents, U users on each, every
user a few turns; a turn's prompt is the system prompt, the user's conversation so far
(messages and answers) and a new message, so a user's later turns share more than the
system prompt with the earlier ones. Users arrive in a random order and take their turns
in order, interleaved with the others. `--prefixes 1` is the single-prefix workload (every
request shares one prompt: routing must then spread the load, there is nothing to keep).

Three ways to run it:

- against a running server (`--url`): each turn a streamed /v1/completions call, sent
  `--concurrency` at a time; TTFT is the first token's arrival, the prefix hit rate and
  the prefill tokens computed come from the server's own counters
  (pagemill:prefix_cache_hits / _queries before and after the run), per engine too, and
  the requests each core finished (vllm:request_success).

      pagemill serve MODEL -dp 2 --data-parallel-routing prefix --kv-cache-memory 12MiB &
      python benchmarks/dp_prefix_routing.py --url http://127.0.0.1:8000

- `--launch MODEL` (`default`: the default model): the same, every policy of
  `--policies` on a fresh server of its own (empty caches, same workload and seed),
  `pagemill serve MODEL -dp CORES --engine-threads N` plus `--server-args`, whose default
  sizes each core's pool at 100 blocks of 16 (float32 KV of the default model): the six
  400-token prompts take 150 blocks, more than one pool and less than two. Each core's
  pool is read from the server's log, and a run whose prompts fit in one pool (or not in
  all) is refused unless `--any-pool`. Prints a JSON line per policy and a table. The
  server logs each routing decision (the core, every core's load and matched blocks as
  the router saw them); `routing` in the JSON sets those against the tokens each request
  found cached (e.g. prompts the router counted on a core that had evicted them), and
  `<log dir>/<policy>.requests.jsonl` holds them per request.

      python benchmarks/dp_prefix_routing.py --launch default

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
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
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
    # vllm:request_success is the only per-core request count (pagemill: has the totals).
    for m in re.finditer(
        r"^(?:pagemill:(\w+)_total|vllm:(request_success)_total)\{([^}]*)\} (\S+)$", text, re.M
    ):
        pname, vname, labels, value = m.groups()
        name = pname or vname
        engine = re.search(r'engine="(\d+)"', labels)
        key = name + (f"[{engine.group(1)}]" if engine else "")
        out[key] = out.get(key, 0.0) + float(value)
    return out


def one(url: str, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed completion: its TTFT, and the id and cached prompt tokens the server
    reported (for matching the routing log against what each core actually held)."""
    import httpx

    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    ttft = None
    rid, cached = None, None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            rid = rid or chunk.get("id")
            if chunk.get("usage"):
                details = chunk["usage"].get("prompt_tokens_details") or {}
                cached = details.get("cached_tokens")
            elif ttft is None:
                ttft = time.perf_counter() - sent
    assert ttft is not None
    return {
        "id": rid,
        "ttft_s": ttft,
        "cached_tokens": cached,
        "prompt_tokens": len(prompt),
        "sent": sent,
        "done": time.perf_counter(),
    }


def against_server(
    args: argparse.Namespace, workload: list[Turn], url: str, requests_log: Path | None = None
) -> dict[str, Any]:
    import httpx

    model = args.model or httpx.get(url + "/v1/models").json()["data"][0]["id"]
    # A user's next turn waits for the previous one's answer, as in a chat.
    done: dict[int, concurrent.futures.Future[dict[str, Any]]] = {}

    def turn(t: Turn, before: concurrent.futures.Future[dict[str, Any]] | None) -> dict[str, Any]:
        if before is not None:
            before.result()
        return one(url, model, t.prompt, args.max_tokens)

    before = counters(url)
    t0 = time.perf_counter()
    futures = []
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        for t in workload:
            f = pool.submit(turn, t, done.get(t.user))
            done[t.user] = f
            futures.append(f)
        records = [f.result() for f in futures]
    wall = time.perf_counter() - t0
    ttfts = sorted(r["ttft_s"] for r in records)
    if requests_log is not None:
        requests_log.write_text(
            "".join(
                json.dumps(
                    {
                        **r,
                        **{k: round(r[k] - t0, 3) for k in ("sent", "done")},
                        "user": t.user,
                        "prefix": t.prefix,
                    }
                )
                + "\n"
                for t, r in zip(workload, records, strict=True)
            )
        )
    after = counters(url)
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
        "requests_per_core": [
            round(v) for k, v in sorted(delta.items()) if k.startswith("request_success[")
        ],
        "per_engine": {k: v for k, v in delta.items() if "[" in k and k.startswith("engine_")},
    }


# ---------------------------------------------------------------- fresh servers per policy


# `pagemill` with the data-parallel client's per-request routing lines (debug) in its log.
SERVE_LOGGING_ROUTES = """import logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
logging.getLogger("pagemill.runtime.engine.dp_client").setLevel(logging.DEBUG)
from pagemill.server.cli import main
sys.exit(main())"""
ROUTE_LINE = re.compile(
    r"request (\S+) -> engine core (\d+) \(in flight (\[[^]]*\]), matched blocks (\[[^]]*\])\)"
)


def routing_report(
    log_path: Path, requests_log: Path, prefix_len: int, block_size: int
) -> dict[str, Any]:
    """Joins each request's routing line (the core, every core's load and matched blocks
    as the router saw them) with what the core reported cached for it, and counts where
    the two disagree: the evidence for why a policy hits what it hits."""
    routes = {
        m.group(1): (int(m.group(2)), json.loads(m.group(3)), json.loads(m.group(4)))
        for m in ROUTE_LINE.finditer(log_path.read_text())
    }
    rows = [json.loads(line) for line in requests_log.read_text().splitlines()]
    prefix_blocks = prefix_len // block_size
    seen: set[tuple[int, int]] = set()  # (core, prefix) pairs some earlier request was sent to
    out = {
        "routed_lines": 0,
        "first_on_core": 0,  # the prefix's first request on its core: a miss is expected
        "evicted": 0,  # the prefix had been sent to this core before, and was not there
        "believed_cached_but_missed": 0,  # router matched the prefix, the core had lost it
        "cached_elsewhere_sent_cold": 0,  # another core held the prefix, this one did not
    }
    for r in rows:
        route = next((v for k, v in routes.items() if r["id"] and k.startswith(r["id"])), None)
        if route is None:
            continue
        core, inflight, matched = route
        r.update(core=core, inflight=inflight, matched=matched)
        out["routed_lines"] += 1
        hit_prefix = (r["cached_tokens"] or 0) >= prefix_blocks * block_size
        if (core, r["prefix"]) not in seen:
            out["first_on_core"] += 1
        elif not hit_prefix:
            out["evicted"] += 1
            if matched and matched[core] >= prefix_blocks:
                out["believed_cached_but_missed"] += 1
        if matched and matched[core] < prefix_blocks <= max(matched):
            out["cached_elsewhere_sent_cold"] += 1
        seen.add((core, r["prefix"]))
    requests_log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def start_server(
    args: argparse.Namespace, policy: str, port: int, log_path: Path
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-c",
        SERVE_LOGGING_ROUTES,
        "serve",
        *([args.launch] if args.launch != "default" else []),
        "-dp",
        str(args.cores),
        "--engine-threads",
        str(args.engine_threads),
        "--data-parallel-routing",
        policy,
        "--port",
        str(port),
        "--seed",
        str(args.seed),
        *shlex.split(args.server_args),
    ]
    shown = shlex.join(["pagemill", *cmd[3:]])
    print(f"# {policy}: {shown}  (log: {log_path})", file=sys.stderr, flush=True)
    with log_path.open("wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(url: str, server: subprocess.Popen[bytes], log_path: Path, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode}; see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise SystemExit(f"the server was not ready after {timeout:.0f} s; see {log_path}")


def stop_server(server: subprocess.Popen[bytes]) -> None:
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def pool_sizes(log_path: Path) -> list[int]:
    """Each core's pool, in blocks, as its engine logged it at start-up."""
    return [int(n) for n in re.findall(r"KV cache: (\d+) blocks x", log_path.read_text())]


def launched(args: argparse.Namespace, workload: list[Turn]) -> list[dict[str, Any]]:
    """Every policy in turn on a fresh server (empty caches), the same workload."""
    distinct = {tuple(t.prompt[: args.prefix_len]) for t in workload}
    prefix_blocks = len(distinct) * (args.prefix_len // args.block_size)
    logs = Path(tempfile.mkdtemp(prefix="dp_prefix_routing-"))
    results = []
    for policy in args.policies.split(","):
        port = free_port()
        log_path = logs / f"{policy}.log"
        server = start_server(args, policy, port, log_path)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, server, log_path, args.start_timeout)
            pools = pool_sizes(log_path)
            print(
                f"# {policy}: pools {pools} blocks of {args.block_size}; the "
                f"{len(distinct)} prefixes take {prefix_blocks} blocks",
                file=sys.stderr,
                flush=True,
            )
            if not args.any_pool and pools and not (max(pools) < prefix_blocks <= sum(pools)):
                raise SystemExit(
                    f"the prefixes ({prefix_blocks} blocks) must not fit in one pool but fit "
                    f"in all ({pools}): size the pools with --kv-cache-memory-bytes in "
                    "--server-args, or pass --any-pool"
                )
            result = against_server(args, workload, url, logs / f"{policy}.requests.jsonl")
            result = {
                "policy": policy,
                "pool_blocks": pools,
                **result,
                "routing": routing_report(
                    log_path, logs / f"{policy}.requests.jsonl", args.prefix_len, args.block_size
                ),
            }
            print(json.dumps(result), flush=True)
            results.append(result)
        finally:
            stop_server(server)
    return results


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def table(results: list[dict[str, Any]]) -> str:
    base = next((r for r in results if r["policy"] == "round_robin"), None)
    rows = [
        "| routing | prefix hit rate | prefill tokens computed | TTFT p50 | TTFT p99 "
        "| requests per core |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        prefill = f"{r['prefill_tokens_computed']:,.0f}"
        if base is not None and r is not base and base["prefill_tokens_computed"]:
            prefill += f" ({r['prefill_tokens_computed'] / base['prefill_tokens_computed']:.2f}x)"
        rows.append(
            f"| {r['policy']} | {r['prefix_hit_rate']} | {prefill} | {r['ttft_p50_s']:.2f} s "
            f"| {r['ttft_p99_s']:.2f} s | {' / '.join(str(n) for n in r['requests_per_core'])} |"
        )
    return "\n".join(rows)


DEFAULT_SERVER_ARGS = (
    "--dtype float32 --enforce-eager --kv-cache-memory-bytes 73728000 --max-model-len 1024"
)


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
    p.add_argument("--cores", type=int, default=2, help="engine cores (-dp)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--policies", default="round_robin,least_loaded,prefix", help="comma-separated")
    launch = p.add_argument_group("--launch (a fresh server per policy)")
    launch.add_argument(
        "--launch",
        metavar="MODEL",
        help="start `pagemill serve MODEL -dp CORES` per policy ('default': the default model)",
    )
    launch.add_argument("--engine-threads", type=int, default=2, help="split over the cores")
    launch.add_argument(
        "--server-args",
        default=DEFAULT_SERVER_ARGS,
        help="more `pagemill serve` flags (default: %(default)s: 100 blocks of 16 per core)",
    )
    launch.add_argument("--start-timeout", type=float, default=600.0)
    launch.add_argument(
        "--any-pool",
        action="store_true",
        help="run even if the prefixes fit in one pool, or not in all of them",
    )
    s = p.add_argument_group("--simulate (no server)")
    s.add_argument("--simulate", action="store_true")
    s.add_argument("--pool-blocks", type=int, default=100, help="blocks per core")
    s.add_argument("--arrivals-per-tick", type=int, default=1)
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
    if args.launch:
        results = launched(args, workload)
        print(table(results))
        return
    print(json.dumps(against_server(args, workload, args.url), indent=1))


if __name__ == "__main__":
    main()
