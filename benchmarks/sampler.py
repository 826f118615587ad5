"""Sampler cost per step: temperature/top-p/top-k/penalty rows against greedy, in one process.

    python benchmarks/sampler.py --batch-sizes 1,16,64,128,256 --vocab 49152
    python benchmarks/sampler.py --baseline HEAD~3     # also the sampler of another commit

Logits are bf16 (the model's dtype on CPU), drawn like a language model's: a few strong
tokens over a long tail (`--flat`: a long tail that holds most of the mass). Each case is
timed over `--iters` rounds after a warm-up; within a round every sampler variant runs the
case once, in turn, so a shared machine's load falls on all of them alike. The ratio is
against greedy at the same batch size, measured by the same variant in the same rounds.

Variants: `new` (this tree's sampler, eager kernels), `new+compile` (its row kernels
compiled, as the engine runs them when the model is compiled) and, with `--baseline REV`,
`old`: `sampler.py` of commit REV loaded beside it (git must be able to read REV).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pagemill.runtime.sample.sampler import Sampler
from pagemill.runtime.sample.sampling_metadata import SamplingMetadata
from pagemill.runtime.sampling_params import SamplingParams

CASES: dict[str, dict[str, Any]] = {
    "greedy": dict(temperature=0.0),
    "T=0.8": dict(temperature=0.8),
    "T=0.8 top_p=0.95": dict(temperature=0.8, top_p=0.95),
    "T=0.8 top_k=50": dict(temperature=0.8, top_k=50),
    "T=0.8 min_p=0.05": dict(temperature=0.8, min_p=0.05),
    "T=0.8 top_p+penalties": dict(
        temperature=0.8,
        top_p=0.95,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.1,
    ),
}
SAMPLER_PATH = "packages/runtime/src/pagemill/runtime/sample/sampler.py"


def logits_like_a_model(rows: int, vocab: int, seed: int = 0, flat: bool = False) -> torch.Tensor:
    """Peaked rows (a few strong tokens over a long tail: top-p 0.95 keeps tens to hundreds)
    or, with `flat`, rows whose tail holds most of the mass (a top-p 0.95 nucleus of
    thousands of tokens: the hard case for any sampler that orders tokens)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 2.0
    boost = 6.0 if flat else 14.0
    x[:, :64] += boost * torch.rand(rows, 64, generator=g)  # a few likely tokens
    return x[:, torch.randperm(vocab, generator=g)].to(torch.bfloat16)


def load_baseline(rev: str) -> type:
    """The `Sampler` class of `sampler.py` at commit `rev`, imported under another name."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ["git", "show", f"{rev}:{SAMPLER_PATH}"], cwd=root, check=True, capture_output=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "baseline_sampler.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("baseline_sampler", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_sampler"] = module
    spec.loader.exec_module(module)
    return module.Sampler  # type: ignore[no-any-return]


def metadata(kw: dict[str, Any], rows: int, vocab: int) -> SamplingMetadata:
    params = [SamplingParams(**kw)] * rows
    g = torch.Generator().manual_seed(rows)
    # 64 prompt and 32 generated tokens per row, for the penalties
    prompts = [torch.randint(vocab, (64,), generator=g).tolist() for _ in params]
    outputs = [torch.randint(vocab, (32,), generator=g).tolist() for _ in params]
    return SamplingMetadata.from_params(params, output_token_ids=outputs, prompt_token_ids=prompts)


def time_case(
    samplers: dict[str, Any], logits: torch.Tensor, md: SamplingMetadata, iters: int
) -> dict[str, float]:
    """Best time of each sampler on this case, interleaved round by round."""
    for s in samplers.values():
        for _ in range(2):
            s(logits, md)
    best = {name: float("inf") for name in samplers}
    for _ in range(iters):
        for name, s in samplers.items():
            t = time.perf_counter()
            s(logits, md)
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,16,64,128,256")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--flat", action="store_true", help="flat rows (see logits_like_a_model)")
    ap.add_argument("--baseline", default=None, help="a commit whose sampler.py runs as `old`")
    ap.add_argument("--no-compile", action="store_true", help="skip the `new+compile` variant")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    samplers: dict[str, Any] = {}
    if args.baseline:
        samplers["old"] = load_baseline(args.baseline)(seed=0)
    samplers["new"] = Sampler(seed=0)
    if not args.no_compile:
        compiled = Sampler(seed=0)
        seconds = compiled.compile(args.vocab, "cpu", (torch.float32,))  # as the engine
        print(f"compiled the row kernels in {seconds:.1f} s", file=sys.stderr)
        samplers["new+compile"] = compiled
    print(
        f"vocab {args.vocab}, {'flat' if args.flat else 'peaked'} bf16 rows, "
        f"{torch.get_num_threads()} threads, best of {args.iters} interleaved rounds; "
        f"ms (x greedy of the same variant)"
    )
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    header = f"{'case':<24}{'variant':<13}" + "".join(f"{'batch ' + str(b):>20}" for b in sizes)
    print(header)
    table: dict[tuple[str, str], list[str]] = {}
    for b in sizes:
        with torch.inference_mode():  # as the engine's logits are
            logits = logits_like_a_model(b, args.vocab, flat=args.flat)
        base: dict[str, float] = {}
        for case, kw in CASES.items():
            best = time_case(samplers, logits, metadata(kw, b, args.vocab), args.iters)
            for name, s in best.items():
                base.setdefault(name, s)
                cell = f"{s * 1e3:8.2f} ({s / base[name]:5.2f}x)"
                table.setdefault((case, name), []).append(cell)
    for (case, name), cells in table.items():
        print(f"{case:<24}{name:<13}" + "".join(f"{c:>20}" for c in cells))


if __name__ == "__main__":
    main()
