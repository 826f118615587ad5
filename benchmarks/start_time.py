"""Start-up time of `pagemill serve`: one cold start in a fresh cache folder, then warm ones.

Each start is a fresh server process (`python -m pagemill.server.cli serve ...`, what
`uv run pagemill serve` runs, without uv's own sync check), timed from launch until
`/health` answers 200, then a one-token chat request (`first_request_s`: what the start
left to the first request); then it is stopped. Reported per start: wall seconds, the CPU
seconds the server used (user + system, from its rusage once it has exited) and when each
phase's log line appeared (seconds after launch), so a slow start says where its time went.
A cold start that compiles in the background (healthy first, serving eagerly) is kept
running until its compile ends: `compiled_s` is when the compiled forward was ready.
Wall time on a shared machine measures the load as much as the start: read the CPU column
there.

    python benchmarks/start_time.py                       # 1 cold + 3 warm, default model
    python benchmarks/start_time.py --warm 5 --json out.json
    python benchmarks/start_time.py --cache-dir ~/.cache/pagemill --cold 0   # warm only
    python benchmarks/start_time.py -- --max-num-seqs 64  # flags after -- go to serve
    # A/B: warm starts of another checkout (git worktree add /tmp/base main) and of this
    # one, alternated in one run, with per-phase medians and paired ratios:
    python benchmarks/start_time.py --cold 0 --warm 5 --cache-dir DIR --baseline /tmp/base
    # the same for cold starts (each side in a fresh cache folder per round):
    python benchmarks/start_time.py --cold 2 --warm 0 --baseline /tmp/base

Figures are printed (and written to --json, with every log line's time); nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

# (phase, pattern of the first log line that ends it)
PHASES = [
    ("api process", re.compile(r"pagemill: loading ")),
    ("core torch", re.compile(r"torch threads")),
    ("model folder", re.compile(r"loading \S+ \(")),
    ("weights", re.compile(r"loaded \S+ \(")),
    ("kv pool", re.compile(r"KV|kv cache|blocks", re.IGNORECASE)),
    ("compiled", re.compile(r"compil", re.IGNORECASE)),
    ("serving", re.compile(r"Uvicorn running|Application startup complete|listening")),
]

# A cold start serving eagerly while it compiles, and the end of that compile (or failure).
BACKGROUND = re.compile(r"compiles in the background")
BACKGROUND_DONE = re.compile(r"in the background in |background compile failed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _first_request(port: int) -> float:
    """Seconds a one-token chat completion takes, sent as soon as the server is healthy:
    what a start left to the first request (the second takes ~0.1 s)."""
    base = f"http://127.0.0.1:{port}"
    with urllib.request.urlopen(f"{base}/v1/models", timeout=60) as r:
        model = json.load(r)["data"][0]["id"]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 1,
        "temperature": 0,
    }
    req = urllib.request.Request(
        f"{base}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()
    return time.perf_counter() - t


def _tree_cpu(root: int) -> float | None:
    """CPU seconds (user + system) used so far by `root` and every live process under it
    (Linux /proc; None elsewhere): what a start cost up to now, whatever the load."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        parent[int(name)] = int(fields[1])
        cpu[int(name)] = (int(fields[11]) + int(fields[12])) / tick
    if root not in cpu:
        return None
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0.0)
        todo += [child for child, ppid in parent.items() if ppid == pid]
    return total


def _source_env(src_root: Path | None) -> dict[str, str]:
    """The environment that runs another checkout's packages (its packages/*/src first on
    the path: pagemill is a namespace package, its parts found in path order)."""
    if src_root is None:
        return {}
    paths = sorted(str(p) for p in (src_root / "packages").glob("*/src"))
    if not paths:
        raise SystemExit(f"--baseline {src_root}: no packages/*/src there")
    old = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join(paths + ([old] if old else []))}


def one_start(
    cache_dir: Path, serve_args: list[str], timeout: float, src_root: Path | None = None
) -> dict[str, Any]:
    port = _free_port()
    env = dict(os.environ, PAGEMILL_CACHE_DIR=str(cache_dir), **_source_env(src_root))
    cmd = [sys.executable, "-m", "pagemill.server.cli", "serve", "--port", str(port)]
    cmd += serve_args
    lines: list[tuple[float, str]] = []
    t0 = time.perf_counter()
    before = os.times()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.perf_counter() - t0, line.rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    wall = cpu_healthy = first = None
    while time.perf_counter() - t0 < timeout and proc.poll() is None:
        if _healthy(port):
            wall = time.perf_counter() - t0
            cpu_healthy = _tree_cpu(proc.pid)
            first = _first_request(port)
            break
        time.sleep(0.05)
    compiled = None
    if wall is not None and any(BACKGROUND.search(line) for _, line in list(lines)):
        while compiled is None and time.perf_counter() - t0 < timeout and proc.poll() is None:
            done = [t for t, line in list(lines) if BACKGROUND_DONE.search(line)]
            compiled = done[0] if done else None
            time.sleep(0.2)
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    reader.join(timeout=5)
    after = os.times()
    cpu = (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )
    phases: dict[str, float] = {}
    for name, pattern in PHASES:
        for t, line in lines:
            if pattern.search(line):
                phases[name] = round(t, 2)
                break
    if wall is None:
        tail = "\n".join(line for _, line in lines[-20:])
        raise RuntimeError(f"the server did not become healthy (rc {proc.returncode}):\n{tail}")
    log = [[round(t, 2), line] for t, line in lines]  # every line, when it came (--json)
    return {
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        # The server's and its children's CPU seconds when /health first answered.
        "cpu_healthy_s": None if cpu_healthy is None else round(cpu_healthy, 2),
        # The first request's latency (one token, sent once healthy).
        "first_request_s": None if first is None else round(first, 3),
        # A background compile's end (None: compiled before healthy, or not at all).
        "compiled_s": None if compiled is None else round(compiled, 2),
        "phases": phases,
        "log": log,
    }


