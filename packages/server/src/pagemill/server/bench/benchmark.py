"""Serving benchmark: load an OpenAI-compatible server and measure what clients feel.

Each request is a streamed completion of a fixed-seed random token-id prompt with a fixed
output length (`ignore_eos`), so every run and every server does the same work. For each
concurrency level the client sends `num_prompts` requests, all at once or as a Poisson
process at `request_rate`, never more than `concurrency` in flight, and records per
request the time to first token (TTFT), the gaps between streamed chunks (ITL) and the
time per output token after the first (TPOT). Figures are printed as a table, written as
JSON and drawn (throughput and latency against concurrency) with matplotlib.

Two server-side figures come with each level when they can be had. The engine's own step
time, read from the server's `pagemill:engine_step_seconds` histogram before and after the
level: the mean ITL a client sees over the mean decode step is the serving overhead per
token (1.0 = none). The CPU time of the server's processes (the one `--launch` started, or
`--server-pid`, and their children, from /proc) over the level's wall time: the cores the
server used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # httpx comes with the [bench] extra; `pagemill --help` must not need it
    import httpx


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


def make_prompts(num: int, input_len: int, low: int, high: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(input_len)] for _ in range(num)]


def level_prompts(
    count: int, warm: int, input_len: int, low: int, high: int, seed: int
) -> tuple[list[list[int]], list[list[int]]]:
    """A level's `count` prompts and `warm` warm-up prompts, drawn apart.

    The warm-up prompts come after the measured ones in the same stream: were they the
    measured prompts themselves, a server with a prefix cache (pagemill's, llama-server's
    slot cache) would serve their prefill from the warm-up's blocks and report a time to
    first token no fresh request sees."""
    drawn = make_prompts(count + warm, input_len, low, high, seed)
    return drawn[:count], drawn[count:]


async def _one_request(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: list[int],
    output_len: int,
    timeout: float,
) -> RequestResult:
    import httpx

    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "min_tokens": output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(ok=False)
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not any(c.get("text") for c in chunk.get("choices", [])):
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
        result.e2e = time.perf_counter() - start
        result.ok = result.output_tokens > 0
        if not result.ok:
            result.error = "no tokens in the response"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "p50": math.nan, "p99": math.nan}
    arr = np.asarray(values) * scale
    return {
        "mean": float(arr.mean()),
        "p50": float(np.percentile(arr, 50)),
        "p99": float(np.percentile(arr, 99)),
    }


async def run_level(
    base_url: str,
    model: str,
    prompts: list[list[int]],
    output_len: int,
    concurrency: int,
    request_rate: float,
    seed: int,
    timeout: float,
    server_pid: int | None = None,
) -> dict[str, Any]:
    """One concurrency level; returns its summary (latencies in ms)."""
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    rng = np.random.default_rng(seed)
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(
        max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4
    )

    async with httpx.AsyncClient(limits=limits) as client:

        async def bounded(prompt: list[int]) -> RequestResult:
            async with sem:
                return await _one_request(client, url, model, prompt, output_len, timeout)

        steps_before = await _scrape_steps(client, base_url)
        cpu_before = cpu_seconds(server_pid)
        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(bounded(prompt)))
            if math.isfinite(request_rate):
                await asyncio.sleep(float(rng.exponential(1.0 / request_rate)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        cpu_after = cpu_seconds(server_pid)
        steps = _step_means(steps_before, await _scrape_steps(client, base_url))

    good = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in good)
    in_tokens = sum(r.prompt_tokens for r in good)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in good if r.output_tokens > 1]
    errors = sorted({r.error for r in results if not r.ok})
    itl = _stats([x for r in good for x in r.itls])
    tpot = _stats(tpots)
    decode_ms = steps.get("decode", {}).get("mean_ms", math.nan)
    return {
        "concurrency": concurrency,
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "num_requests": len(results),
        "completed": len(good),
        "failed": len(results) - len(good),
        "errors": errors[:5],
        "duration_s": duration,
        "request_throughput": len(good) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "ttft_ms": _stats([r.ttft for r in good]),
        "tpot_ms": tpot,
        "itl_ms": itl,
        "e2e_ms": _stats([r.e2e for r in good]),
        "engine_steps": steps,
        "itl_over_decode_step": itl["mean"] / decode_ms if decode_ms > 0 else math.nan,
        # Per token, whether or not it carried text (a token that completes no character
        # sends no chunk, so the next ITL spans two steps): the fairer overhead figure.
        "tpot_over_decode_step": tpot["mean"] / decode_ms if decode_ms > 0 else math.nan,
        "server_cpu": _cores_used(cpu_before, cpu_after, duration) if server_pid else None,
    }


def format_table(levels: list[dict[str, Any]]) -> str:
    head = (
        f"{'conc':>5} {'ok':>5} {'req/s':>7} {'out tok/s':>10} "
        f"{'TTFT mean/p50/p99 ms':>24} {'TPOT mean/p50/p99 ms':>24} {'ITL mean/p50/p99 ms':>24} "
        f"{'step ms':>8} {'ITL/step':>8} {'cores':>6}"
    )
    rows = [head, "-" * len(head)]

    def three(d: dict[str, float]) -> str:
        return f"{d['mean']:.1f}/{d['p50']:.1f}/{d['p99']:.1f}"

    for lv in levels:
        decode = lv.get("engine_steps", {}).get("decode", {}).get("mean_ms", math.nan)
        cores = (lv.get("server_cpu") or {}).get("cores", math.nan)
        rows.append(
            f"{lv['concurrency']:>5} {lv['completed']:>5} {lv['request_throughput']:>7.2f} "
            f"{lv['output_throughput']:>10.1f} {three(lv['ttft_ms']):>24} "
            f"{three(lv['tpot_ms']):>24} {three(lv['itl_ms']):>24} "
            f"{decode:>8.1f} {lv.get('itl_over_decode_step', math.nan):>8.2f} "
            f"{cores:>6.2f}"
        )
    return "\n".join(rows)


def plot(levels: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conc = [lv["concurrency"] for lv in levels]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.plot(conc, [lv["output_throughput"] for lv in levels], "o-", label="output tokens/s")
    ax1b = ax1.twinx()
    ax1b.plot(
        conc,
        [lv["request_throughput"] for lv in levels],
        "s--",
        color="tab:orange",
        label="requests/s",
    )
    ax1.set_xlabel("concurrency")
    ax1.set_ylabel("output tokens/s")
    ax1b.set_ylabel("requests/s")
    ax1.set_title("throughput")
    for key, label, style in (
        ("ttft_ms", "TTFT p50", "o-"),
        ("ttft_ms", "TTFT p99", "o:"),
        ("tpot_ms", "TPOT mean", "s-"),
        ("itl_ms", "ITL p50", "^-"),
        ("itl_ms", "ITL p99", "^:"),
    ):
        stat = "p99" if "p99" in label else ("mean" if "mean" in label else "p50")
        ax2.plot(conc, [lv[key][stat] for lv in levels], style, label=label)
    ax2.set_xlabel("concurrency")
    ax2.set_ylabel("ms")
    ax2.set_yscale("log")
    ax2.set_title("latency")
    ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.grid(alpha=0.3)
    h1, l1 = ax1.get_legend_handles_labels()
    h2, l2 = ax1b.get_legend_handles_labels()
    ax1.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- server-side figures


def _step_totals(text: str) -> dict[str, tuple[float, float]]:
    """{phase: (sum seconds, count)} of `pagemill:engine_step_seconds` in a /metrics text."""
    totals: dict[str, list[float]] = {}
    for line in text.splitlines():
        if not line.startswith("pagemill:engine_step_seconds_"):
            continue
        name, _, value = line.rpartition(" ")
        kind = name[len("pagemill:engine_step_seconds_") :].split("{", 1)[0]
        if kind not in ("sum", "count"):
            continue
        phase = name.split('phase="', 1)[1].split('"', 1)[0] if 'phase="' in name else "all"
        entry = totals.setdefault(phase, [0.0, 0.0])
        entry[0 if kind == "sum" else 1] += float(value)
    return {k: (v[0], v[1]) for k, v in totals.items()}


async def _scrape_steps(client: httpx.AsyncClient, base_url: str) -> dict[str, tuple[float, float]]:
    import httpx

    try:
        resp = await client.get(base_url.rstrip("/") + "/metrics", timeout=30)
        return _step_totals(resp.text) if resp.status_code == 200 else {}
    except httpx.HTTPError:
        return {}


def _step_means(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, Any]:
    """Mean step time (ms) and step count per phase over a level, from two scrapes."""
    out: dict[str, Any] = {}
    for phase, (s1, c1) in after.items():
        s0, c0 = before.get(phase, (0.0, 0.0))
        n = c1 - c0
        out[phase] = {"steps": int(n), "mean_ms": (s1 - s0) / n * 1000.0 if n > 0 else math.nan}
    return out


def _proc_tree(pid: int) -> list[int]:
    """`pid` and its descendants (Linux /proc; empty elsewhere or once it is gone)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree if os.path.exists(f"/proc/{pid}") else []


