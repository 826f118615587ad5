"""Start-up time of `pagemill serve`: one cold start in a fresh cache folder, then warm ones.

Each start is a fresh server process (`python -m pagemill.server.cli serve ...`, what
`uv run pagemill serve` runs, without uv's own sync check), timed from launch until
`/health` answers 200; then it is stopped. Reported per start: wall seconds, the CPU
seconds the server used (user + system, from its rusage once it has exited) and when each
phase's log line appeared (seconds after launch), so a slow start says where its time went.
Wall time on a shared machine measures the load as much as the start: read the CPU column
there.

    python benchmarks/start_time.py                       # 1 cold + 3 warm, default model
    python benchmarks/start_time.py --warm 5 --json out.json
    python benchmarks/start_time.py --cache-dir ~/.cache/pagemill --cold 0   # warm only
    python benchmarks/start_time.py -- --max-num-seqs 64  # flags after -- go to serve

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
    ("model folder", re.compile(r"loading \S+ \(")),
    ("weights", re.compile(r"loaded \S+ \(")),
    ("kv pool", re.compile(r"KV|kv cache|blocks", re.IGNORECASE)),
    ("compiled", re.compile(r"compil", re.IGNORECASE)),
    ("serving", re.compile(r"Uvicorn running|Application startup complete|listening")),
]


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


def one_start(cache_dir: Path, serve_args: list[str], timeout: float) -> dict[str, Any]:
    port = _free_port()
    env = dict(os.environ, PAGEMILL_CACHE_DIR=str(cache_dir))
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
    wall = None
    while time.perf_counter() - t0 < timeout and proc.poll() is None:
        if _healthy(port):
            wall = time.perf_counter() - t0
            break
        time.sleep(0.05)
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
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "phases": phases, "log": log}


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
        cache = tmp / f"cold-{i}"
        r = {"kind": "cold", **one_start(cache, serve_args, args.timeout)}
        result["starts"].append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "log"}), flush=True)
    if cache is None:
        ap.error("--cold 0 needs --cache-dir (warm starts need a filled cache)")
    for _ in range(args.warm):
        r = {"kind": "warm", **one_start(cache, serve_args, args.timeout)}
        result["starts"].append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "log"}), flush=True)
    result["loadavg_end"] = os.getloadavg()
    print(
        f"cache folder: {cache}; load average {result['loadavg_start']} -> {result['loadavg_end']}"
    )
    for kind in ("cold", "warm"):
        rows = [r for r in result["starts"] if r["kind"] == kind]
        if rows:
            walls = sorted(r["wall_s"] for r in rows)
            cpus = sorted(r["cpu_s"] for r in rows)
            print(
                f"{kind}: {len(rows)} start(s), wall median {walls[len(walls) // 2]:.1f} s "
                f"(min {walls[0]:.1f}), CPU median {cpus[len(cpus) // 2]:.1f} s "
                f"(min {cpus[0]:.1f})"
            )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
