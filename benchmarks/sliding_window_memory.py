"""How many long requests a fixed KV pool runs at once, with and without giving back the
blocks behind a sliding window (pagemill's scheduler and KV cache manager, no model).

Every request arrives at once; each step samples a token for every request that finished
its prompt. Reported per mode: the most requests running in one step, the mean over all
steps, preemptions, steps to drain the queue, and the peak of blocks held.

    uv run python benchmarks/sliding_window_memory.py                 # Mistral-7B-like
    uv run python benchmarks/sliding_window_memory.py --window 1024 --prompt 4000
"""

from __future__ import annotations

import argparse
import time

from pagemill.blockpool import KVCacheManager
from pagemill.scheduler import Request, Scheduler, SchedulerConfig


def run(args: argparse.Namespace, window: int | None) -> dict[str, float]:
    # The null block is the window mode's own: both modes get the same usable blocks.
    num_blocks = args.blocks + (1 if window else 0)
    kv = KVCacheManager(num_blocks, args.block_size, sliding_window=window)
    config = SchedulerConfig(
        max_num_batched_tokens=args.budget,
        max_num_seqs=args.requests,
        max_model_len=args.prompt + args.output,
    )
    sched = Scheduler(config, kv)
    for i in range(args.requests):
        prompt = [(i * 7919 + j) % 32000 for j in range(args.prompt)]
        sched.add_request(Request(f"r{i}", prompt, max_tokens=args.output, ignore_eos=True))
    steps, running_sum, peak_running, peak_held = 0, 0, 0, 0
    start = time.perf_counter()
    while sched.has_unfinished_requests():
        out = sched.schedule()
        steps += 1
        running_sum += len(sched.running)
        peak_running = max(peak_running, len(sched.running))
        peak_held = max(peak_held, kv.num_usable_blocks - kv.get_num_free_blocks())
        sched.update_from_output(out, {s.request_id: 1 for s in out.scheduled if s.sample})
    finished = sched.num_finished - sched.num_ignored
    return dict(
        peak_running=peak_running,
        mean_running=running_sum / steps,
        preemptions=sched.num_preemptions,
        steps=steps,
        peak_held_blocks=peak_held,
        finished=finished,
        seconds=time.perf_counter() - start,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=2048, help="usable KV blocks in the pool")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--window", type=int, default=4096, help="every layer's window")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt", type=int, default=6000, help="prompt tokens per request")
    p.add_argument("--output", type=int, default=2000, help="generated tokens per request")
    p.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    args = p.parse_args()
    context = args.prompt + args.output
    print(
        f"pool {args.blocks} blocks x {args.block_size} = {args.blocks * args.block_size} "
        f"tokens; {args.requests} requests of {context} tokens "
        f"({args.requests * context} in all); window {args.window}"
    )
    header = ("mode", "peak running", "mean running", "preemptions", "steps", "peak blocks")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, window in (("keep every block", None), ("give back behind window", args.window)):
        r = run(args, window)
        assert r["finished"] == args.requests
        print(
            f"| {name} | {r['peak_running']} | {r['mean_running']:.1f} | {r['preemptions']} "
            f"| {r['steps']} | {r['peak_held_blocks']} |"
        )


if __name__ == "__main__":
    main()