def cpu_seconds(pid: int | None) -> dict[int, float]:
    """User + system CPU seconds of `pid` and each live descendant, by pid."""
    if pid is None:
        return {}
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out = {}
    for p in _proc_tree(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        # After the command name: state is field 3, utime 14 and stime 15 (1-based).
        out[p] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def _cores_used(
    before: dict[int, float], after: dict[int, float], seconds: float
) -> dict[str, Any]:
    per_proc = {p: after[p] - before.get(p, 0.0) for p in after}
    return {
        "cores": sum(per_proc.values()) / seconds if seconds > 0 else math.nan,
        "per_process": {str(p): v / seconds for p, v in sorted(per_proc.items())},
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_server(serve_args: list[str], timeout: float) -> tuple[subprocess.Popen[bytes], str]:
    """Start `pagemill serve` in a child process on a free loopback port; wait for /health."""
    import httpx

    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "pagemill.server.cli",
        "serve",
        *serve_args,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"the server did not become healthy within {timeout:.0f}s")


async def _run_all(
    args: argparse.Namespace, base_url: str, server_pid: int | None = None
) -> list[dict[str, Any]]:
    import httpx

    async with httpx.AsyncClient() as client:
        models = (await client.get(base_url + "/v1/models", timeout=30)).json()["data"]
    model = args.model or models[0]["id"]
    levels = []
    counts = (
        args.num_prompts * len(args.concurrency) if len(args.num_prompts) == 1 else args.num_prompts
    )
    if len(counts) != len(args.concurrency):
        raise ValueError("--num-prompts takes one count, or one per concurrency level")
    for i, (conc, count) in enumerate(zip(args.concurrency, counts)):
        prompts, warm = level_prompts(
            count,
            min(conc, count) if args.warmup else 0,
            args.input_len,
            args.token_low,
            args.token_high,
            args.seed + i,
        )
        if warm:
            await run_level(
                base_url,
                model,
                warm,
                4,
                conc,
                math.inf,
                args.seed,
                args.timeout,
            )
        level = await run_level(
            base_url,
            model,
            prompts,
            args.output_len,
            conc,
            args.request_rate,
            args.seed + i,
            args.timeout,
            server_pid,
        )
        cores = (level["server_cpu"] or {}).get("cores", math.nan)
        print(
            f"concurrency {conc}: {level['completed']}/{level['num_requests']} ok, "
            f"{level['output_throughput']:.1f} output tok/s, ITL/decode step "
            f"{level['itl_over_decode_step']:.2f} (TPOT/step "
            f"{level['tpot_over_decode_step']:.2f}), server cores {cores:.2f}",
            flush=True,
        )
        levels.append(level)
    return levels


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    def int_list(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected e.g. 1,4,16,64, got {text!r}") from None
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"concurrencies must be >= 1, got {text!r}")
        return values

    p.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="the server to load (default http://127.0.0.1:8000)",
    )
    p.add_argument(
        "--launch",
        nargs=argparse.REMAINDER,
        default=None,
        metavar="SERVE_ARGS",
        help="start `pagemill serve SERVE_ARGS...` on a free port first (must be last)",
    )
    p.add_argument(
        "--server-pid",
        type=int,
        default=None,
        help="measure the CPU use of this process and its children (default: the "
        "launched server's, if --launch)",
    )
    p.add_argument("--model", default=None, help="model name to request (default: the server's)")
    p.add_argument(
        "--concurrency",
        type=int_list,
        default=[1, 4, 16, 64],
        help="comma-separated concurrency levels (default 1,4,16,64)",
    )
    p.add_argument(
        "--num-prompts",
        type=int_list,
        default=[64],
        help="requests per level: one count, or one per level (default 64)",
    )
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (default 64)")
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrival rate in requests/s (default inf: all at once)",
    )
    p.add_argument("--token-low", type=int, default=100, help="smallest random prompt token id")
    p.add_argument("--token-high", type=int, default=10000, help="largest random token id + 1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="skip the short warm-up requests before each level",
    )
    p.add_argument("--out-dir", default="benchmarks/out", help="where JSON and PNG go")
    p.add_argument("--tag", default="serve", help="file name stem for the results")


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("httpx") is None:
        print("pagemill bench serve needs httpx: install pagemill-server[bench]", file=sys.stderr)
        return 2
    proc = None
    base_url = args.base_url
    if args.launch is not None:
        proc, base_url = launch_server(list(args.launch), timeout=600)
    server_pid = args.server_pid if args.server_pid is not None else (proc.pid if proc else None)
    try:
        levels = asyncio.run(_run_all(args, base_url, server_pid))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k != "func"}
    config["request_rate"] = args.request_rate if math.isfinite(args.request_rate) else "inf"
    config["base_url"] = base_url
    meta = {
        "config": config,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "host_cpus": os.cpu_count(),
    }
    json_path = out_dir / f"{args.tag}.json"
    json_path.write_text(json.dumps({**meta, "levels": levels}, indent=2, default=str))
    png_path = out_dir / f"{args.tag}.png"
    plot(levels, png_path, f"pagemill serve: {args.input_len} in / {args.output_len} out tokens")
    print(format_table(levels))
    print(f"wrote {json_path} and {png_path}")
    return 0 if all(lv["failed"] == 0 for lv in levels) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="benchmarks/serve.py", description=__doc__.split("\n\n")[0]
    )
    add_bench_serve_args(parser)
    return cmd_bench_serve(parser.parse_args(argv))


__all__ = [
    "RequestResult",
    "add_bench_serve_args",
    "cmd_bench_serve",
    "main",
    "make_prompts",
    "run_level",
]
