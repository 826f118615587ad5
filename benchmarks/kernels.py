"""Paged-attention throughput: achieved memory bandwidth and TFLOP/s next to the device's peak.

    python benchmarks/kernels.py         # CUDA: Triton kernel, Llama-3.1-8B heads (32/8/128, bf16)
    python benchmarks/kernels.py --cpu   # torch path, SmolLM2 heads (9/3/64), CPU-sized batches
    python benchmarks/kernels.py --cases decode,prefill --json out.json

Decode is memory-bound (every step reads each request's whole K/V once), so its figure of
merit is GB/s against the memory bandwidth — measured in the same run as the read+write
bytes/s of a large device-to-device copy (%copy), and against the spec sheet (%bw);
prefill is compute-bound, so TFLOP/s against the dense bf16 peak. Bytes count K/V actually
attended plus q and out; FLOPs count the two matmuls (4 * H * D per query-key pair) over the
causal pairs only. A dtype name ending in ``-kvfp8`` (``bf16-kvfp8``) keeps q in that dtype
and stores K/V in float8 e4m3 (``--kv-cache-dtype fp8``): half the K/V bytes per step;
``-kvint8`` stores them as int8 codes with per-tensor scales (``--kv-cache-dtype int8``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# (substring of the device name, memory bandwidth B/s, dense bf16 FLOP/s)
GPU_PEAKS = [
    ("H200", 4.8e12, 989e12),
    ("H100 NVL", 3.9e12, 835e12),
    ("H100 PCIe", 2.0e12, 756e12),
    ("H100", 3.35e12, 989e12),
    ("A100", 2.0e12, 312e12),
    ("L40S", 0.864e12, 362e12),
    ("4090", 1.0e12, 165e12),
]


@dataclass
class Case:
    name: str
    q_lens: list[int]
    ctx_lens: list[int]


def build(
    case: Case,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
):
    """A batch whose blocks are shuffled over the pool, as after a while of serving."""
    g = torch.Generator().manual_seed(seed)
    nblocks = [-(-c // block_size) for c in case.ctx_lens]
    pool = sum(nblocks)
    perm = torch.randperm(pool, generator=g)
    tables = torch.zeros(len(nblocks), max(nblocks), dtype=torch.int32)
    used = 0
    for s, n in enumerate(nblocks):
        tables[s, :n] = perm[used : used + n]
        used += n
    shape = (pool, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    q = torch.randn(sum(case.q_lens), heads, head_dim, dtype=dtype, device=device)
    qsl = torch.zeros(len(case.q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(case.q_lens).cumsum(0)
    seq_lens = torch.tensor(case.ctx_lens, dtype=torch.int32)
    return q, k_cache, v_cache, tables.to(device), qsl.to(device), seq_lens.to(device)


def work(
    case: Case, heads: int, kv_heads: int, head_dim: int, elem: int, kv_elem: int | None = None
) -> tuple[float, float]:
    """(bytes moved, flops) of one call: K/V read once per request, causal pairs only."""
    kv_bytes = 2 * sum(case.ctx_lens) * kv_heads * head_dim * (kv_elem or elem)
    qo_bytes = 2 * sum(case.q_lens) * heads * head_dim * elem
    pairs = sum(ql * (c - ql) + ql * (ql + 1) // 2 for ql, c in zip(case.q_lens, case.ctx_lens))
    return kv_bytes + qo_bytes, 4.0 * pairs * heads * head_dim


def time_cuda(fn: Callable[[], object], iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def time_cpu(fn: Callable[[], object], iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def cpu_copy_bandwidth() -> float:
    """A measured roofline for the CPU: read+write bytes/s of a large tensor copy."""
    src = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src).fill_(0)
    secs = time_cpu(lambda: dst.copy_(src), 5)
    return 2 * src.numel() / secs


def gpu_copy_bandwidth(nbytes: int = 1 << 30, iters: int = 20) -> float:
    """A measured roofline for the GPU: read+write bytes/s of a device-to-device copy of
    `nbytes` (1 GiB: far beyond L2), timed with CUDA events like the kernels."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    secs = time_cuda(lambda: dst.copy_(src), iters)
    return 2 * nbytes / secs


def gpu_peaks(name: str) -> tuple[float | None, float | None]:
    for key, bw, flops in GPU_PEAKS:
        if key in name:
            return bw, flops
    return None, None


def fmt(x: float | None, scale: float, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x / scale:.{digits}f}"


