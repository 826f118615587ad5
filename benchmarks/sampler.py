"""Sampler cost per step: temperature/top-p/top-k/penalty rows against greedy, in one process.

    python benchmarks/sampler.py --batch-sizes 1,16,64,128,256 --vocab 49152
    python benchmarks/sampler.py --baseline HEAD~3     # also the sampler of another commit

Logits are bf16 (the model's dtype on CPU), drawn like a language model's: a few strong
tokens over a long tail (`--flat`: a long tail that holds most of the mass). Each case is
timed over `--iters` rounds after a warm-up; within a round every sampler variant runs the
case once, in turn, so a shared machine's load falls on all of them alike. The ratio is
against greedy at the same batch size, measured by the same variant in the same rounds.

Variants: `new` (this tree's sampler: native CPU row kernels where a compiler builds them),
with `--torch-kernels` also `new/torch` and `new/torch+c` (its torch row kernels, eager and
compiled, as where no compiler is found) and, with `--baseline REV`, `old` and `old+compile`:
`sampler.py` and `row_kernels.py` of commit REV loaded beside it (git must read REV).

On a busy box, prefer `--threads 1 --clock thread` (per-thread CPU time, medians):

    python benchmarks/sampler.py --baseline 413bfc6 --batch-sizes 1,16,64,128,256 \
        --iters 15 --threads 1 --clock thread
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pagemill.runtime.sample.row_kernels import RowKernels
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
    "T=0.8 penalties": dict(
        temperature=0.8, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1
    ),
    "greedy+penalties": dict(
        temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1
    ),
    "T=0.8 logit_bias": dict(temperature=0.8, logit_bias={i * 97: 1.5 for i in range(20)}),
}
SAMPLER_PATH = "packages/runtime/src/pagemill/runtime/sample/sampler.py"
ROW_KERNELS_PATH = "packages/runtime/src/pagemill/runtime/sample/row_kernels.py"


def logits_like_a_model(rows: int, vocab: int, seed: int = 0, flat: bool = False) -> torch.Tensor:
    """Peaked rows (a few strong tokens over a long tail: top-p 0.95 keeps tens to hundreds)
    or, with `flat`, rows whose tail holds most of the mass (a top-p 0.95 nucleus of
    thousands of tokens: the hard case for any sampler that orders tokens)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 2.0
    boost = 6.0 if flat else 14.0
    x[:, :64] += boost * torch.rand(rows, 64, generator=g)  # a few likely tokens
    return x[:, torch.randperm(vocab, generator=g)].to(torch.bfloat16)


def _load_module(name: str, source: bytes) -> Any:
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_baseline(rev: str) -> type:
    """The `Sampler` class of `sampler.py` at commit `rev` (with that commit's own
    `row_kernels.py` where it has one), imported under other names."""
    root = Path(__file__).resolve().parent.parent

    def show(path: str) -> bytes | None:
        done = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, capture_output=True)
        return done.stdout if done.returncode == 0 else None

    source = show(SAMPLER_PATH)
    assert source is not None, f"{SAMPLER_PATH} is not in {rev}"
    kernels = show(ROW_KERNELS_PATH)
    if kernels is not None:
        _load_module("baseline_row_kernels", kernels)
        source = source.replace(
            b"from pagemill.runtime.sample.row_kernels import",
            b"from baseline_row_kernels import",
        )
    return _load_module("baseline_sampler", source).Sampler  # type: ignore[no-any-return]


def metadata(
    kw: dict[str, Any], rows: int, vocab: int, history: tuple[int, int] = (64, 32)
) -> SamplingMetadata:
    """`rows` rows of `kw`, each with `history` (prompt, generated) random tokens for the
    penalties (the generated lists grow by a token a round, see `time_case`)."""
    params = [SamplingParams(**kw)] * rows
    g = torch.Generator().manual_seed(rows)
    prompts = [torch.randint(vocab, (history[0],), generator=g).tolist() for _ in params]
    outputs = [torch.randint(vocab, (history[1],), generator=g).tolist() for _ in params]
    return SamplingMetadata.from_params(params, output_token_ids=outputs, prompt_token_ids=prompts)


def time_case(
    samplers: dict[str, Any], logits: torch.Tensor, md: SamplingMetadata, args: Any
) -> dict[str, float]:
    """Each sampler's time on this case (median or best over rounds), interleaved round by
    round so that the box's load falls on every variant alike. Each round first appends a
    token to every row's output, as a decode step does (the same metadata serves every
    round, as the runner's serves every step of an unchanged batch)."""
    for s in samplers.values():
        for _ in range(2):
            s(logits, md)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    times: dict[str, list[float]] = {name: [] for name in samplers}
    g = torch.Generator().manual_seed(1)
    vocab = logits.shape[1]
    for _ in range(args.iters):
        for out, t in zip(md.output_token_ids, torch.randint(vocab, (md.num_rows,), generator=g)):
            out.append(int(t))  # type: ignore[attr-defined]
        for name, s in samplers.items():
            t = clock()
            s(logits, md)
            times[name].append(clock() - t)
    pick = statistics.median if args.stat == "median" else min
    return {name: pick(ts) for name, ts in times.items()}


