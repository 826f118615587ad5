"""Mixture-of-experts decode: pagemill's fused sparse block against transformers' eager one.

    python benchmarks/moe.py                        # CPU, Qwen3-30B-A3B shapes, 2 layers, bf16
    python benchmarks/moe.py --device cuda --layers 4 --json out.json
    python benchmarks/moe.py --int4 --batch-sizes 1,16  # CPU: packed int4 experts vs dense bf16

A stack of ``--layers`` sparse blocks with Qwen3-30B-A3B's per-layer shapes (hidden 2048,
128 experts, top-8, expert intermediate 768; random weights, shared between the two
implementations so memory holds one copy), run as a decode step's MLP half: x -> x +
block(x) per layer, at each batch size. Attention is not in the stack — it is the dense
models' and measured by `benchmarks/kernels.py`. transformers' block is the reference
(``experts_implementation="eager"``: a Python loop over the experts hit); pagemill's is
`SparseMoeBlock` (sorted-by-expert torch path on CPU, the Triton grouped GEMM on CUDA).

Bytes: a step must read at least the weights of every expert some token picked (each once)
plus the router; ``floor MB/token`` is that over the batch. ``GB/s`` is floor bytes over the
measured step time — the bandwidth a step would need to run that fast reading only the
floor, to set next to the machine's.

``--int4`` (CPU) times instead the same stack with its experts packed as a GGUF Q4_0-like
file's are served (`FusedMoE`'s packed path: int4 groups of 32 with a bf16 scale and zero,
PyTorch's int4 CPU kernel per expert) against the dense bf16 experts it was quantized from,
in the same run; ``held MB`` is the experts' resident bytes, ``read MB/tok`` the floor
(every picked expert's bytes once, plus the router) over the batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SHAPES = dict(hidden=2048, experts=128, top_k=8, inter=768)


def build(layers: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from pagemill.runtime.model_executor.layers.fused_moe import SparseMoeBlock
    from pagemill.runtime.moe_config import MoeSpec

    h, e, k, i = SHAPES["hidden"], SHAPES["experts"], SHAPES["top_k"], SHAPES["inter"]
    config = transformers.Qwen3MoeConfig(
        hidden_size=h,
        num_experts=e,
        num_experts_per_tok=k,
        moe_intermediate_size=i,
        norm_topk_prob=True,
        experts_implementation="eager",
    )
    spec = MoeSpec(e, k, i, True, 0, (True,))
    gen = torch.Generator(device=device).manual_seed(seed)
    ours, theirs = [], []
    with torch.device(device):
        for _ in range(layers):
            block = SparseMoeBlock(spec, h, dtype)
            with torch.no_grad():
                block.gate.normal_(0, 0.02, generator=gen)
                block.experts.w13_weight.normal_(0, 0.02, generator=gen)
                block.experts.w2_weight.normal_(0, 0.02, generator=gen)
            ref = Qwen3MoeSparseMoeBlock(config).to(device=device, dtype=dtype)
            # One copy of the weights: transformers' stacked layout is ours.
            ref.gate.weight = block.gate
            ref.experts.gate_up_proj = block.experts.w13_weight
            ref.experts.down_proj = block.experts.w2_weight
            ours.append(block)
            theirs.append(ref.eval())
    return ours, theirs


def step(blocks, x: torch.Tensor, hf: bool) -> torch.Tensor:
    for b in blocks:
        x = x + (b(x[None])[0] if hf else b(x))
    return x


def floor_bytes(blocks, x: torch.Tensor) -> int:
    from pagemill.kernels import topk_softmax

    h, e, k, i = SHAPES["hidden"], SHAPES["experts"], SHAPES["top_k"], SHAPES["inter"]
    size = x.element_size()
    total = 0
    for b in blocks:
        _, ids = topk_softmax(torch.nn.functional.linear(x, b.gate), k, True)
        total += ids.unique().numel() * 3 * h * i * size + e * h * size
        x = x + b(x)
    return total


def timed(fn, device: torch.device, iters: int, warmup: int) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(device: str, layers: int, batch_sizes: list[int], iters: int, dtype: str) -> dict:
    dev = torch.device(device)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    ours, theirs = build(layers, dt, dev)
    rows = []
    for bs in batch_sizes:
        x = torch.randn(bs, SHAPES["hidden"], device=dev, generator=None).to(dt) * 0.5
        with torch.inference_mode():
            a, b = step(ours, x, False), step(theirs, x, True)
            err = ((a.float() - b.float()).norm() / b.float().norm()).item()
            t_ours = timed(lambda x=x: step(ours, x, False), dev, iters, 2)
            t_hf = timed(lambda x=x: step(theirs, x, True), dev, iters, 2)
            floor = floor_bytes(ours, x)
        rows.append(
            {
                "batch": bs,
                "pagemill_ms": t_ours * 1e3,
                "transformers_ms": t_hf * 1e3,
                "speedup": t_hf / t_ours,
                "floor_mb_per_token": floor / bs / 1e6,
                "pagemill_gb_per_s": floor / t_ours / 1e9,
                "transformers_gb_per_s": floor / t_hf / 1e9,
                "rel_err": err,
            }
        )
    return {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "dtype": dtype,
        "layers": layers,
        "shapes": SHAPES,
        "rows": rows,
    }


def packed_copy(blocks, dtype: torch.dtype):
    """The blocks again, their experts quantized to int4 groups of 32 and packed."""
    from pagemill.runtime.model_executor.layers.fused_moe import SparseMoeBlock
    from pagemill.runtime.model_executor.quantization.formats import quantize_int4_groups
    from pagemill.runtime.moe_config import MoeSpec

    h, e, k, i = SHAPES["hidden"], SHAPES["experts"], SHAPES["top_k"], SHAPES["inter"]
    out = []
    for b in blocks:
        p = SparseMoeBlock(MoeSpec(e, k, i, True, 0, (True,)), h, dtype)
        p.gate = b.gate
        p.experts.plan_packing("native", torch.bfloat16)
        with torch.no_grad():
            for j in range(e):
                p.experts.load_expert_rows(
                    j, 13, 0, quantize_int4_groups(b.experts.w13_weight[j], 32, dtype)
                )
                p.experts.load_expert_rows(
                    j, 2, 0, quantize_int4_groups(b.experts.w2_weight[j], 32, dtype)
                )
        assert p.experts.packed
        out.append(p)
    return out


def expert_bytes(block) -> int:
    x = block.experts
    if x.packed:
        return x.packed_nbytes()
    return sum(t.numel() * t.element_size() for t in (x.w13_weight, x.w2_weight))


def read_bytes(blocks, x: torch.Tensor) -> int:
    """Bytes a step must read: each picked expert's share of its layer's bytes, plus the router."""
    from pagemill.kernels import topk_softmax

    e, k = SHAPES["experts"], SHAPES["top_k"]
    total = 0
    for b in blocks:
        _, ids = topk_softmax(torch.nn.functional.linear(x, b.gate), k, True)
        total += ids.unique().numel() * expert_bytes(b) // e + b.gate.numel() * 2
        x = x + b(x)
    return total


def timed_pair(fa, fb, iters: int) -> tuple[float, float]:
    """Best of `iters` for each, the two alternated: on a shared CPU the other loads come and
    go, and alternating with the minimum keeps them from landing on one side only."""
    fa(), fb()
    ta, tb = [], []
    for _ in range(iters):
        for fn, times in ((fa, ta), (fb, tb)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return min(ta), min(tb)


def run_int4(layers: int, batch_sizes: list[int], iters: int) -> dict:
    dev, dt = torch.device("cpu"), torch.bfloat16
    dense, _ = build(layers, dt, dev)
    packed = packed_copy(dense, dt)
    rows = []
    for bs in batch_sizes:
        x = torch.randn(bs, SHAPES["hidden"]).to(dt) * 0.5
        with torch.inference_mode():
            a, b = step(packed, x, False), step(dense, x, False)
            err = ((a.float() - b.float()).norm() / b.float().norm()).item()
            t_packed, t_dense = timed_pair(
                lambda x=x: step(packed, x, False), lambda x=x: step(dense, x, False), iters
            )
            r_packed, r_dense = read_bytes(packed, x), read_bytes(dense, x)
        rows.append(
            {
                "batch": bs,
                "dense_ms": t_dense * 1e3,
                "int4_ms": t_packed * 1e3,
                "speedup": t_dense / t_packed,
                "dense_read_mb_per_token": r_dense / bs / 1e6,
                "int4_read_mb_per_token": r_packed / bs / 1e6,
                "rel_err_vs_dense": err,
            }
        )
    return {
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "mode": "int4 vs dense bf16",
        "layers": layers,
        "shapes": SHAPES,
        "dense_held_mb": sum(expert_bytes(b) for b in dense) / 1e6,
        "int4_held_mb": sum(expert_bytes(b) for b in packed) / 1e6,
        "rows": rows,
    }


def print_int4_report(report: dict) -> None:
    print(
        f"cpu ({report['threads']} threads), {report['layers']} layers of {report['shapes']}: "
        f"experts held {report['dense_held_mb']:.0f} MB bf16, {report['int4_held_mb']:.0f} MB int4"
    )
    print(" batch  dense ms  int4 ms  speedup  read MB/tok dense  int4  rel err")
    for r in report["rows"]:
        print(
            f"{r['batch']:6d} {r['dense_ms']:9.2f} {r['int4_ms']:8.2f} {r['speedup']:8.2f} "
            f"{r['dense_read_mb_per_token']:18.2f} {r['int4_read_mb_per_token']:5.2f} "
            f"{r['rel_err_vs_dense']:8.1e}"
        )


def print_report(report: dict) -> None:
    print(f"{report['device']} {report['dtype']}, {report['layers']} layers of {report['shapes']}")
    print(
        " batch  pagemill ms  transformers ms  speedup  floor MB/tok  GB/s ours  GB/s HF  rel err"
    )
    for r in report["rows"]:
        print(
            f"{r['batch']:6d} {r['pagemill_ms']:12.2f} {r['transformers_ms']:16.2f} "
            f"{r['speedup']:8.2f} {r['floor_mb_per_token']:13.2f} {r['pagemill_gb_per_s']:10.1f} "
            f"{r['transformers_gb_per_s']:8.1f} {r['rel_err']:8.1e}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--int4", action="store_true", help="packed int4 experts vs dense bf16 (CPU)")
    args = ap.parse_args()
    if args.int4:
        if args.device != "cpu" or args.dtype != "bf16":
            ap.error("--int4 runs on --device cpu in --dtype bf16 (the packed CPU kernel)")
        report = run_int4(args.layers, [int(b) for b in args.batch_sizes.split(",")], args.iters)
        print_int4_report(report)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
        return
    report = run(
        args.device,
        args.layers,
        [int(b) for b in args.batch_sizes.split(",")],
        args.iters,
        args.dtype,
    )
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
