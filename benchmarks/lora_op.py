"""The batched LoRA op alone, per decoder layer: the native CPU kernel against the torch path,
interleaved in one process (a shared, loaded machine weighs on both alike).

    python benchmarks/lora_op.py                     # SmolLM2-135M's widths, rank 16, 1 thread
    python benchmarks/lora_op.py --threads 2 --interleave

One layer's four adapted projections (q|k|v, o, gate|up, down) with fp32 slot stacks under
bf16 activations, as the runtime keeps them on CPU; 64 decode tokens of 4 adapters x 16
(``--interleave``: adapters alternating token by token, so the torch path gathers). Each
round calls every variant once, in turn, through ``torch.ops.pagemill.add_lora`` (what a
compiled step calls); reported: the median time per layer of each and the median of the
paired native / torch ratios. With one thread the clock is the thread's CPU time, which
other processes' load does not inflate; with more, wall time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--kv", type=int, default=192, help="k and v widths")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--loras", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--interleave", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from pagemill.kernels import lora_cpu, lora_segments, lora_token_runs

    if lora_cpu.load() is None:
        raise SystemExit("the native CPU LoRA kernel could not be built here (see the log)")
    h, inter, kv, r, n = args.hidden, args.intermediate, args.kv, args.rank, args.loras
    t = args.tokens
    if args.interleave:
        slots = torch.arange(t) % n
    else:
        slots = torch.arange(t) * n // t
    sorted_ids, seg = lora_segments(slots, n)
    runs = lora_token_runs(slots, n)
    g = torch.Generator().manual_seed(0)
    layers = []
    for k, widths in ((h, [h, kv, kv]), (h, [h]), (h, [inter, inter]), (inter, [h])):
        s, out = len(widths), sum(widths)
        a = torch.randn(n, s * r, k, generator=g) / k**0.5
        b = torch.randn(n, out, s * r, generator=g) * 0.01
        b_t = b.transpose(1, 2).contiguous().transpose(1, 2)  # the runtime's CPU layout
        starts = torch.tensor([0, *torch.tensor(widths).cumsum(0).tolist()], dtype=torch.int32)
        x = torch.randn(t, k, generator=g).bfloat16()
        y = torch.randn(t, out, generator=g).bfloat16()
        layers.append((y, x, a, b_t, starts, max(widths)))

    def layer() -> None:
        for y, x, a, b, starts, widest in layers:
            torch.ops.pagemill.add_lora(y, x, a, b, sorted_ids, seg, starts, widest, runs)

    clock = time.thread_time if args.threads == 1 else time.perf_counter
    times: dict[str, list[float]] = {"native": [], "torch": []}
    for _ in range(args.rounds):
        for name in times:
            lora_cpu.use_native = name == "native"
            start = clock()
            layer()
            times[name].append(clock() - start)
    lora_cpu.use_native = True
    for name, v in times.items():
        print(f"{name}: {statistics.median(v) * 1e6:.1f} us per layer")
    ratio = statistics.median(a / b for a, b in zip(times["native"], times["torch"]))
    print(
        f"native / torch, median of paired rounds: {ratio:.3f} "
        f"({t} tokens, {n} adapters{' interleaved' if args.interleave else ''}, rank {r}, "
        f"{args.threads} thread(s))"
    )


if __name__ == "__main__":
    main()
