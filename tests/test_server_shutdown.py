"""`pagemill serve` as a process: SIGTERM drains and exits 0; a dying engine exits non-zero.

Issue 15, findings 4 (SIGTERM cut active streams after 5 s with no final event, exit -15)
and 1 (a dead engine process left a live server answering 503 forever).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_helpers import build_tiny_llama, free_socket

# Each test starts `pagemill serve` as a process: 20-120 s apiece on the shared CI box.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("shutdown-llama")
    build_tiny_llama(folder, max_len=2048)
    return folder


class Served:
    def __init__(self, proc: subprocess.Popen[bytes], url: str) -> None:
        self.proc, self.url = proc, url


def start(model_dir: Path, *extra: str) -> Served:
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PAGEMILL_ENFORCE_EAGER": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pagemill.server",
            "serve",
            str(model_dir),
            "--port",
            str(port),
            "--served-model-name",
            "tiny",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--kv-cache-memory",
            "4MiB",
            "--log-level",
            "warning",
            "--engine-threads",
            "1",
            *extra,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return Served(proc, url)
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            out = proc.stdout.read().decode() if proc.stdout else ""
            proc.kill()
            raise AssertionError(f"server did not start (exit {proc.returncode}):\n{out}")
        time.sleep(0.1)


@pytest.fixture(params=["in-process", "engine-process"])
def served(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[Served]:
    extra = ("--no-engine-process",) if request.param == "in-process" else ()
    s = start(model_dir, "--shutdown-timeout", "1", *extra)
    yield s
    if s.proc.poll() is None:
        s.proc.kill()
        s.proc.wait(10)


def stream(url: str, max_tokens: int, events: list[str], first: threading.Event) -> None:
    with httpx.stream(
        "POST",
        url + "/v1/completions",
        timeout=60,
        json={
            "prompt": [5, 6, 8],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "temperature": 0,
        },
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                first.set()


def test_sigterm_drains_then_ends_the_rest_and_exits_zero(served: Served) -> None:
    long_events: list[str] = []
    short_events: list[str] = []
    got_long, got_short = threading.Event(), threading.Event()
    threads = [
        threading.Thread(target=stream, args=(served.url, 2000, long_events, got_long)),
        threading.Thread(target=stream, args=(served.url, 4, short_events, got_short)),
    ]
    for t in threads:
        t.start()
    assert got_long.wait(60) and got_short.wait(60)
    sent = time.monotonic()
    served.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(30)
    code = served.proc.wait(30)
    took = time.monotonic() - sent
    out = served.proc.stdout.read().decode() if served.proc.stdout else ""
    assert code == 0, out
    # The short stream finished normally; the long one got a final error event, then [DONE].
    assert short_events[-1] == "[DONE]"
    assert json.loads(short_events[-2])["choices"][0]["finish_reason"] == "length"
    assert long_events[-1] == "[DONE]"
    err = json.loads(long_events[-2])["error"]
    assert err["code"] == "server_shutting_down" and "shutting down" in err["message"]
    assert took < 10, took
    # Nothing listens any more.
    with pytest.raises(httpx.TransportError):
        httpx.get(served.url + "/health", timeout=2)


def test_engine_process_death_exits_nonzero(model_dir: Path) -> None:
    s = start(model_dir, "--shutdown-timeout", "1")
    try:
        pid = _engine_pid(s.proc.pid)
        os.kill(pid, signal.SIGKILL)
        code = s.proc.wait(30)
        assert code == 1
    finally:
        if s.proc.poll() is None:
            s.proc.kill()


def _engine_pid(parent: int) -> int:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        kids = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        for kid in kids:
            cmd = Path(f"/proc/{kid}/cmdline").read_bytes()
            if b"spawn_main" in cmd:
                return int(kid)
        time.sleep(0.1)
    raise AssertionError("no engine process found")
