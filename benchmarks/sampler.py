"""Sampler cost per step: temperature/top-p rows against greedy, in the same process.

    python benchmarks/sampler.py --batch-sizes 64,128 --vocab 49152

Logits are bf16 (the model's dtype on CPU), drawn like a language model's: a few strong
tokens over a long tail. Each case is timed over `--iters` calls after a warm-up; the
ratio is against greedy at the same batch size, measured in the same run.
"""

from __future__ import annotations

import argparse
import time

import torch

from pagemill.runtime.sample.sampler import Sampler
from pagemill.runtime.sample.sampling_metadata import SamplingMetadata
from pagemill.runtime.sampling_params import SamplingParams

CASES = {
    "greedy": dict(temperature=0.0),
    "T=0.8": dict(temperature=0.8),
    "T=0.8 top_p=0.95": dict(temperature=0.8, top_p=0.95),
    "T=0.8 top_k=50": dict(temperature=0.8, top_k=50),
    "T=0.8 min_p=0.05": dict(temperature=0.8, min_p=0.05),
}


def logits_like_a_model(rows: int, vocab: int, seed: int = 0, flat: bool = False) -> torch.Tensor:
    """Peaked rows (a few strong tokens over a long tail: top-p 0.95 keeps tens to hundreds)
    or, with `flat`, rows whose tail holds most of the mass (a top-p 0.95 nucleus of
    thousands of tokens: the hard case for any sampler that orders tokens)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 2.0
    boost = 6.0 if flat else 14.0
    x[:, :64] += boost * torch.rand(rows, 64, generator=g)  # a few likely tokens
    return x[:, torch.randperm(vocab, generator=g)].to(torch.bfloat16)


def time_case(sampler: Sampler, logits: torch.Tensor, md: SamplingMetadata, iters: int) -> float:
    for _ in range(3):
        sampler(logits, md)
    best = float("inf")
    for _ in range(iters):
        t = time.perf_counter()
        sampler(logits, md)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="64,128")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--flat", action="store_true", help="flat rows (see logits_like_a_model)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sampler = Sampler(seed=0)
    print(
        f"vocab {args.vocab}, {'flat' if args.flat else 'peaked'} rows, "
        f"{torch.get_num_threads()} threads, best of {args.iters}"
    )
    print(f"{'case':<20}" + "".join(f"{'batch ' + b:>22}" for b in args.batch_sizes.split(",")))
    results: dict[str, list[str]] = {name: [] for name in CASES}
    for b in (int(s) for s in args.batch_sizes.split(",")):
        logits = logits_like_a_model(b, args.vocab, flat=args.flat)
        base = None
        for name, kw in CASES.items():
            params = [SamplingParams(**kw)] * b
            md = SamplingMetadata.from_params(
                params,
                output_token_ids=[[] for _ in params],
                prompt_token_ids=None,
                generators=None,
            )
            s = time_case(sampler, logits, md, args.iters)
            base = s if base is None else base
            results[name].append(f"{s * 1e3:8.2f} ms ({s / base:5.2f}x)")
    for name, cells in results.items():
        print(f"{name:<20}" + "".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