def run(
    cpu: bool,
    dtype_names: list[str] | None = None,
    iters: int | None = None,
    only: str | None = None,
    threads: int | None = None,
) -> dict:
    """Time every case; returns the setup and one row per (dtype, case) as plain data."""
    if cpu and threads:
        torch.set_num_threads(threads)
    if cpu:
        # Without a GPU the Triton kernels only run in the interpreter: far too slow to time.
        os.environ.pop("TRITON_INTERPRET", None)
    from pagemill.kernels import paged_attention_torch, paged_attention_triton

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    copy_bw = None
    if cpu:
        heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
        device, fn, timer = "cpu", paged_attention_torch, time_cpu
        names = dtype_names or ["bf16", "fp32"]
        iters = iters or 5
        cases = [
            Case(f"decode {n} x {c}", [1] * n, [c] * n)
            for n, c in ((1, 1000), (16, 500), (64, 300), (64, 1000), (256, 100), (256, 1000))
        ]
        cases.append(Case("prefill 4 x 512", [512] * 4, [512] * 4))
        cases.append(Case("mixed 32 dec x 600 + 256 pf", [1] * 32 + [256], [600] * 32 + [256]))
        bw_peak, flop_peak = cpu_copy_bandwidth(), None
        copy_bw = bw_peak
        label = f"CPU torch path, {torch.get_num_threads()} thread(s)"
    else:
        heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
        device, fn, timer = "cuda", paged_attention_triton, time_cuda
        names = dtype_names or ["bf16"]
        iters = iters or 20
        cases = [
            Case("decode 64 x 4096", [1] * 64, [4096] * 64),
            Case("decode 256 x 1024", [1] * 256, [1024] * 256),
            Case("prefill 4 x 4096", [4096] * 4, [4096] * 4),
            Case("prefill 2k on 2k prefix x 4", [2048] * 4, [4096] * 4),
            Case("mixed 64 dec x 4096 + 2048 pf", [1] * 64 + [2048], [4096] * 64 + [2048]),
        ]
        gpu_name = torch.cuda.get_device_name()
        bw_peak, flop_peak = gpu_peaks(gpu_name)
        copy_bw = gpu_copy_bandwidth()
        label = f"{gpu_name}, Triton kernel"
    if only:
        cases = [c for c in cases if any(key.strip() in c.name for key in only.split(","))]
    report: dict = {
        "label": label,
        "device": device,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "block_size": block_size,
        "iters": iters,
        "spec_bandwidth": None if cpu else bw_peak,
        "spec_bf16_flops": flop_peak,
        "copy_bandwidth": copy_bw,
        "rows": [],
        "checks": [],
    }
    for dname in names:
        kv_fp8 = dname.endswith("-kvfp8")
        kv_int8 = dname.endswith("-kvint8")
        dtype = dtypes[dname.removesuffix("-kvfp8").removesuffix("-kvint8")]
        for case in cases:
            batch = build(case, heads, kv_heads, head_dim, block_size, dtype, device)
            kw: dict = {}
            if kv_fp8:
                q_, kc_, vc_, *meta = batch
                batch = (q_, kc_.to(torch.float8_e4m3fn), vc_.to(torch.float8_e4m3fn), *meta)
            if kv_int8:
                q_, kc_, vc_, *meta = batch
                ks = kc_.abs().amax().float() / 127
                vs = vc_.abs().amax().float() / 127
                kc8 = torch.round(kc_.float() / ks).to(torch.int8)
                vc8 = torch.round(vc_.float() / vs).to(torch.int8)
                batch = (q_, kc8, vc8, *meta)
                kw = {"k_scale": ks, "v_scale": vs}
            scale = head_dim**-0.5
            if not cpu and case is cases[0]:
                ref = paged_attention_torch(*batch, scale, **kw)
                got = fn(*batch, scale, **kw)
                err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                report["checks"].append({"dtype": dname, "case": case.name, "rel_err": err})
            out = torch.empty_like(batch[0])
            secs = timer(lambda b=batch, o=out, s=scale, kw=kw: fn(*b, s, out=o, **kw), iters)
            nbytes, flops = work(
                case, heads, kv_heads, head_dim, batch[0].element_size(), batch[1].element_size()
            )
            report["rows"].append(
                {
                    "case": case.name,
                    "dtype": dname,
                    "ms": secs * 1e3,
                    "gb_per_s": nbytes / secs / 1e9,
                    "tflop_per_s": flops / secs / 1e12,
                    "of_copy": nbytes / secs / copy_bw if copy_bw else None,
                    "of_spec_bw": None if cpu or bw_peak is None else nbytes / secs / bw_peak,
                    "of_spec_flops": None if flop_peak is None else flops / secs / flop_peak,
                    "decode": all(q == 1 for q in case.q_lens),
                }
            )
            del batch, out
    return report


def print_report(report: dict) -> None:
    cpu = report["device"] == "cpu"
    print(
        f"# {report['label']}; heads {report['heads']}/{report['kv_heads']}, head_dim "
        f"{report['head_dim']}, block {report['block_size']}"
    )
    print(
        f"# copy: {fmt(report['copy_bandwidth'], 1e9)} GB/s measured (read + write); spec: "
        f"{fmt(report['spec_bandwidth'], 1e9)} GB/s, {fmt(report['spec_bf16_flops'], 1e12, 0)} "
        "TFLOP/s dense bf16"
    )
    for check in report["checks"]:
        print(
            f"# check vs torch path ({check['dtype']}, {check['case']}): relative error "
            f"{check['rel_err']:.2e}"
        )
    header = (
        f"{'case':34s} {'dtype':5s} {'ms':>9s} {'GB/s':>9s} {'%copy':>6s} {'%bw':>6s} "
        f"{'TFLOP/s':>9s} {'%flop':>6s}"
    )
    print(header)
    print("-" * len(header))

    def pct(x: float | None) -> str:
        return "" if x is None else f"{100 * x:5.1f}%"

    for r in report["rows"]:
        tflops = f"{r['tflop_per_s']:9.3f}" if cpu else f"{r['tflop_per_s']:9.1f}"
        print(
            f"{r['case']:34s} {r['dtype']:5s} {r['ms']:9.3f} {r['gb_per_s']:9.2f} "
            f"{pct(r['of_copy']):>6s} {pct(r['of_spec_bw']):>6s} {tflops} "
            f"{pct(r['of_spec_flops']):>6s}"
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--cpu", action="store_true", help="time the torch path on CPU with small shapes"
    )
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument(
        "--threads", type=int, default=None, help="CPU threads (default: torch's choice)"
    )
    ap.add_argument("--dtypes", default=None, help="comma list, e.g. bf16,fp32")
    ap.add_argument("--cases", default=None, help="comma list of substrings of case names")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args(argv)
    cpu = args.cpu or not torch.cuda.is_available()
    report = run(
        cpu, args.dtypes.split(",") if args.dtypes else None, args.iters, args.cases, args.threads
    )
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
