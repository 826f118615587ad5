"""Shared-prefix traffic against a running `pagemill serve -dp N`: TTFT and prefix hit rate.

K system prompts of L tokens, each request one of them plus a short distinct suffix, sent
`--concurrency` at a time (streamed, so TTFT is the first token's arrival). The prefix hit
rate comes from the server's own counters (pagemill:prefix_cache_hits / _queries, before
and after the run), per engine where the server exports them.

    pagemill serve MODEL -dp 2 --data-parallel-routing prefix --kv-cache-memory 12MiB &
    python benchmarks/dp_prefix_routing.py --url http://127.0.0.1:8000 --prefixes 6
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import re
import statistics
import time

import httpx


def counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for m in re.finditer(r"^pagemill:(\w+)_total\{([^}]*)\} (\S+)$", text, re.M):
        name, labels, value = m.groups()
        engine = re.search(r'engine="(\d+)"', labels)
        key = name + (f"[{engine.group(1)}]" if engine else "")
        out[key] = out.get(key, 0.0) + float(value)
    return out


def one(url: str, model: str, prompt: list[int], max_tokens: int) -> float:
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="served model name (default: the first listed)")
    p.add_argument("--prefixes", type=int, default=6)
    p.add_argument("--prefix-len", type=int, default=400)
    p.add_argument("--suffix-len", type=int, default=8)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    model = args.model or httpx.get(args.url + "/v1/models").json()["data"][0]["id"]
    rng = random.Random(args.seed)
    prefixes = [
        [rng.randrange(100, 20000) for _ in range(args.prefix_len)] for _ in range(args.prefixes)
    ]
    prompts = [
        prefixes[rng.randrange(args.prefixes)]
        + [rng.randrange(100, 20000) for _ in range(args.suffix_len)]
        for _ in range(args.requests)
    ]
    before = counters(args.url)
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        ttfts = list(pool.map(lambda q: one(args.url, model, q, args.max_tokens), prompts))
    wall = time.perf_counter() - t0
    after = counters(args.url)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    q, h = delta.get("prefix_cache_queries", 0.0), delta.get("prefix_cache_hits", 0.0)
    ttfts.sort()
    result = {
        "requests": len(ttfts),
        "wall_s": round(wall, 2),
        "ttft_p50_s": round(statistics.median(ttfts), 3),
        "ttft_p99_s": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 3),
        "ttft_mean_s": round(statistics.fmean(ttfts), 3),
        "prefix_hit_rate": round(h / q, 3) if q else None,
        "prefill_tokens_computed": q - h,
        "per_engine": {
            k: v for k, v in delta.items() if "[" in k and k.startswith("engine_prefix")
        },
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
