"""The server over a tensor-parallel engine (`pagemill serve -tp 2`, gloo on CPU): it
streams answers; a worker that dies turns /health 503 and ends the server with status 1.

The engine runs in its own process, as `pagemill serve` runs it, and starts its worker
from there; the HTTP side is `shutdown.serve` on a thread of the test process.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from server_helpers import ServeThread, build_tiny_llama, engine_kwargs

from pagemill.runtime.config import EngineConfig
from pagemill.server import AsyncEngine, build_app
from pagemill.server.cli import build_parser
from pagemill.server.entrypoints.watchdog import Watchdog

MODEL = "tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tp-llama")
    build_tiny_llama(folder)
    return folder


def test_tensor_parallel_flags() -> None:
    parser = build_parser()
    for flags in (["-tp", "2"], ["--tensor-parallel-size", "2"]):
        assert parser.parse_args(["serve", "m", *flags]).tensor_parallel_size == 2
    assert parser.parse_args(["serve", "m"]).tensor_parallel_size == 1


def _children(pid: int) -> list[int]:
    return [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _stream(url: str, body: dict) -> list[str]:
    events = []
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    return events


def test_tp2_server_streams_and_a_dead_worker_ends_it(model_dir: Path) -> None:
    config = EngineConfig.from_kwargs(**engine_kwargs(model_dir), tensor_parallel_size=2)
    client = AsyncEngine.launch(config, engine_threads=1)
    try:
        [worker] = _children(client.engine_pid)
        app = build_app(client, MODEL)
        with ServeThread(app, client, shutdown_timeout=1, watchdog=Watchdog(client, 30, 1)) as srv:
            body = {
                "model": MODEL,
                "prompt": [5, 6, 8],
                "max_tokens": 8,
                "ignore_eos": True,
                "temperature": 0,
            }
            whole = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
            events = _stream(srv.url + "/v1/completions", body)
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            text = "".join(c["choices"][0]["text"] for c in chunks)
            assert text == whole["choices"][0]["text"]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            chat = _stream(
                srv.url + "/v1/chat/completions",
                {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "hello"}],
                    "max_tokens": 4,
                    "temperature": 0,
                },
            )
            assert chat[-1] == "[DONE]" and len(chat) >= 3
            assert httpx.get(srv.url + "/health").status_code == 200

            os.kill(worker, signal.SIGKILL)
            # The engine process notices at once (not at the next request) and exits; the
            # server then answers 503 and stops with status 1 (no hang).
            deadline = time.monotonic() + 20
            while not client.is_dead:
                assert time.monotonic() < deadline, "the engine did not notice the dead worker"
                time.sleep(0.05)
            assert srv.wait(20) == 1
        assert "worker rank 1" in str(client.dead_error)
        assert "exited with code -9" in str(client.dead_error)
        with TestClient(build_app(client, MODEL)) as http:
            r = http.get("/health")
            assert r.status_code == 503
    finally:
        client.shutdown()


@pytest.mark.slow
def test_torchrun_launch_serves(model_dir: Path) -> None:
    """The documented multi-node command on one node: torchrun starts both ranks, rank 0
    serves, rank 1 runs the worker loop (`pagemill serve` with RANK=1)."""
    import shutil
    import subprocess
    import sys

    from server_helpers import free_socket

    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    ports = [free_socket() for _ in range(2)]
    http_port, master_port = (s.getsockname()[1] for s in ports)
    for s in ports:
        s.close()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PAGEMILL_ENFORCE_EAGER": "1"}
    proc = subprocess.Popen(
        [
            torchrun,
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(master_port),
            "-m",
            "pagemill.server",
            "serve",
            str(model_dir),
            "-tp",
            "2",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--port",
            str(http_port),
            "--kv-cache-memory",
            "4MiB",
            "--log-level",
            "warning",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (
                proc.stdout.read().decode()
                if proc.poll() is not None and proc.stdout
                else "timeout"
            )
            time.sleep(0.2)
        events = _stream(
            url + "/v1/completions",
            {"prompt": [5, 6, 8], "max_tokens": 6, "ignore_eos": True, "temperature": 0},
        )
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
