"""Offline throughput: pagemill's continuous batching vs transformers' static batches.

One process, one run, one workload: N prompts of random token ids (seeded; lengths drawn
uniformly in [--min-input, --max-input]) with fixed output lengths drawn in
[--min-output, --max-output], EOS ignored so both systems produce exactly the same number
of tokens. Greedy decoding on both sides.

- pagemill: every request goes to `LLM.generate` at once; the scheduler keeps the batch
  full as requests finish.
- transformers: `model.generate()` on static batches of --hf-batch-size requests in
  workload order, left padded. A static batch runs until its longest request is done —
  that is the cost of static batching — but only each request's own tokens are counted.

Then a table of pagemill's decode step time vs the number of decoding requests, measured
by timing `LLMEngine.step()` when every running request is in its decode phase, for each
of --modes (how the weights are served and whether the step is compiled), against the
machine's limits measured in the same process: the weight-streaming floor (the bytes a
small step reads / large-tensor read bandwidth) and the GEMM roofline (the bf16 GEMM rate
/ 2 FLOPs per weight per token); and against "dense linears alone": dense bf16 `F.linear`
over all of the model's linear layers and LM head, eager, at the same batch sizes in the
same process (`x lin`: the step / those linears, everything the step does beyond its GEMMs).
Steps and linears are timed in turn, --step-rounds rounds of --step-iters each per batch
size, so that both see the box in the same state (timed minutes apart, on a shared box,
the linears alone moved by a tenth between runs and the ratio with them). The read
bandwidth behind the floor is measured the same way, once per round (`read_gb_s` per row,
the median of its rounds): on a shared VM it moved between 31 and 56 GB/s within minutes,
so one measurement at the start could put a row's floor far from the box it ran on (the
start's figure stays in the JSON as `machine.read_gb_s`).

Figures are printed (and written to --json); nothing is asserted.

    python benchmarks/throughput.py                      # the full workload
    python benchmarks/throughput.py --num-prompts 16 --max-output 64 --step-batch-sizes 1,4,16
    python benchmarks/throughput.py --skip-pagemill --skip-transformers \
        --modes bf16-eager,bf16,int8,int4,gguf          # the step table per weight format
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagemill.runtime.config import torch_dtype
from pagemill.runtime.model_config import DTYPES

# Time compiled steps: a cold compile cache compiles before the engine is ready, not beside
# eager steps (the engine's default on a cold start).
os.environ.setdefault("PAGEMILL_COMPILE_BACKGROUND", "0")


@dataclass
class Request:
    prompt_token_ids: list[int]
    output_len: int


def build_workload(
    args: argparse.Namespace, vocab_size: int, special_ids: set[int]
) -> list[Request]:
    """Random prompts: no text corpus is available offline, and ids cost no tokenizer time."""
    g = torch.Generator().manual_seed(args.seed)
    reqs = []
    low = 3  # skip the first ids, which are special in most vocabularies
    for _ in range(args.num_prompts):
        n_in = int(torch.randint(args.min_input, args.max_input + 1, (1,), generator=g))
        n_out = int(torch.randint(args.min_output, args.max_output + 1, (1,), generator=g))
        ids = torch.randint(low, vocab_size, (n_in,), generator=g).tolist()
        ids = [t if t not in special_ids else low for t in ids]
        reqs.append(Request(ids, n_out))
    return reqs


def resolve_model_dir(model: str) -> Path:
    """A folder transformers can load: the default model is converted (once) by pagemill."""
    from pagemill.runtime.model_executor.default_model import (
        ensure_default_model,
        is_default_model_name,
    )

    if is_default_model_name(model):
        return ensure_default_model()
    path = Path(model)
    if not path.is_dir():
        raise SystemExit(f"--model must be the default model's name or a model folder: {model}")
    return path


def make_llm(args: argparse.Namespace, model_dir: Path, mode: str | None = None) -> Any:
    from pagemill.runtime import LLM

    kwargs: dict[str, Any] = dict(
        model=args.model if mode is not None else str(model_dir),
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=args.seed,
    )
    if args.kv_cache_gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(args.kv_cache_gib * (1 << 30))
    if args.max_model_len is not None:
        kwargs["max_model_len"] = args.max_model_len
    if args.cpu_dense_weights is not None:
        kwargs["cpu_dense_weights"] = args.cpu_dense_weights
    if args.kv_cache_dtype is not None:
        kwargs["kv_cache_dtype"] = args.kv_cache_dtype
    if mode is not None:
        load_format, quantization, eager = MODES[mode]
        kwargs.update(load_format=load_format, quantization=quantization, enforce_eager=eager)
    return LLM(**kwargs)


# How a mode serves the weights: (load_format, quantization, enforce_eager).
MODES: dict[str, tuple[str, str | None, bool]] = {
    "bf16-eager": ("safetensors", None, True),  # dense weights, no compiled graph
    "bf16": ("safetensors", None, False),  # dense weights, compiled step
    "int8": ("safetensors", "int8", False),  # per-channel int8, quantized on load
    "int4": ("safetensors", "int4", False),  # int4 groups of 32 with zero points
    "gguf": ("auto", None, False),  # the default: the model's own Q4_1/Q8_0 kept packed
    "gguf-eager": ("auto", None, True),
}


def served_dtype(args: argparse.Namespace) -> torch.dtype:
    """The dtype the engine computes in for --dtype (auto resolved as the engine does)."""
    from pagemill.runtime.config import resolve_dtype

    device = "cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu"
    return torch_dtype(resolve_dtype(args.dtype, None, device))


def machine_limits(
    device: str, seconds: float = 1.0, dtype: torch.dtype = torch.bfloat16
) -> dict[str, Any]:
    """Large-tensor read bandwidth and the GEMM rate in `dtype`, measured now, in this process.

    The read runs a reduction over 512 MiB (far beyond any cache) with torch's threads; the
    GEMM is 2048^3 in `dtype` (bf16: oneDNN picks AMX / AVX512-BF16 where the CPU has them).
    Best of a few repetitions: the box is shared, and the best run is the nearest to its
    limit. `bf16_gemm_gflop_s` keeps its name whatever `dtype` is (older results use it);
    `gemm_dtype` says which it was.
    """
    dev = torch.device("cpu" if device == "auto" and not torch.cuda.is_available() else device)
    x = torch.ones(128 << 20, dtype=torch.float32, device=dev)  # 512 MiB
    a = torch.randn(2048, 2048, dtype=dtype, device=dev)
    b = torch.randn(2048, 2048, dtype=dtype, device=dev)

    def best(fn: Any) -> float:
        fn()
        times = []
        deadline = time.perf_counter() + seconds
        while len(times) < 3 or time.perf_counter() < deadline:
            _sync(str(dev))
            t0 = time.perf_counter()
            fn()
            _sync(str(dev))
            times.append(time.perf_counter() - t0)
        return min(times)

    read_s = best(lambda: x.sum())
    gemm_s = best(lambda: a @ b)
    return {
        "read_gb_s": x.numel() * 4 / read_s / 1e9,
        "bf16_gemm_gflop_s": 2 * 2048**3 / gemm_s / 1e9,
        "gemm_dtype": str(dtype).removeprefix("torch."),
    }


def model_costs(llm: Any) -> dict[str, float]:
    """What one token costs this model: bytes a small step streams and FLOPs per token."""
    from pagemill.runtime.model_executor.layers import Linear
    from pagemill.runtime.model_executor.quantization.report import weight_report

    model = llm.llm_engine.engine_core.model_runner.model
    report = weight_report(model)
    flops = sum(
        2 * m.in_features * m.out_features for m in model.modules() if isinstance(m, Linear)
    )
    return {"step_bytes": report.step_bytes, "flops_per_token": flops, "weights": report.summary()}


def linear_shapes(llm: Any) -> list[tuple[int, int]]:
    """[out, in] of every linear layer one token passes through, the LM head last: fused
    projections as the engine runs them."""
    from pagemill.runtime.model_executor.layers import Linear

    model = llm.llm_engine.engine_core.model_runner.model
    shapes = [
        (m.out_features, m.in_features)
        for name, m in model.named_modules()
        if isinstance(m, Linear) and name.split(".")[-1] != "logits_proj"
    ]
    head = model.lm_head_weight
    return [*shapes, (int(head.shape[0]), int(head.shape[1]))]


class DenseLinears:
    """Dense `F.linear` in the served dtype (bf16 by default) over the model's linear layers
    and LM head, eager (oneDNN, so AMX / AVX512-BF16 where the CPU has them): what the
    step's GEMMs alone would cost, the yardstick the step is held to. Random weights of the
    same shapes: time does not depend on the values."""

    def __init__(
        self, shapes: list[tuple[int, int]], device: str, dtype: torch.dtype = torch.bfloat16
    ) -> None:
        dev = torch.device("cpu" if device == "auto" else device)
        self.weights = [torch.randn(o, i, dtype=dtype, device=dev) for o, i in shapes]
        self.device = dev
        self.dtype = dtype

    def timer(self, rows: int) -> Callable[[], float]:
        """One pass over every layer at `rows` rows, timed (seconds); warmed once here."""
        xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=self.dtype) for w in self.weights}
        xs = {k: v.to(self.device) for k, v in xs.items()}

        def run() -> None:
            with torch.inference_mode():
                for w in self.weights:
                    torch.nn.functional.linear(xs[w.shape[1]], w)

        def timed() -> float:
            _sync(str(self.device))
            t0 = time.perf_counter()
            run()
            _sync(str(self.device))
            return time.perf_counter() - t0

        run()
        return timed


class ReadProbe:
    """The machine's large-tensor read bandwidth now: a best of two sums over 512 MiB (far
    beyond any cache) with torch's threads, as `machine_limits` measures it."""

    def __init__(self, device: str) -> None:
        dev = torch.device("cpu" if device == "auto" and not torch.cuda.is_available() else device)
        self.x = torch.ones(128 << 20, dtype=torch.float32, device=dev)
        self.device = str(dev)
        self.x.sum()

    def __call__(self) -> float:
        best = float("inf")
        for _ in range(2):
            _sync(self.device)
            t0 = time.perf_counter()
            self.x.sum()
            _sync(self.device)
            best = min(best, time.perf_counter() - t0)
        return self.x.numel() * 4 / best / 1e9


