"""Tensor parallelism on CPU: decode step time of TP=2 (two processes, gloo) vs TP=1, and
how much of a TP=2 step rank 0 spends in collectives.

The model is a Llama-layout config with random ("dummy") weights, sized so that TP=2
divides it (SmolLM2-135M's 9 heads do not split in two): by default hidden 768, 12 layers,
12 heads / 4 KV heads, intermediate 2048, vocab 32000 (~130M parameters). Each batch size
runs `--batch-sizes` requests of a short prompt to the decode phase, then times
`LLMEngine.step()` over `--steps` decode steps (median). TP=1 gets all `--threads` torch
threads; TP=2 gives each rank half of them (the engine's own split), so both use the same
cores.

Rank 0's collectives are timed by wrapping its `TensorParallelGroup` methods: all-reduce
(2 per layer + the embedding), the step's broadcast and the logits gather. Time in them
includes waiting for the other rank to arrive, so it is the share of the step that
tensor parallelism costs on top of the split compute. Nothing is asserted.

    python benchmarks/tensor_parallel.py
    python benchmarks/tensor_parallel.py --batch-sizes 1,16 --steps 20 --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any


def write_config(folder: Path, args: argparse.Namespace) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": args.hidden,
                "num_hidden_layers": args.layers,
                "num_attention_heads": args.heads,
                "num_key_value_heads": args.kv_heads,
                "intermediate_size": args.intermediate,
                "vocab_size": args.vocab,
                "max_position_embeddings": 2048,
                "rms_norm_eps": 1e-5,
                "tie_word_embeddings": False,
                "torch_dtype": "bfloat16",
            }
        )
    )


def instrument(tp: Any, spent: dict[str, float]) -> None:
    """Accumulate the seconds rank 0 spends in each collective."""
    for name in ("all_reduce", "broadcast_object", "gather_to_driver"):
        inner = getattr(tp, name)

        def timed(*a: Any, _inner: Any = inner, _name: str = name, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _inner(*a, **k)
            finally:
                spent[_name] += time.perf_counter() - t0

        setattr(tp, name, timed)


def measure(folder: Path, tp: int, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pagemill.runtime import LLMEngine, SamplingParams

    torch.set_num_threads(args.threads)
    engine = LLMEngine(
        model=str(folder),
        load_format="dummy",
        tensor_parallel_size=tp,
        dtype=args.dtype,
        enforce_eager=True,
        max_num_seqs=max(batch, 1),
        max_model_len=512,
        kv_cache_memory_bytes=256 << 20,
    )
    spent: dict[str, float] = defaultdict(float)
    core = engine.engine_core
    if core.tp is not None:
        instrument(core.tp, spent)
    try:
        params = SamplingParams(
            max_tokens=args.steps + args.warmup + 4, temperature=0.0, ignore_eos=True
        )
        for i in range(batch):
            engine.add_request(f"r{i}", [(7 * i + j) % 1000 + 1 for j in range(16)], params)
        for _ in range(args.warmup + 1):  # the prefill, then warm-up decodes
            engine.step()
        times, forwards = [], []
        spent.clear()
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
            forwards.append(core.model_runner.last_forward_s)
        total = sum(times)
        return {
            "tp": tp,
            "batch": batch,
            "threads_per_rank": torch.get_num_threads(),
            "step_ms": statistics.median(times) * 1e3,
            "forward_ms": statistics.median(forwards) * 1e3,
            "all_reduce_share": spent["all_reduce"] / total,
            "broadcast_share": spent["broadcast_object"] / total,
            "gather_share": spent["gather_to_driver"] / total,
            "all_reduce_ms_per_step": spent["all_reduce"] / args.steps * 1e3,
            "all_reduces_per_step": 2 * args.layers + 1,
        }
    finally:
        engine.shutdown()
        torch.set_num_threads(args.threads)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--threads", type=int, default=2, help="torch threads in all (TP=2: per rank half)"
    )
    p.add_argument("--dtype", default="auto")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "tp-bench-llama"
        write_config(folder, args)
        for batch in batches:
            for tp in (1, 2):
                row = measure(folder, tp, batch, args)
                rows.append(row)
                print(
                    f"batch {batch:>3} TP={tp}: step {row['step_ms']:7.2f} ms "
                    f"(forward {row['forward_ms']:7.2f} ms, {row['threads_per_rank']} "
                    f"thread(s)/rank)"
                    + (
                        f"; all-reduce {row['all_reduce_share']:.0%} of the step "
                        f"({row['all_reduce_ms_per_step']:.2f} ms over "
                        f"{row['all_reduces_per_step']} calls), broadcast "
                        f"{row['broadcast_share']:.0%}, gather {row['gather_share']:.0%}"
                        if tp > 1
                        else ""
                    ),
                    flush=True,
                )
    print("\nbatch  TP=1 ms  TP=2 ms  TP=2/TP=1  all-reduce share (TP=2)")
    for batch in batches:
        one = next(r for r in rows if r["batch"] == batch and r["tp"] == 1)
        two = next(r for r in rows if r["batch"] == batch and r["tp"] == 2)
        print(
            f"{batch:>5} {one['step_ms']:>8.2f} {two['step_ms']:>8.2f} "
            f"{two['step_ms'] / one['step_ms']:>10.2f}x {two['all_reduce_share']:>10.0%}"
        )
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "machine": platform.processor() or platform.machine(),
                    "args": vars(args) | {"json": str(args.json)},
                    "rows": rows,
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
