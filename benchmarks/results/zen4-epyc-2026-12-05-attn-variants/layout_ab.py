"""Token-major KV blocks [blocks, 16, kv_heads, D] (the engine's layout) against head-major
[blocks, kv_heads, 16, D] (vLLM's CPU layout), both read by the shipped decode kernel.

Head-major is emulated with the same kernel and the same bytes: each (request, KV head) is
a request of its own over one KV head, its block b of head h at virtual block
kv_heads * b + h (so one real block is kv_heads consecutive virtual blocks of one head's
16 rows). Same tables, same contexts, every layer's cache in turn (none found in the
caches), the two layouts alternated round by round; SmolLM2-135M's 9 query heads over 3
KV heads of 64, caches on transparent huge pages as `KVStorage` makes them.

    python benchmarks/results/zen4-epyc-2026-12-05-attn-variants/layout_ab.py
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
from decode_attention import pool_array, scattered_tables

from pagemill.kernels import cpu_native

KVH, H, D, BS, LAYERS = 3, 9, 64, 16, 30


def case(lib: object, seqs: int, ctx: int, rounds: int = 9) -> None:
    nblk = -(-ctx // BS)
    num_blocks = max(seqs * nblk * 2, 4096)
    rng = random.Random(seqs * 1000 + ctx)
    tables = torch.tensor(
        scattered_tables(seqs, nblk, num_blocks, min(nblk, 4), rng), dtype=torch.int32
    )
    head_tables = torch.empty(seqs * KVH, nblk, dtype=torch.int32)
    for h in range(KVH):
        head_tables[h::KVH] = tables * KVH + h
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    head_lens = lens.repeat_interleave(KVH)
    token_major = [
        (pool_array((num_blocks, BS, KVH, D), True), pool_array((num_blocks, BS, KVH, D), True))
        for _ in range(LAYERS)
    ]
    head_major = [
        (
            pool_array((num_blocks * KVH, BS, 1, D), True),
            pool_array((num_blocks * KVH, BS, 1, D), True),
        )
        for _ in range(LAYERS)
    ]
    g = torch.Generator().manual_seed(0)
    qs = [torch.randn(seqs, H, D, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
    out = torch.empty(seqs, H, D, dtype=torch.bfloat16)
    scale = D**-0.5

    def run_token_major() -> float:
        t0 = time.perf_counter()
        for (k, v), q in zip(token_major, qs, strict=True):
            cpu_native.paged_decode(lib, q, k, v, out, tables, lens, None, scale)
        return (time.perf_counter() - t0) / LAYERS

    def run_head_major() -> float:
        t0 = time.perf_counter()
        for (k, v), q in zip(head_major, qs, strict=True):
            cpu_native.paged_decode(
                lib,
                q.view(seqs * KVH, KVH, D),
                k,
                v,
                out.view(seqs * KVH, KVH, D),
                head_tables,
                head_lens,
                None,
                scale,
            )
        return (time.perf_counter() - t0) / LAYERS

    run_token_major()
    run_head_major()
    a: list[float] = []
    b: list[float] = []
    for r in range(rounds):
        if r % 2:
            a.append(run_token_major())
            b.append(run_head_major())
        else:
            b.append(run_head_major())
            a.append(run_token_major())
    ratio = statistics.median(x / y for x, y in zip(a, b, strict=True))
    gb = 2 * seqs * ctx * KVH * D * 2 / 1e9
    ta, tb = statistics.median(a), statistics.median(b)
    print(
        f"requests {seqs:4d} ctx {ctx:5d}: token-major {ta * 1e6:7.0f} us ({gb / ta:5.1f} GB/s)"
        f"  head-major {tb * 1e6:7.0f} us ({gb / tb:5.1f} GB/s)  token/head {ratio:.2f}x",
        flush=True,
    )


def main() -> None:
    lib = cpu_native.load()
    if lib is None:
        raise SystemExit("the native CPU kernel cannot be built here")
    torch.set_num_threads(2)
    for seqs, ctx in [(16, 64), (64, 64), (256, 64), (64, 192), (256, 192), (16, 1024), (64, 1024)]:
        case(lib, seqs, ctx)


if __name__ == "__main__":
    main()