def _counts_from_lists(md: SamplingMetadata, vocab: int) -> None:
    """How penalties found each row's ids before token histories (up to 65262f7): every
    row's whole token lists read and counted, every step."""
    from itertools import chain

    import numpy as np

    prompts = md.prompt_token_ids
    assert prompts is not None
    rows = list(range(md.num_rows))
    outs = md.output_token_ids
    for seqs, lengths in (
        (
            [chain(prompts[r], outs[r]) for r in rows],
            [len(prompts[r]) + len(outs[r]) for r in rows],
        ),
        (outs, [len(o) for o in outs]),
    ):
        ids = torch.from_numpy(np.fromiter(chain.from_iterable(seqs), np.int64, sum(lengths)))
        row_of = torch.from_numpy(np.repeat(np.asarray(rows, dtype=np.int64), lengths))
        ok = (ids >= 0) & (ids < vocab)
        torch.unique(row_of[ok] * vocab + ids[ok], return_counts=True)


def _counts_from_histories(md: SamplingMetadata, vocab: int) -> None:
    """The torch path's counting now: from the synced histories."""
    from pagemill.runtime.sample import sampler as mod

    histories, _, _ = mod._synced_histories(md)
    rows = list(range(md.num_rows))
    seen = [mod._seen_ids(histories[r]) for r in rows]
    mod._occurrences(rows, seen, vocab, torch.device("cpu"))
    outs = [mod._history(histories, r).output_ids for r in rows]
    mod._occurrences(rows, outs, vocab, torch.device("cpu"))


def _histories_native_path(md: SamplingMetadata, vocab: int) -> None:
    """The native path's host work: the synced histories' addresses."""
    from pagemill.runtime.sample import sampler as mod

    mod._history_table(md, [])


def host_cost(sizes: list[int], vocab: int, history: tuple[int, int], args: Any) -> None:
    """The host's share of penalties per step, one token appended to each row per round,
    interleaved: counting every row's ids from its whole token lists (before token
    histories), the torch path's counting from the synced histories, and the native
    path's (bringing the histories up to date; the counting is in the native pass)."""
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    print(f"host work of penalties per step, histories of {history[0]} + {history[1]}+ tokens")
    fns = {
        "token lists": _counts_from_lists,
        "torch path": _counts_from_histories,
        "native path": _histories_native_path,
    }
    print(f"{'rows':>6}" + "".join(f"{name + ' ms':>16}" for name in fns))
    for b in sizes:
        md = metadata(CASES["T=0.8 penalties"], b, vocab, history)
        _histories_native_path(md, vocab)  # made once per request, at its first step
        times: dict[str, list[float]] = {name: [] for name in fns}
        g = torch.Generator().manual_seed(1)
        for _ in range(args.iters):
            for out, t in zip(md.output_token_ids, torch.randint(vocab, (b,), generator=g)):
                out.append(int(t))  # type: ignore[attr-defined]
            for name, fn in fns.items():
                t0 = clock()
                fn(md, vocab)
                times[name].append(clock() - t0)
        print(f"{b:>6}" + "".join(f"{statistics.median(times[n]) * 1e3:>16.3f}" for n in fns))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,16,64,128,256")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--flat", action="store_true", help="flat rows (see logits_like_a_model)")
    ap.add_argument("--baseline", default=None, help="a commit whose sampler runs as `old`")
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled variants")
    ap.add_argument(
        "--torch-kernels", action="store_true", help="also this tree's torch row kernels"
    )
    ap.add_argument("--stat", choices=("median", "best"), default="median")
    ap.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="thread: this thread's CPU time (meaningful with --threads 1 on a busy box)",
    )
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    ap.add_argument(
        "--history",
        default="64,32",
        help="prompt,generated tokens per row at the start (penalties read them all)",
    )
    ap.add_argument(
        "--host", action="store_true", help="only the host work of penalties (see host_cost)"
    )
    args = ap.parse_args()
    history = tuple(int(n) for n in args.history.split(","))
    assert len(history) == 2, "--history takes PROMPT,GENERATED"
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.host:
        sizes = [int(s) for s in args.batch_sizes.split(",")]
        host_cost(sizes, args.vocab, history, args)  # type: ignore[arg-type]
        return

    def compiled(s: Any) -> Any:
        seconds = s.compile(args.vocab, "cpu", (torch.float32,))  # as the engine
        print(f"compiled the row kernels in {seconds:.1f} s", file=sys.stderr)
        return s

    samplers: dict[str, Any] = {}
    if args.baseline:
        old = load_baseline(args.baseline)
        samplers["old"] = old(seed=0)
        if not args.no_compile:
            samplers["old+compile"] = compiled(old(seed=0))
    samplers["new"] = Sampler(seed=0)  # native CPU kernels where they build
    if args.torch_kernels:
        for name, compile_it in (("new/torch", False), ("new/torch+c", True)):
            if compile_it and args.no_compile:
                continue
            s = Sampler(seed=0)
            s._kernels = RowKernels(native=False)
            samplers[name] = compiled(s) if compile_it else s
    cases = CASES if args.cases is None else {c: CASES[c] for c in args.cases.split(",")}
    print(
        f"vocab {args.vocab}, {'flat' if args.flat else 'peaked'} bf16 rows, "
        f"{torch.get_num_threads()} threads, {args.stat} of {args.iters} "
        f"interleaved rounds ({args.clock} clock), histories of {history[0]} prompt + "
        f"{history[1]}+ generated tokens; "
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
        for case, kw in cases.items():
            md = metadata(kw, b, args.vocab, history)  # type: ignore[arg-type]
            best = time_case(samplers, logits, md, args)
            for name, s in best.items():
                base.setdefault(name, s)
                cell = f"{s * 1e3:8.2f} ({s / base[name]:5.2f}x)"
                table.setdefault((case, name), []).append(cell)
    for (case, name), cells in table.items():
        print(f"{case:<24}{name:<13}" + "".join(f"{c:>20}" for c in cells))


if __name__ == "__main__":
    main()
