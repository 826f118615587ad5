"""Per-layer cost of CPU decode attention with and without a per-step plan.

    python packages/kernels/benchmarks/attention_plan.py [--layers 30] [--steps 30]

A decode step of SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64, bf16, 30 layers)
over 64-token contexts on one thread: once with every layer planning for itself
(`paged_attention` without a plan: metadata read, chunks, gather indices, masks), once
with one `plan_attention` per step shared by the layers. Each layer has its own cache, as
in the model, so K/V are not served warm from the previous layer's reads.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from pagemill.kernels import paged_attention, plan_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def decode_step(batch: int, ctx: int, layers: int, seed: int = 0):
    """One decode token per request; each request's blocks scattered over the pool."""
    g = torch.Generator().manual_seed(seed)
    nblk = -(-ctx // BLOCK_SIZE)
    pool = batch * nblk
    tables = torch.randperm(pool, generator=g).view(batch, nblk).to(torch.int32)
    shape = (pool, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    caches = [
        (torch.randn(shape, generator=g).bfloat16(), torch.randn(shape, generator=g).bfloat16())
        for _ in range(layers)
    ]
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).bfloat16()
    query_lens = np.ones(batch, dtype=np.int64)
    context_lens = np.full(batch, ctx, dtype=np.int64)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    seq_lens = torch.from_numpy(context_lens.astype(np.int32))
    return q, caches, tables, qsl, seq_lens, query_lens, context_lens


def bench(batch: int, ctx: int, layers: int, steps: int) -> dict[str, float]:
    q, caches, tables, qsl, seq_lens, query_lens, context_lens = decode_step(batch, ctx, layers)
    scale = HEAD_DIM**-0.5
    out = torch.empty_like(q)

    def unplanned() -> None:
        for kc, vc in caches:
            paged_attention(q, kc, vc, tables, qsl, seq_lens, scale, out=out)

    def plan() -> object:
        return plan_attention(
            qsl,
            seq_lens,
            tables,
            k_cache_shape=tuple(caches[0][0].shape),
            num_heads=HEADS,
            dtype=q.dtype,
            query_lens=query_lens,
            context_lens=context_lens,
        )

    def planned() -> None:
        p = plan()
        for kc, vc in caches:
            paged_attention(
                q, kc, vc, p.block_tables, p.query_start_loc, p.seq_lens, scale, out=out, plan=p
            )

    def median_s(fn) -> float:
        fn()  # warm-up: workspace buffers, allocator, first-call paths
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    ref = torch.empty_like(out)
    unplanned()
    ref.copy_(out)
    planned()
    if not torch.equal(out, ref):
        raise AssertionError("planned and unplanned attention differ")
    step_unplanned = median_s(unplanned)
    step_planned = median_s(planned)
    plan_s = median_s(plan)
    return {
        "unplanned_layer_us": step_unplanned / layers * 1e6,
        "planned_layer_us": (step_planned - plan_s) / layers * 1e6,
        "plan_us": plan_s * 1e6,
        "step_unplanned_ms": step_unplanned * 1e3,
        "step_planned_ms": step_planned * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"decode attention, {HEADS}/{KV_HEADS} heads x {HEAD_DIM}, bf16, {args.context}-token "
        f"contexts, {args.layers} layers, {args.threads} thread(s); medians of {args.steps} steps"
    )
    for batch in args.batches:
        r = bench(batch, args.context, args.layers, args.steps)
        print(
            f"batch {batch:4d}: per layer {r['unplanned_layer_us']:8.1f} us unplanned, "
            f"{r['planned_layer_us']:8.1f} us with a plan (+ {r['plan_us']:.1f} us per step "
            f"to plan); step {r['step_unplanned_ms']:.2f} -> {r['step_planned_ms']:.2f} ms"
        )


if __name__ == "__main__":
    main()
