"""Many LoRA adapters at once: a decode step of 4 adapters x 16 requests against one of 64
base-model requests, on the same engine in the same run, and how long an adapter takes to
load.

    python benchmarks/lora.py                          # SmolLM2-135M (its GGUF), compiled
    python benchmarks/lora.py --eager --rounds 3 --json out.json
    python benchmarks/lora.py --rounds 5 --steps 6 --compare-torch   # native vs torch path
    python benchmarks/lora.py --model /path/to/hf-folder --device cuda --dtype bfloat16

Adapters are random rank-``--rank`` PEFT folders (adapter_config.json +
adapter_model.safetensors, q/k/v/o/gate/up/down) written for the model's shapes, so no
adapter needs downloading. One engine with ``enable_lora``, ``max_loras=4``: each round
runs the 64 base requests and then the 4 x 16 adapter requests (prompts of ``--prompt``
tokens, decoding) and times ``--steps`` decode steps of each, after a warm-up; rounds
alternate so that a shared, loaded machine weighs on both alike. Reported: the median
forward time of a step (the model runner's ``last_forward_s``) and of the whole
``engine.step()``, and their LoRA / base ratios (the issue's target: <= 1.3x at rank 16).
``--compare-torch`` also times the LoRA steps on the torch path (per slot a shrink and an
expand GEMM, the native CPU kernel switched off), in the same rounds; ``--compare-gather``
adds that path with its in-place runs off (and implies ``--compare-torch``).
``--no-lora-engine`` also times the 64 base requests on an engine without LoRA (the cost
the slots and the mapping add when no adapter is used). Load time: reading and checking
an adapter from its folder (first use), and copying it into a device slot (on eviction).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def write_adapter(folder: Path, config: Any, rank: int, seed: int) -> None:
    """A random PEFT LoRA folder for a Llama-family model of `config`'s shapes."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    h, inter = config.hidden_size, config.intermediate_size
    q, kv = config.q_size, config.kv_size
    shapes = {
        "self_attn.q_proj": (h, q),
        "self_attn.k_proj": (h, kv),
        "self_attn.v_proj": (h, kv),
        "self_attn.o_proj": (q, h),
        "mlp.gate_proj": (h, inter),
        "mlp.up_proj": (h, inter),
        "mlp.down_proj": (inter, h),
    }
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(config.num_hidden_layers):
        for name, (fan_in, fan_out) in shapes.items():
            p = f"base_model.model.model.layers.{i}.{name}"
            tensors[p + ".lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            tensors[p + ".lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": [n.split(".")[1] for n in shapes],
                "bias": "none",
            }
        )
    )


def _decode_len(args: argparse.Namespace) -> int:
    """Tokens each request decodes: its prefill step, the warm-up and the timed steps."""
    return args.warmup + args.steps + 8


def _engine(args: argparse.Namespace, lora: bool) -> Any:
    from pagemill.runtime import LLM

    kw: dict[str, Any] = dict(
        device=args.device,
        max_num_seqs=64,
        max_model_len=args.prompt + _decode_len(args) + 8,
        enforce_eager=args.eager,
    )
    if args.dtype:
        kw["dtype"] = args.dtype
    if args.load_format:
        kw["load_format"] = args.load_format
    if args.kv_cache_gib:
        kw["kv_cache_memory_bytes"] = int(args.kv_cache_gib * 2**30)
    if lora:
        kw.update(enable_lora=True, max_loras=4, max_lora_rank=args.rank, max_cpu_loras=8)
    return LLM(args.model, **kw).llm_engine


def _time_steps(engine: Any, loras: list[Any], args: argparse.Namespace, tag: str) -> dict:
    """64 requests (one LoRARequest or None each) decoding: median forward and step ms."""
    from pagemill.runtime import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=_decode_len(args), ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    vocab = engine.engine_core.model_config.vocab_size
    ids = []
    for i, lora in enumerate(loras):
        rid = f"{tag}-{i}"
        prompt = torch.randint(10, vocab, (args.prompt,), generator=g).tolist()
        engine.add_request(rid, prompt, params, lora_request=lora)
        ids.append(rid)
    runner = engine.engine_core.model_runner
    seen: set[str] = set()
    while len(seen) < len(ids):  # every prompt computed: from here on, steps are decodes
        seen |= {o.request_id for o in engine.step()}
    for _ in range(args.warmup):
        engine.step()
    forward, step = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        step.append(time.perf_counter() - t0)
        forward.append(runner.last_forward_s)
    engine.abort_request(ids)
    engine.step()
    return {
        "forward_ms": statistics.median(forward) * 1e3,
        "step_ms": statistics.median(step) * 1e3,
    }