def _sync(device: str) -> None:
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize()


def run_pagemill(llm: Any, workload: list[Request], args: argparse.Namespace) -> dict[str, Any]:
    from pagemill.runtime import SamplingParams

    # warm-up: first-call costs (allocations, lazy imports) are not throughput
    llm.generate(
        [workload[0].prompt_token_ids[:16]],
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in workload
    ]
    prompts = [r.prompt_token_ids for r in workload]
    _sync(args.device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.no_tqdm)
    _sync(args.device)
    elapsed = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    produced = sum(len(t) for t in tokens)
    expected = sum(r.output_len for r in workload)
    if produced != expected:
        print(f"warning: pagemill produced {produced} tokens, expected {expected}", file=sys.stderr)
    return {
        "elapsed_s": elapsed,
        "output_tokens": produced,
        "output_tokens_per_s": produced / elapsed,
        "total_tokens_per_s": (produced + sum(len(p) for p in prompts)) / elapsed,
        "token_ids": tokens,
    }


def run_transformers(
    model_dir: Path, workload: list[Request], args: argparse.Namespace
) -> dict[str, Any]:
    import copy

    from transformers import AutoModelForCausalLM

    device = "cpu" if args.device == "auto" and not torch.cuda.is_available() else args.device
    if device == "auto":
        device = "cuda"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=served_dtype(args)).to(
        device
    )
    model.eval()
    gen_config = copy.deepcopy(model.generation_config)
    gen_config.eos_token_id = None  # ignore EOS: every request runs to its own length
    pad = 0
    gen_config.pad_token_id = pad
    gen_config.do_sample = False
    for name in ("temperature", "top_p", "top_k"):
        if hasattr(gen_config, name):
            setattr(gen_config, name, None)

    def generate(batch: list[Request]) -> list[list[int]]:
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            n = len(r.prompt_token_ids)
            ids[i, width - n :] = torch.tensor(r.prompt_token_ids)
            mask[i, width - n :] = 1
        cfg = copy.deepcopy(gen_config)
        cfg.max_new_tokens = cfg.min_new_tokens = max(r.output_len for r in batch)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=cfg
            )
        return [out[i, width : width + r.output_len].tolist() for i, r in enumerate(batch)]

    generate([Request(workload[0].prompt_token_ids[:16], 4)])  # warm-up
    tokens: list[list[int]] = []
    _sync(device)
    start = time.perf_counter()
    bs = args.hf_batch_size
    for b in range(0, len(workload), bs):
        t0 = time.perf_counter()
        tokens.extend(generate(workload[b : b + bs]))
        print(
            f"  transformers batch {b // bs + 1}/{-(-len(workload) // bs)}: "
            f"{time.perf_counter() - t0:.1f}s",
            file=sys.stderr,
        )
    _sync(device)
    elapsed = time.perf_counter() - start
    produced = sum(len(t) for t in tokens)
    generated = sum(
        len(workload[b : b + bs]) * max(r.output_len for r in workload[b : b + bs])
        for b in range(0, len(workload), bs)
    )
    return {
        "elapsed_s": elapsed,
        "output_tokens": produced,
        "output_tokens_per_s": produced / elapsed,
        "generated_incl_padding": generated,
        "token_ids": tokens,
    }


