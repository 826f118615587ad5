"""How many long requests a fixed KV pool runs at once, with and without giving back the
blocks behind a sliding window (pagemill's scheduler and KV cache manager, no model).

Every request arrives at once; each step samples a token for every request that finished
its prompt. Reported per mode: the most requests running in one step, the mean over all
steps, preemptions, steps to drain the queue, and the peak of blocks held.

`--model mistral` (the default): every layer shares the window, one table per request.
`--model gemma2` / `gemma3`: full-attention and windowed layers mixed (1:1, or one full
layer in six), served either with one table for all layers that keeps every block, or with
one table per KV cache group (`HybridKVCacheManager`) whose windowed groups give back what
their window left behind. The KV byte budget is the same: `--blocks` blocks of all layers,
so a per-group block (a group's worth of layers) is that many times smaller and the pool
has that many more. Blocks are reported in layer-blocks (blocks x layers per block), the
unit both modes share.

    uv run python benchmarks/sliding_window_memory.py                 # Mistral-7B-like
    uv run python benchmarks/sliding_window_memory.py --window 1024 --prompt 4000
    uv run python benchmarks/sliding_window_memory.py --model gemma2
"""

from __future__ import annotations

import argparse
import time

from pagemill.blockpool import (
    HybridKVCacheManager,
    KVCacheManager,
    group_layers_by_window,
)
from pagemill.blockpool.kv_cache_groups import group_size
from pagemill.scheduler import Request, Scheduler, SchedulerConfig

# Layer windows (0: full attention) of the hybrid models: Gemma 2 2B alternates windowed
# and full layers, Gemma 3 1B has one full layer in every six.
LAYOUTS = {
    "gemma2": lambda w: [w if i % 2 == 0 else 0 for i in range(26)],
    "gemma3": lambda w: [0 if i % 6 == 5 else w for i in range(26)],
}


def make_manager(
    args: argparse.Namespace, window: int | None, hybrid: bool
) -> tuple[KVCacheManager | HybridKVCacheManager, int]:
    """The manager and the layers each of its blocks holds."""
    if args.model == "mistral":
        # The null block is the window mode's own: both modes get the same usable blocks.
        num_blocks = args.blocks + (1 if window else 0)
        return KVCacheManager(num_blocks, args.block_size, sliding_window=window), 1
    windows = LAYOUTS[args.model](args.window)
    if not hybrid:
        return KVCacheManager(args.blocks, args.block_size), len(windows)
    groups = group_layers_by_window(windows)
    per_block = group_size(groups)
    num_blocks = args.blocks * len(windows) // per_block + 1
    return HybridKVCacheManager(num_blocks, args.block_size, groups), per_block


def run(args: argparse.Namespace, window: int | None, hybrid: bool = False) -> dict[str, float]:
    kv, layers_per_block = make_manager(args, window, hybrid)
    config = SchedulerConfig(
        max_num_batched_tokens=args.budget,
        max_num_seqs=args.requests,
        max_model_len=args.prompt + args.output,
    )
    sched = Scheduler(config, kv)
    for i in range(args.requests):
        prompt = [(i * 7919 + j) % 32000 for j in range(args.prompt)]
        sched.add_request(Request(f"r{i}", prompt, max_tokens=args.output, ignore_eos=True))
    steps, running_sum, peak_running, peak_held, held = 0, 0, 0, 0, 0
    start = time.perf_counter()
    while sched.has_unfinished_requests():
        out = sched.schedule()
        steps += 1
        running_sum += len(sched.running)
        peak_running = max(peak_running, len(sched.running))
        held = kv.num_usable_blocks - kv.get_num_free_blocks()
        peak_held = max(peak_held, held)
        sched.update_from_output(out, {s.request_id: 1 for s in out.scheduled if s.sample})
    finished = sched.num_finished - sched.num_ignored
    return dict(
        peak_running=peak_running,
        mean_running=running_sum / steps,
        preemptions=sched.num_preemptions,
        steps=steps,
        peak_held_blocks=peak_held * layers_per_block,
        # At the last step: decoding at full context, past every prefill chunk.
        last_held_blocks=held * layers_per_block,
        finished=finished,
        seconds=time.perf_counter() - start,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=2048, help="usable KV blocks in the pool")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--window", type=int, default=None, help="the windowed layers' window (4096; gemma3: 512)"
    )
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt", type=int, default=6000, help="prompt tokens per request")
    p.add_argument("--output", type=int, default=2000, help="generated tokens per request")
    p.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    p.add_argument("--model", choices=["mistral", *LAYOUTS], default="mistral")
    args = p.parse_args()
    if args.window is None:
        args.window = 512 if args.model == "gemma3" else 4096
    context = args.prompt + args.output
    print(
        f"pool {args.blocks} blocks x {args.block_size} = {args.blocks * args.block_size} "
        f"tokens; {args.requests} requests of {context} tokens "
        f"({args.requests * context} in all); window {args.window}"
    )
    header = ("mode", "peak running", "mean running", "preemptions", "steps", "peak blocks")
    if args.model != "mistral":
        header = (*header[:-1], "peak layer-blocks", "one request's layer-blocks at its end")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    modes: tuple[tuple[str, int | None, bool], ...] = (
        ("keep every block", None, False),
        ("give back behind window", args.window, False),
    )
    if args.model != "mistral":
        modes = (("one table, keep every block", None, False), ("per-group tables", None, True))
    for name, window, hybrid in modes:
        r = run(args, window, hybrid)
        assert r["finished"] == args.requests
        row = (
            f"| {name} | {r['peak_running']} | {r['mean_running']:.1f} | {r['preemptions']} "
            f"| {r['steps']} | {r['peak_held_blocks']} |"
        )
        if args.model != "mistral":
            one = argparse.Namespace(**{**vars(args), "requests": 1})
            row += f" {run(one, window, hybrid)['last_held_blocks']} |"
        print(row)


if __name__ == "__main__":
    main()
