"""Micro-benchmark: host time of one scheduler step (schedule() + update_from_output()).

Not a test: it prints figures. Two workloads, both with the real KVCacheManager:

* steady decode: 256 requests all decoding (one token each per step);
* churn: 256 slots kept busy by a stream of arrivals with shared prefixes, random output
  lengths and chunked prefills, so every step mixes decodes, prompt chunks, admissions
  and finishes (and the waiting queue is never empty); once with a pool that holds every
  request, once with a tight one where preemption happens.

Run: OMP_NUM_THREADS=1 .venv/bin/python packages/scheduler/benchmarks/bench_scheduler.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pagemill.blockpool import KVCacheManager
from pagemill.scheduler import Request, Scheduler, SchedulerConfig

EOS = 0


def fake_sample(out, rng: random.Random, eos_p: float) -> dict[str, int]:
    return {
        s.request_id: (EOS if rng.random() < eos_p else rng.randrange(1, 32000))
        for s in out.scheduled
        if s.sample
    }


def timed_steps(
    sched: Scheduler, n: int, rng: random.Random, eos_p: float, on_step=None
) -> tuple[float, float, int]:
    """Median seconds of schedule() and of update_from_output() per step, and total tokens.

    Medians, not means: the benchmark box is shared, and a few steps stretched by other
    processes would otherwise dominate the figure.
    """
    t_sched: list[float] = []
    t_update: list[float] = []
    tokens = 0
    for _ in range(n):
        if on_step is not None:
            on_step()
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        sampled = fake_sample(out, rng, eos_p)
        t2 = time.perf_counter()
        sched.update_from_output(out, sampled)
        t3 = time.perf_counter()
        t_sched.append(t1 - t0)
        t_update.append(t3 - t2)
        tokens += out.total_num_scheduled_tokens
    return statistics.median(t_sched), statistics.median(t_update), tokens


def steady_decode(num_reqs: int, prompt_len: int, steps: int, hash_algo: str) -> None:
    rng = random.Random(0)
    kv = KVCacheManager(
        num_blocks=num_reqs * (prompt_len + steps + 64) // 16 + 16,
        block_size=16,
        hash_algo=hash_algo,
    )
    cfg = SchedulerConfig(
        max_num_batched_tokens=8192, max_num_seqs=num_reqs, max_model_len=prompt_len + steps + 64
    )
    sched = Scheduler(cfg, kv)
    for i in range(num_reqs):
        sched.add_request(
            Request(
                f"r{i}",
                [rng.randrange(1, 32000) for _ in range(prompt_len)],
                eos_token_id=EOS,
                ignore_eos=True,
            )
        )
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()):
        out = sched.schedule()
        sched.update_from_output(out, fake_sample(out, rng, 0.0))
    s, u, tokens = timed_steps(sched, steps, rng, 0.0)
    assert tokens == steps * num_reqs, "not every request decoded every step"
    total = s + u
    print(
        f"steady decode  {num_reqs} running, prompt {prompt_len}, {hash_algo}: "
        f"{total * 1e6:8.1f} us/step  (schedule {s * 1e6:.1f} + update {u * 1e6:.1f}; "
        f"{total * 1e6 / num_reqs:.2f} us per request)"
    )


def churn(num_slots: int, steps: int, hash_algo: str, blocks_per_slot: int = 80) -> None:
    rng = random.Random(1)
    prefixes = [[rng.randrange(1, 32000) for _ in range(n)] for n in (64, 256, 512)]
    kv = KVCacheManager(num_blocks=num_slots * blocks_per_slot, block_size=16, hash_algo=hash_algo)
    cfg = SchedulerConfig(
        max_num_batched_tokens=2048,
        max_num_seqs=num_slots,
        max_model_len=2048,
        long_prefill_token_threshold=512,
    )
    sched = Scheduler(cfg, kv)
    counter = 0

    def arrivals() -> None:
        nonlocal counter
        while len(sched.waiting) < 32:
            prompt = list(rng.choice(prefixes)) + [
                rng.randrange(1, 32000) for _ in range(rng.randrange(8, 512))
            ]
            sched.add_request(
                Request(f"c{counter}", prompt, max_tokens=rng.randrange(16, 256), eos_token_id=EOS)
            )
            counter += 1

    timed_steps(sched, 300, rng, 0.002, arrivals)  # fill the slots
    s, u, tokens = timed_steps(sched, steps, rng, 0.002, arrivals)
    st = sched.get_stats()
    total = s + u
    pool = "roomy pool" if blocks_per_slot >= 80 else "tight pool"
    print(
        f"churn, {pool}: {st.num_running} running / {st.num_waiting} waiting, {hash_algo}: "
        f"{total * 1e6:8.1f} us/step  (schedule {s * 1e6:.1f} + update {u * 1e6:.1f}; "
        f"{tokens / steps:.0f} tokens/step, {total * 1e9 / max(tokens / steps, 1):.0f} ns per "
        f"token; {counter} requests, prefix hit rate {st.prefix_cache_hit_rate:.2f}, "
        f"preemptions {st.num_preemptions})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=500)
    args = ap.parse_args()
    for algo in ("sha256", "xxh3_128"):
        steady_decode(args.requests, 512, args.steps, algo)
    for algo in ("sha256", "xxh3_128"):
        churn(args.requests, args.steps, algo)
    churn(args.requests, args.steps, "xxh3_128", blocks_per_slot=12)


if __name__ == "__main__":
    main()