def wait_for_kv_prefault(llm: Any) -> None:
    """Wait until the CPU KV pool's pages are mapped (the engine starts that in a background
    thread once it is ready): a server in steady state has finished it, and a step timed
    beside it shares the cores with it (the batch-1 row doubled on 2 cores)."""
    cache = llm.llm_engine.engine_core.model_runner.kv_cache
    storage = getattr(cache, "storage", None)
    if storage is None:
        return
    t0 = time.perf_counter()
    storage.wait_prefaulted()
    waited = time.perf_counter() - t0
    if waited > 0.05:
        print(f"  waited {waited:.1f} s for the KV pool's prefault", file=sys.stderr)


def step_time_table(
    llm: Any,
    args: argparse.Namespace,
    vocab_size: int,
    dense: DenseLinears | None = None,
    read_probe: Callable[[], float] | None = None,
) -> list[dict[str, Any]]:
    """Median `engine.step()` time with exactly N requests decoding (no prefill in the step).

    Requests are added in increments and stay alive across rows (their contexts grow a
    little); only steps where every running request is past its prompt are timed. With
    `dense`, each batch size's --step-rounds rounds time --step-iters steps and then as
    many passes of the dense linears at N rows; with `read_probe`, each round ends with a
    read-bandwidth measurement (the row's `read_gb_s`: their median).
    """
    from pagemill.runtime import SamplingParams

    engine = llm.llm_engine
    g = torch.Generator().manual_seed(args.seed + 1)
    params = SamplingParams(temperature=0.0, max_tokens=args.step_max_tokens, ignore_eos=True)
    sizes = sorted({int(s) for s in args.step_batch_sizes.split(",")})
    rows = []
    decoding: dict[str, int] = {}
    live: list[str] = []
    try:
        for n in sizes:
            while len(live) < n:
                rid = f"step-{len(live)}"
                prompt = torch.randint(3, vocab_size, (args.step_context,), generator=g).tolist()
                engine.add_request(rid, prompt, params)
                live.append(rid)
            # run prefills until every live request has sampled at least one token
            while any(decoding.get(r, 0) < 1 for r in live):
                for out in engine.step():  # delta outputs: count the new tokens
                    new = sum(len(c.token_ids) for c in out.outputs)
                    decoding[out.request_id] = decoding.get(out.request_id, 0) + new
                    if out.finished:
                        reason = out.outputs[0].finish_reason if out.outputs else None
                        raise RuntimeError(
                            f"{out.request_id} finished during the step table ({reason}): "
                            f"{len(live)} requests of {args.step_context} prompt tokens and "
                            "the tokens decoded at the smaller batch sizes may not fit the KV "
                            "pool (an fp32 cache holds half a bf16 one's tokens); raise "
                            "--kv-cache-gib or --step-max-tokens"
                        )
            times, forwards, dense_times, reads = [], [], [], []
            runner = engine.engine_core.model_runner
            dense_pass = dense.timer(n) if dense is not None else None
            for _ in range(args.step_rounds):
                for _ in range(args.step_iters):
                    _sync(args.device)
                    t0 = time.perf_counter()
                    outs = engine.step()
                    _sync(args.device)
                    times.append(time.perf_counter() - t0)
                    forwards.append(runner.last_forward_s)
                    if len(outs) != n or any(o.finished for o in outs):
                        raise RuntimeError(
                            f"step with {n} decoding requests returned {len(outs)} outputs; "
                            f"raise --step-max-tokens or the KV pool (preemption/finish "
                            f"disturbs timing)"
                        )
                if dense_pass is not None:
                    dense_times += [dense_pass() for _ in range(args.step_iters)]
                if read_probe is not None:
                    reads.append(read_probe())
            med = statistics.median(times)
            # Host overhead: everything in the step but the model's forward and LM head
            # (scheduling, batch preparation, planning, sampling, detokenization, outputs).
            host = statistics.median([t - f for t, f in zip(times, forwards)])
            rows.append(
                {
                    "batch_size": n,
                    "step_ms": med * 1e3,
                    "forward_ms": statistics.median(forwards) * 1e3,
                    "host_ms": host * 1e3,
                    "host_share": host / med,
                    "tokens_per_s": n / med,
                    "min_ms": min(times) * 1e3,
                }
            )
            if reads:
                rows[-1]["read_gb_s"] = statistics.median(reads)
                rows[-1]["read_gb_s_rounds"] = reads
            if dense_times:
                rows[-1]["dense_linears_ms"] = statistics.median(dense_times) * 1e3
                rows[-1]["x_linears"] = med / statistics.median(dense_times)
            print(
                f"  decode step with {n:4d} requests: {med * 1e3:9.2f} ms  ({n / med:8.1f} tok/s)"
                f", host {host * 1e3:.2f} ms ({host / med:.1%})",
                file=sys.stderr,
            )
    finally:
        engine.abort_request(live)
        while engine.has_unfinished_requests():
            engine.step()
        engine.step()
    return rows