def _median(values: list[float]) -> float:
    values = sorted(values)
    n = len(values)
    return values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2


def _print_ab(starts: list[dict[str, Any]], base_kind: str, new_kind: str) -> None:
    """Per phase: the baseline's and this tree's medians, and the median of the ratios of
    the starts of the same round (new / baseline), which the load shifts less."""
    base = [r for r in starts if r["kind"] == base_kind]
    new = [r for r in starts if r["kind"] == new_kind]

    def value(r: dict[str, Any], name: str) -> float | None:
        return r[name] if name in r else r["phases"].get(name)

    names = ["wall_s", "first_request_s", "cpu_healthy_s", "compiled_s"]
    names += [name for name, _ in PHASES]
    print(f"{'':16} {'baseline':>9} {'this':>9} {'paired ratio':>13}")
    for name in names:
        pairs = [(value(b, name), value(n, name)) for b, n in zip(base, new)]
        pairs = [(b, n) for b, n in pairs if b is not None and n is not None]
        if not pairs:
            continue
        ratios = [n / b for b, n in pairs if b > 0]
        print(
            f"{name:16} {_median([b for b, _ in pairs]):9.2f} {_median([n for _, n in pairs]):9.2f}"
            f" {(_median(ratios) if ratios else float('nan')):13.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    serve_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, serve_args = argv[:i], argv[i + 1 :]
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--cold", type=int, default=1, help="cold starts (each in a fresh folder)")
    ap.add_argument("--warm", type=int, default=3, help="warm starts after the last cold one")
    ap.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="the cache folder for warm starts (default: the cold start's fresh one)",
    )
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per start")
    ap.add_argument(
        "--baseline",
        type=Path,
        default=None,
        metavar="CHECKOUT",
        help="also start another checkout's server (its packages/*/src, this venv), "
        "alternating with this one for each warm start; prints paired ratios",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    result: dict[str, Any] = {
        "serve_args": serve_args,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "starts": [],
    }
    tmp = Path(tempfile.mkdtemp(prefix="pagemill-start-"))
    cache = args.cache_dir
    for i in range(args.cold):
        # With a baseline, each round starts both cold (a fresh cache folder each), in
        # alternating order; the warm starts below use this tree's last cold cache.
        sides = [("cold", None)]
        if args.baseline is not None:
            sides = [("cold", None), ("cold baseline", args.baseline)][:: 1 if i % 2 else -1]
        for kind, src in sides:
            folder = tmp / f"{kind.replace(' ', '-')}-{i}"
            r = {"kind": kind, **one_start(folder, serve_args, args.timeout, src)}
            result["starts"].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "log"}), flush=True)
            if src is None:
                cache = folder
    if cache is None:
        ap.error("--cold 0 needs --cache-dir (warm starts need a filled cache)")
    for i in range(args.warm):
        # With a baseline, each round starts both, in alternating order.
        sides = [("warm", None)]
        if args.baseline is not None:
            sides = [("warm", None), ("baseline", args.baseline)][:: 1 if i % 2 else -1]
        for kind, src in sides:
            r = {"kind": kind, **one_start(cache, serve_args, args.timeout, src)}
            result["starts"].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "log"}), flush=True)
    result["loadavg_end"] = os.getloadavg()
    print(
        f"cache folder: {cache}; load average {result['loadavg_start']} -> {result['loadavg_end']}"
    )
    for kind in ("cold baseline", "cold", "baseline", "warm"):
        rows = [r for r in result["starts"] if r["kind"] == kind]
        if rows:
            walls = sorted(r["wall_s"] for r in rows)
            cpus = sorted(r["cpu_s"] for r in rows)
            firsts = sorted(r["first_request_s"] for r in rows)
            print(
                f"{kind}: {len(rows)} start(s), wall median {walls[len(walls) // 2]:.1f} s "
                f"(min {walls[0]:.1f}), CPU median {cpus[len(cpus) // 2]:.1f} s "
                f"(min {cpus[0]:.1f}), first request median {_median(firsts):.2f} s"
            )
    if args.baseline is not None:
        if args.cold:
            print("cold starts:")
            _print_ab(result["starts"], "cold baseline", "cold")
        if args.warm:
            print("warm starts:")
            _print_ab(result["starts"], "baseline", "warm")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
