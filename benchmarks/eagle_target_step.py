"""EAGLE-3's target forward on CPU: compiled with its layer inputs as a second output (now)
against the eager forward (what EAGLE-3 used to force, to let forward pre-hooks collect
the layer inputs; the eager forward here has no hooks, so the old cost was at least this).

The target is the default model (SmolLM2-135M-Instruct, packed Q4_1) with a random EAGLE-3
head saved in a temporary folder (random weights: only the target's step is timed here,
not acceptance). Steps are verify-shaped: B requests of k + 1 tokens. Both forwards run on
the same step inputs in one process, alternating (A B B A ...), timed by per-thread CPU time
with one torch thread, so the load of other jobs on a shared machine lands on both; reported
are each side's median and the median of the per-pair ratios (eager / compiled).

    python benchmarks/eagle_target_step.py                   # B = 1, 4, 16; k = 3; 30 pairs
    python benchmarks/eagle_target_step.py --batch-sizes 1,8 --pairs 60 --json out.json

The first run compiles the target (a minute or two; the compile cache keeps it for later
runs). Figures are printed (and written to --json); nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

# Time compiled steps: a cold compile cache compiles before the engine is ready, not beside
# eager steps (the engine's default on a cold start).
os.environ.setdefault("PAGEMILL_COMPILE_BACKGROUND", "0")


def write_head(folder: Path, target: Any, aux: list[int]) -> None:
    """A random one-layer EAGLE-3 head for `target` (a pagemill ModelConfig)."""
    h, inter = target.hidden_size, target.intermediate_size
    q, kv = target.num_attention_heads, target.num_key_value_heads
    d = target.head_dim
    gen = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    t = {
        "midlayer.self_attn.q_proj.weight": r(q * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": r(kv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": r(kv * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": r(h, q * d),
        "midlayer.mlp.gate_proj.weight": r(inter, h),
        "midlayer.mlp.up_proj.weight": r(inter, h),
        "midlayer.mlp.down_proj.weight": r(h, inter),
        "midlayer.input_layernorm.weight": torch.ones(h),
        "midlayer.hidden_norm.weight": torch.ones(h),
        "midlayer.post_attention_layernorm.weight": torch.ones(h),
        "fc.weight": r(h, 3 * h),
        "norm.weight": torch.ones(h),
        "lm_head.weight": r(target.vocab_size, h),
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(t, str(folder / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "num_attention_heads": q,
        "num_key_value_heads": kv,
        "head_dim": d,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": target.vocab_size,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "eagle_aux_hidden_state_layer_ids": aux,
    }
    (folder / "config.json").write_text(json.dumps(config))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.pop("PAGEMILL_ENFORCE_EAGER", None)

    from pagemill.runtime import LLM

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        kw: dict[str, Any] = {} if args.model is None else {"model": args.model}
        probe = LLM(**kw, enforce_eager=True, max_model_len=512, kv_cache_memory_bytes=16 << 20)
        target = probe.llm_engine.engine_core.model_config
        del probe
        n = target.num_hidden_layers
        write_head(Path(tmp) / "head", target, [2, n // 2, n - 3])
        head = str(Path(tmp) / "head")
        spec = {"method": "eagle3", "model": head, "num_speculative_tokens": args.k}
        llm = LLM(
            **kw,
            speculative_config=spec,
            max_num_batched_tokens=max(256, max(sizes) * (args.k + 1)),
            max_model_len=512,
            kv_cache_memory_bytes=64 << 20,
        )
        runner = llm.llm_engine.engine_core.model_runner
        assert runner.compiled and runner.model.aux_hidden_state_layers
        results: list[dict[str, Any]] = []
        for b in sizes:
            batch, _ = runner.dummy_batch(num_tokens=b * (args.k + 1), max_seqs=b)
            runner.input_batch, runner.requests = runner._new_input_batch(), {}
            step = runner.prepare(batch)
            assert step is not None
            sides = {"compiled": runner._forward, "eager": runner.model.forward}
            times: dict[str, list[float]] = {name: [] for name in sides}
            with torch.inference_mode():
                for f in sides.values():  # warm (and compile this shape)
                    f(step.input_ids, step.positions, step.attn)
                for i in range(args.pairs):
                    order = list(sides) if i % 2 == 0 else list(sides)[::-1]
                    for name in order:
                        t0 = time.thread_time()
                        sides[name](step.input_ids, step.positions, step.attn)
                        times[name].append(time.thread_time() - t0)
            ratios = [e / c for e, c in zip(times["eager"], times["compiled"])]
            row = {
                "batch": b,
                "tokens": b * (args.k + 1),
                "compiled_ms": 1e3 * statistics.median(times["compiled"]),
                "eager_ms": 1e3 * statistics.median(times["eager"]),
                "eager_over_compiled": statistics.median(ratios),
            }
            results.append(row)
            print(
                f"B={b:3d} ({row['tokens']:3d} tokens): compiled {row['compiled_ms']:.2f} ms, "
                f"eager {row['eager_ms']:.2f} ms, eager/compiled {row['eager_over_compiled']:.2f}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"k": args.k, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
