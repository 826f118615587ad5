"""Micro-benchmark of the block pool and the KV cache manager (a script, not a test).

Prints allocate+free throughput of the raw pool in blocks per second, and the per-request
cost of the manager's admit (hashing the prompt + get_computed_blocks + allocate_slots) and
free for prompts with and without prefix hits. Figures vary with the machine and its load;
compare ratios.

    python packages/blockpool/benchmarks/bench_pool.py [--quick]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

from pagemill.blockpool import BlockHash, BlockPool, KVCacheManager


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    block_hashes: list[BlockHash] = field(default_factory=list)


def bench_pool(num_blocks: int, batch: int, rounds: int) -> float:
    """Blocks per second through get_new_blocks + free_blocks in batches of `batch`."""
    pool = BlockPool(num_blocks)
    t0 = time.perf_counter()
    for _ in range(rounds):
        blocks = pool.get_new_blocks(batch)
        pool.free_blocks(reversed(blocks))
    dt = time.perf_counter() - t0
    return rounds * batch / dt


def bench_touch(num_blocks: int, rounds: int) -> float:
    """Prefix-hit revivals (O(1) removal from the middle of the free queue) per second."""
    pool = BlockPool(num_blocks)
    blocks = pool.get_new_blocks(num_blocks)
    pool.free_blocks(blocks)
    middle = blocks[num_blocks // 3 : num_blocks // 3 + 64]
    t0 = time.perf_counter()
    for _ in range(rounds):
        pool.touch(middle)
        pool.free_blocks(middle)
    dt = time.perf_counter() - t0
    return rounds * len(middle) / dt


def bench_manager(
    num_requests: int, prompt_len: int, shared_prefix: int, algo: str, block_size: int = 16
) -> tuple[float, float, float]:
    """Mean microseconds per request for admit and free, and the token hit rate."""
    m = KVCacheManager(num_blocks=8192, block_size=block_size, hash_algo=algo)
    prefix = list(range(shared_prefix))
    reqs = [
        Req(
            f"r{i}",
            prefix + [100_000 + i * prompt_len + j for j in range(prompt_len - shared_prefix)],
        )
        for i in range(num_requests)
    ]
    admit = free = 0.0
    hasher = m.block_hasher
    assert hasher is not None
    for r in reqs:
        t0 = time.perf_counter()
        r.block_hashes.extend(hasher(r))
        hits, n = m.get_computed_blocks(r)
        got = m.allocate_slots(r, len(r.all_token_ids) - n, n, hits)
        t1 = time.perf_counter()
        assert got is not None
        m.free(r.request_id)
        t2 = time.perf_counter()
        admit += t1 - t0
        free += t2 - t1
    stats = m.prefix_cache_stats
    return admit / num_requests * 1e6, free / num_requests * 1e6, stats.hit_rate


def bench_decode(steps: int, algo: str, block_size: int = 16) -> float:
    """Mean microseconds of one decode step: append a token, hash any filled block, allocate 1."""
    m = KVCacheManager(num_blocks=8192, block_size=block_size, hash_algo=algo)
    hasher = m.block_hasher
    assert hasher is not None
    r = Req("d", list(range(2048)))
    r.block_hashes.extend(hasher(r))
    assert m.allocate_slots(r, 2048) is not None
    r.num_computed_tokens = 2048
    t0 = time.perf_counter()
    for i in range(steps):
        r.all_token_ids.append(i)
        r.block_hashes.extend(hasher(r))
        m.allocate_slots(r, 1)
        r.num_computed_tokens += 1
    return (time.perf_counter() - t0) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (smoke run)")
    args = parser.parse_args()
    scale = 10 if args.quick else 1

    print("BlockPool allocate+free (blocks/s):")
    for batch in (1, 16, 256):
        rate = bench_pool(num_blocks=65536, batch=batch, rounds=max(1, 400_000 // batch // scale))
        print(f"  batch {batch:4d}: {rate / 1e6:6.2f} M blocks/s")
    print(
        "BlockPool touch+free from mid-queue: "
        f"{bench_touch(65536, 5000 // scale) / 1e6:.2f} M blocks/s"
    )

    print("KVCacheManager per request (prompt 2048 tokens, block 16):")
    n = max(20, 400 // scale)
    for algo in ("sha256", "xxh3_128"):
        for shared in (0, 1536):
            admit_us, free_us, hit = bench_manager(n, 2048, shared, algo)
            print(
                f"  {algo:8s} shared prefix {shared:4d}: admit {admit_us:8.1f} us "
                f"(hash+get_computed_blocks+allocate_slots), free {free_us:6.1f} us, "
                f"hit rate {hit:.2f}"
            )
    for algo in ("sha256", "xxh3_128"):
        us = bench_decode(20_000 // scale, algo)
        print(
            f"  {algo:8s} decode step (hasher + allocate_slots for 1 token, 2k context): "
            f"{us:6.2f} us"
        )


if __name__ == "__main__":
    main()