def agreement(a: list[list[int]], b: list[list[int]], prefix: int = 16) -> float:
    """Share of requests whose first `prefix` greedy tokens agree (bf16 rounding may split)."""
    same = sum(1 for x, y in zip(a, b) if x[:prefix] == y[:prefix])
    return same / max(1, len(a))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        default="HuggingFaceTB/SmolLM2-135M-Instruct",
        help="the default model's name or a Hugging Face model folder",
    )
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["auto", *sorted(DTYPES)],
        help="auto: the engine's choice (on CPU: bf16 with bf16 arithmetic, else fp32)",
    )
    ap.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--min-input", type=int, default=32)
    ap.add_argument("--max-input", type=int, default=512)
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=512)
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument(
        "--kv-cache-gib", type=float, default=None, help="KV pool size (default: engine's)"
    )
    ap.add_argument(
        "--mode",
        default="gguf",
        choices=sorted(MODES),
        help="how pagemill serves the weights in the offline comparison",
    )
    ap.add_argument(
        "--modes",
        default=None,
        help=f"comma-separated modes for the step table (default: --mode); of {', '.join(MODES)}",
    )
    ap.add_argument(
        "--cpu-dense-weights",
        default=None,
        choices=["auto", "always", "never"],
        help="dense copies of packed layers for large batches (default: the engine's, auto)",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default=None,
        help="KV cache element type, e.g. fp8 or int8 (default: the engine's, auto)",
    )
    ap.add_argument("--step-batch-sizes", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--step-context", type=int, default=64, help="prompt length in the step table")
    ap.add_argument("--step-iters", type=int, default=5)
    ap.add_argument(
        "--step-rounds",
        type=int,
        default=3,
        help="rounds per batch size of --step-iters steps, then as many dense-linear passes",
    )
    ap.add_argument("--step-max-tokens", type=int, default=1024)
    ap.add_argument("--skip-pagemill", action="store_true")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--skip-step-table", action="store_true")
    ap.add_argument("--no-tqdm", action="store_true")
    ap.add_argument("--json", type=Path, default=None, help="write all figures here")
    args = ap.parse_args(argv)
    if args.min_output > args.max_output:
        args.min_output = args.max_output
    if args.min_input > args.max_input:
        args.min_input = args.max_input
    if args.threads:
        torch.set_num_threads(args.threads)

    model_dir = resolve_model_dir(args.model)
    config = json.loads((model_dir / "config.json").read_text())
    vocab_size = int(config["vocab_size"])
    special = {
        t
        for t in (
            config.get("bos_token_id"),
            config.get("eos_token_id"),
            config.get("pad_token_id"),
        )
        if isinstance(t, int)
    }
    workload = build_workload(args, vocab_size, special)
    n_in = sum(len(r.prompt_token_ids) for r in workload)
    n_out = sum(r.output_len for r in workload)
    print(f"model {model_dir} ({args.dtype}, {args.device}, {torch.get_num_threads()} threads)")
    print(
        f"workload: {len(workload)} prompts, {n_in} prompt tokens, {n_out} output tokens "
        f"(inputs {args.min_input}-{args.max_input}, outputs {args.min_output}-{args.max_output}, "
        f"seed {args.seed})"
    )

    result: dict[str, Any] = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model_dir": str(model_dir),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
        "prompt_tokens": n_in,
        "output_tokens": n_out,
    }
    limits = machine_limits(args.device, dtype=served_dtype(args))
    result["machine"] = limits
    print(
        f"machine: read {limits['read_gb_s']:.1f} GB/s, {limits['gemm_dtype']} GEMM "
        f"{limits['bf16_gemm_gflop_s']:.0f} GFLOP/s (measured now)"
    )
    pm = hf = None
    llm = None
    if not args.skip_pagemill:
        t0 = time.perf_counter()
        llm = make_llm(args, model_dir, args.mode)
        result["pagemill_load_s"] = time.perf_counter() - t0
        result["pagemill_mode"] = args.mode
        print("pagemill LLM.generate ...", file=sys.stderr)
        pm = run_pagemill(llm, workload, args)
        result["pagemill"] = {k: v for k, v in pm.items() if k != "token_ids"}
        # printed as soon as known: the transformers run can take much longer
        print(f"  pagemill: {pm['output_tokens_per_s']:.1f} output tok/s", file=sys.stderr)
    if not args.skip_transformers:
        print(
            f"transformers generate(), static batches of {args.hf_batch_size} ...", file=sys.stderr
        )
        hf = run_transformers(model_dir, workload, args)
        result["transformers"] = {k: v for k, v in hf.items() if k != "token_ids"}
        print(f"  transformers: {hf['output_tokens_per_s']:.1f} output tok/s", file=sys.stderr)
    if not args.skip_step_table:
        result["step_tables"] = {}
        for mode in (args.modes or args.mode).split(","):
            if llm is None or mode != args.mode:
                llm = None
                t0 = time.perf_counter()
                llm = make_llm(args, model_dir, mode)
                print(f"{mode}: engine ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
            wait_for_kv_prefault(llm)
            costs = model_costs(llm)
            print(
                f"pagemill decode step time vs batch size, {mode} ({costs['weights']}) ...",
                file=sys.stderr,
            )
            dense = DenseLinears(linear_shapes(llm), args.device, served_dtype(args))
            probe = ReadProbe(args.device)
            rows = step_time_table(llm, args, vocab_size, dense, probe)
            del dense, probe
            roof = limits["bf16_gemm_gflop_s"] * 1e9 / costs["flops_per_token"]
            for row in rows:
                read = row.get("read_gb_s", limits["read_gb_s"])
                floor_ms = costs["step_bytes"] / (read * 1e9) * 1e3
                row["floor_ms"] = floor_ms
                row["x_floor"] = row["step_ms"] / floor_ms
                row["roofline_tok_s"] = roof
                row["of_roofline"] = row["tokens_per_s"] / roof
            result["step_tables"][mode] = {**costs, "rows": rows}
            llm = None

    print()
    if pm is not None:
        print(
            f"pagemill      : {pm['output_tokens']:7d} output tokens in {pm['elapsed_s']:8.1f} s "
            f"= {pm['output_tokens_per_s']:8.1f} tok/s"
        )
    if hf is not None:
        print(
            f"transformers  : {hf['output_tokens']:7d} output tokens in {hf['elapsed_s']:8.1f} s "
            f"= {hf['output_tokens_per_s']:8.1f} tok/s  (static batches of {args.hf_batch_size}; "
            f"{hf['generated_incl_padding']} tokens generated incl. batch tails)"
        )
    if pm is not None and hf is not None:
        ratio = pm["output_tokens_per_s"] / hf["output_tokens_per_s"]
        agree = agreement(pm["token_ids"], hf["token_ids"])
        result["ratio"] = ratio
        result["first16_agreement"] = agree
        print(f"ratio pagemill / transformers: {ratio:.2f}x   (target >= 3x)")
        print(f"greedy agreement on the first 16 tokens: {agree:.0%} of requests")
    for mode, table in result.get("step_tables", {}).items():
        rows = table["rows"]
        print(
            f"\npagemill decode step, {mode}: {table['step_bytes'] / 1e6:.0f} MB per small "
            f"step, floor per row from the read rate measured between its rounds; GEMM "
            f"roofline {rows[0]['roofline_tok_s']:.0f} tok/s"
        )
        print(
            f"{'batch':>6} {'step ms':>10} {'read GB/s':>10} {'floor ms':>9} {'x floor':>8} "
            f"{'forward ms':>11} {'host ms':>9} "
            f"{'host':>6} {'tok/s':>10} {'of roof':>8} {'linears ms':>11} {'x lin':>6}"
        )
        for row in rows:
            print(
                f"{row['batch_size']:6d} {row['step_ms']:10.2f} "
                f"{row.get('read_gb_s', float('nan')):10.1f} {row['floor_ms']:9.2f} "
                f"{row['x_floor']:8.2f} "
                f"{row['forward_ms']:11.2f} {row['host_ms']:9.2f} {row['host_share']:6.1%} "
                f"{row['tokens_per_s']:10.1f} {row['of_roofline']:8.1%} "
                f"{row['dense_linears_ms']:11.2f} {row['x_linears']:6.2f}"
            )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
