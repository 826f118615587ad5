"""Offline equivalent of `pagemill bench serve --concurrency 16 --num-prompts 32`.

A closed loop on the default engine: 16 requests in flight, a new one added as one
finishes, 32 in all; 128 random prompt tokens, 64 output tokens each, greedy. Prints each
level's time and its steps by kind (prefill steps take over 100 ms here).

    uv run python level_offline.py             # LEVELS=3 levels, each with new prompts
"""

from __future__ import annotations

import os
import random
import statistics
import time

os.environ.setdefault("PAGEMILL_COMPILE_BACKGROUND", "0")

from pagemill.runtime import LLM, SamplingParams

llm = LLM()
engine = llm.llm_engine
params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def level(seed: int, n: int = 32, concurrency: int = 16) -> None:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 49000) for _ in range(128)] for _ in range(n)]
    added = live = 0
    steps: list[float] = []
    t0 = time.perf_counter()
    while added < concurrency:
        engine.add_request(f"s{seed}-{added}", prompts[added], params)
        added += 1
        live += 1
    while live:
        a = time.perf_counter()
        outputs = engine.step()
        steps.append(time.perf_counter() - a)
        for out in outputs:
            if out.finished:
                live -= 1
                if added < n:
                    engine.add_request(f"s{seed}-{added}", prompts[added], params)
                    added += 1
                    live += 1
    dt = time.perf_counter() - t0
    big = [s for s in steps if s > 0.1]
    small = [s for s in steps if s <= 0.1]
    print(
        f"level {dt:.2f} s = {n * 64 / dt:.0f} tok/s; steps {len(steps)}: {len(big)} over 100 ms "
        f"({sum(big):.2f} s), {len(small)} others median {statistics.median(small) * 1e3:.1f} ms "
        f"({sum(small):.2f} s); outside steps {dt - sum(steps):.2f} s",
        flush=True,
    )


for s in range(int(os.environ.get("LEVELS", "3"))):
    level(100 + s)