def run(args: argparse.Namespace) -> dict:
    from pagemill.kernels import lora_cpu
    from pagemill.runtime.lora import LoRARequest

    t0 = time.perf_counter()
    engine = _engine(args, lora=True)
    start_s = time.perf_counter() - t0
    core = engine.engine_core
    manager = core.model_runner.lora
    tmp = Path(tempfile.mkdtemp(prefix="pagemill-lora-bench-"))
    adapters = []
    for i in range(4):
        write_adapter(tmp / f"a{i}", core.model_config, args.rank, seed=i)
        adapters.append(LoRARequest(f"a{i}", i + 1, str(tmp / f"a{i}")))
    # Load time: read + check (first use), then a copy into a slot (what eviction costs).
    read_s = []
    for a in adapters:
        t = time.perf_counter()
        manager.add_adapter(a)
        read_s.append(time.perf_counter() - t)
    slot_s = []
    for a in adapters:
        t = time.perf_counter()
        manager.activate([a.lora_int_id])
        if core.device.type == "cuda":
            torch.cuda.synchronize()
        slot_s.append(time.perf_counter() - t)
    base_loras = [None] * 64
    mixed = [adapters[i // 16] for i in range(64)]
    rounds = []
    for r in range(args.rounds):
        base = _time_steps(engine, base_loras, args, f"base{r}")
        lora = _time_steps(engine, mixed, args, f"lora{r}")
        rounds.append({"base": base, "lora": lora})
        if args.compare_torch or args.compare_gather:  # the torch path (native kernel off)
            lora_cpu.use_native = False
            rounds[-1]["lora_torch"] = _time_steps(engine, mixed, args, f"torch{r}")
            if args.compare_gather:  # and with every layer on its gather path
                manager.mapping.in_place_runs = False
                rounds[-1]["lora_gather"] = _time_steps(engine, mixed, args, f"gather{r}")
                manager.mapping.in_place_runs = True
            lora_cpu.use_native = True
        print(
            f"round {r}: 64 base {base['forward_ms']:.1f} ms forward / {base['step_ms']:.1f} "
            f"ms step; 4x16 LoRA {lora['forward_ms']:.1f} / {lora['step_ms']:.1f} ms"
            + (
                "".join(
                    f"; {name} path {rounds[-1]['lora_' + name]['forward_ms']:.1f} / "
                    f"{rounds[-1]['lora_' + name]['step_ms']:.1f} ms"
                    for name in ("torch", "gather")
                    if "lora_" + name in rounds[-1]
                )
            )
        )
    report: dict[str, Any] = {
        "model": args.model,
        "device": str(core.device),
        "dtype": str(core.dtype),
        "compiled": core.model_runner.compiled,
        "rank": args.rank,
        "engine_start_s": start_s,
        "adapter_bytes": sum(a.nbytes for a in manager.cpu.values()) // max(1, len(manager.cpu)),
        "adapter_read_ms": statistics.median(read_s) * 1e3,
        "adapter_to_slot_ms": statistics.median(slot_s) * 1e3,
        "slot_bytes": manager.nbytes,
        "rounds": rounds,
    }
    for key in ("forward_ms", "step_ms"):
        ratios = [x["lora"][key] / x["base"][key] for x in rounds]
        report[f"lora_over_base_{key}"] = statistics.median(ratios)
        for name in ("torch", "gather"):
            if "lora_" + name in rounds[0]:
                ratios = [x["lora_" + name][key] / x["base"][key] for x in rounds]
                report[f"{name}_over_base_{key}"] = statistics.median(ratios)
    if args.no_lora_engine:
        del engine, core, manager
        plain = _engine(args, lora=False)
        report["no_lora_engine_base"] = _time_steps(plain, base_loras, args, "plain")
    return report


def print_report(report: dict) -> None:
    print(
        f"{report['model']} on {report['device']} ({report['dtype']}, "
        f"{'compiled' if report['compiled'] else 'eager'}), rank {report['rank']}"
    )
    print(
        f"adapter: {report['adapter_bytes'] / 1e6:.1f} MB, read+check "
        f"{report['adapter_read_ms']:.1f} ms, into a slot {report['adapter_to_slot_ms']:.1f} ms"
    )
    print(
        "4 adapters x 16 vs 64 base, median over rounds: forward "
        f"{report['lora_over_base_forward_ms']:.2f}x, "
        f"whole step {report['lora_over_base_step_ms']:.2f}x"
    )
    for name, what in (("torch", "torch path (in-place runs)"), ("gather", "gather path")):
        if f"{name}_over_base_step_ms" in report:
            print(
                f"the same on the {what}: forward "
                f"{report[f'{name}_over_base_forward_ms']:.2f}x, "
                f"whole step {report[f'{name}_over_base_step_ms']:.2f}x"
            )
    if "no_lora_engine_base" in report:
        print(f"64 base on an engine without LoRA: {report['no_lora_engine_base']}")


def main() -> None:
    from pagemill.runtime.config import DEFAULT_MODEL

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--load-format", default=None, help="e.g. dummy: random weights")
    ap.add_argument("--kv-cache-gib", type=float, default=None)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=10, help="timed decode steps per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--eager", action="store_true", help="no compiled step")
    ap.add_argument("--no-lora-engine", action="store_true")
    ap.add_argument(
        "--compare-torch",
        action="store_true",
        help="also time the LoRA steps on the torch path (the native CPU kernel off)",
    )
    ap.add_argument(
        "--compare-gather",
        action="store_true",
        help="also the torch path with its in-place runs off (implies --compare-torch)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    report = run(args)
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
