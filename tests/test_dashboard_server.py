"""The dashboard behind a real engine: auth, the SSE feed, watchers, prompt privacy.

A tiny random-weight Llama on the engine thread (`AsyncEngine(LLMEngine)`): the page and its
files are served from the package, the whole /dashboard tree is behind the API key (Bearer,
or Basic with the key as password, which a browser can send), pictures are taken only while
a page watches, the feed shows the request running and then every block free, and no prompt
text leaves the engine unless asked for. The engine process's side (`EngineCoreLoop` with a
`SnapshotTap`, pictures over the pipe) is checked on a thread with a scripted core, and
end to end with a real engine process behind `-m slow` (spawning one costs 15-40 s here).
"""

from __future__ import annotations

import base64
import functools
import json
import multiprocessing
import pickle
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from dashboard_helpers import ScriptedCore
from server_helpers import build_tiny_llama, engine_kwargs

from pagemill.runtime import LLMEngine, SamplingParams
from pagemill.runtime.config import EngineConfig
from pagemill.server import AsyncEngine, EngineMetrics, ServerThread, build_app
from pagemill.server.dashboard import DashboardHub, DashboardSettings, snapshot_engine

KEY = "sk-dash"
SECRET = "hello paged attention the quick brown fox"
BEARER = {"Authorization": f"Bearer {KEY}"}
BASIC = {"Authorization": "Basic " + base64.b64encode(f"me:{KEY}".encode()).decode()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("dashboard-llama")
    build_tiny_llama(folder)
    return folder


def _serve(client: Any) -> Iterator[tuple[str, Any, DashboardHub]]:
    hub = DashboardHub(DashboardSettings(0.02), model_name="tiny")
    app = build_app(client, "tiny", api_key=KEY, dashboard=hub)
    try:
        with ServerThread(app) as url:
            yield url, client, hub
    finally:
        client.shutdown()


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[tuple[str, Any, DashboardHub]]:
    engine = LLMEngine(**engine_kwargs(model_dir, num_blocks=64))
    yield from _serve(AsyncEngine(engine, observer=EngineMetrics("tiny")))


@pytest.fixture(scope="module")
def served_process(model_dir: Path) -> Iterator[tuple[str, Any, DashboardHub]]:
    config = EngineConfig.from_kwargs(**engine_kwargs(model_dir, num_blocks=64))
    yield from _serve(
        AsyncEngine.launch(
            config, observer=EngineMetrics("tiny"), dashboard=DashboardSettings(0.02)
        )
    )


def test_the_page_and_its_files_are_served_behind_the_key(served: Any) -> None:
    url, _, _ = served
    for path in (
        "/dashboard",
        "/dashboard/static/dashboard.js",
        "/dashboard/snapshot",
        "/dashboard/events",
    ):
        r = httpx.get(url + path)
        assert r.status_code == 401, path
        assert r.headers["www-authenticate"].startswith("Basic")
        wrong = base64.b64encode(b"me:nope").decode()
        assert httpx.get(url + path, headers={"Authorization": f"Basic {wrong}"}).status_code == 401
    page = httpx.get(url + "/dashboard", headers=BASIC)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert "http://" not in page.text and "https://" not in page.text  # nothing from elsewhere
    for name in (
        "dashboard.js",
        "dashboard.css",
        "vendor/uPlot.iife.min.js",
        "vendor/uPlot.min.css",
        "vendor/uPlot.LICENSE",
    ):
        r = httpx.get(f"{url}/dashboard/static/{name}", headers=BEARER)
        assert r.status_code == 200 and r.text, name
    assert httpx.get(url + "/dashboard/static/../auth.py", headers=BEARER).status_code == 404
    assert httpx.get(url + "/dashboard/static/index.html.bak", headers=BEARER).status_code == 404
    # Read-only: nothing but GET.
    assert httpx.post(url + "/dashboard/snapshot", headers=BEARER).status_code == 405


def test_the_feed_follows_a_request_and_hides_its_prompt(served: Any) -> None:
    check_feed(*served)


@pytest.mark.slow
def test_the_feed_from_an_engine_process(served_process: Any) -> None:
    url, client, hub = served_process
    assert hub.watchers is client.dashboard_watchers  # shared memory with the engine process
    check_feed(url, client, hub)
    # The page goes: the engine process stops taking pictures (the shared count is 0).
    deadline = time.monotonic() + 10
    while client.dashboard_watchers.value and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.dashboard_watchers.value == 0


def check_feed(url: str, client: Any, hub: DashboardHub) -> None:
    assert hub.watchers.value == 0
    before = httpx.get(url + "/dashboard/snapshot", headers=BEARER).json()["snapshot"]
    assert before["in_use"] == 0 and set(before["grid"]) <= {".", "c"}
    assert before["num_blocks"] == 64 and len(before["grid"]) == 64

    messages: list[tuple[str, dict[str, Any]]] = []
    raw: list[str] = []
    stop = threading.Event()
    connected = threading.Event()

    def read() -> None:
        with httpx.stream("GET", url + "/dashboard/events", headers=BASIC, timeout=30) as r:
            event = None
            for line in r.iter_lines():
                raw.append(line)
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: ") and event:
                    messages.append((event, json.loads(line[6:])))
                    connected.set()
                if stop.is_set():
                    return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert connected.wait(20)
    deadline = time.monotonic() + 10
    while hub.watchers.value != 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert hub.watchers.value == 1  # the engine side now takes pictures
    r = httpx.post(
        url + "/v1/completions",
        headers=BEARER,
        timeout=60,
        json={
            "model": "tiny",
            "prompt": SECRET,
            "max_tokens": 48,
            "ignore_eos": True,
            "temperature": 0,
        },
    )
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        snaps = [m["snapshot"] for e, m in messages if e == "snapshot"]
        if any(s["running"] for s in snaps) and snaps[-1]["in_use"] == 0:
            break
        time.sleep(0.05)
    stop.set()
    assert messages[0][0] == "init"
    assert messages[0][1]["config"]["mode"] == "live"
    snaps = [m["snapshot"] for e, m in messages if e == "snapshot"]
    busy = [s for s in snaps if s["running"]]
    assert busy, "no picture showed the request running"
    row = busy[-1]["running"][0]
    assert row["prompt_tokens"] > 0 and row["blocks"]
    assert "prompt" not in row
    assert busy[-1]["cost_us"] > 0
    assert snaps[-1]["in_use"] == 0 and not snaps[-1]["running"]  # all free at the end
    assert SECRET not in "\n".join(raw)
    # Charts: the step reached the chart history (points close every half second).
    hub.flush()
    time.sleep(0.6)
    hub.flush()
    assert any(p.get("tok_s") for p in hub.series.history())
    hub.close()  # ends the stream (as a server shutdown does); later pages get nothing
    reader.join(5)
    assert not reader.is_alive()
    hub.closed = False  # this hub serves the next test


def test_the_page_stops_the_pictures_when_it_goes(served: Any) -> None:
    url, _, hub = served
    with httpx.stream("GET", url + "/dashboard/events", headers=BEARER, timeout=10) as r:
        # Held in a name: a dropped iter_lines() generator is finalized at once, and closing
        # it closes the response, so the page would be gone before the count is read.
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("event: snapshot"):
                break
        deadline = time.monotonic() + 20  # an earlier test's page may still be leaving
        while hub.watchers.value != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert hub.watchers.value == 1
    deadline = time.monotonic() + 20  # generous: a loaded box notices a closed socket late
    while hub.watchers.value and time.monotonic() < deadline:
        time.sleep(0.02)
    assert hub.watchers.value == 0


def test_prompts_only_with_show_prompts(model_dir: Path) -> None:
    engine = LLMEngine(**engine_kwargs(model_dir, num_blocks=32))
    engine.add_request("r1", SECRET, SamplingParams(max_tokens=4))
    hidden = snapshot_engine(engine)
    assert hidden is not None and SECRET not in json.dumps(hidden)
    assert hidden["waiting"][0]["id"] == "r1" and "prompt" not in hidden["waiting"][0]
    shown = snapshot_engine(engine, show_prompts=True)
    assert shown is not None and shown["waiting"][0]["prompt"] == SECRET
    while engine.has_unfinished_requests():
        engine.step()
    end = snapshot_engine(engine, show_prompts=True)
    assert end is not None and end["in_use"] == 0 and not end["running"] and not end["waiting"]


def _add_and_run(engine: ScriptedCore, prefix: str) -> None:
    for i in range(3):
        engine.add(f"{prefix}-{i}", [*range(1, 40), 100 + i], max_tokens=20)
    engine.paused = False


def test_the_engine_loop_sends_pictures_only_while_watched() -> None:
    """`EngineCoreLoop` (the core process's loop) on a thread, over real pipes with the
    process transport's codec and sender, a `SnapshotTap` as its observer."""
    from pagemill.runtime.engine.core_client import EngineCoreLoop, _PipeSender
    from pagemill.runtime.engine.protocol import (
        Codec,
        EngineCoreEvent,
        EngineCoreOutputs,
        Shutdown,
        UtilityCall,
        UtilityResult,
    )
    from pagemill.server.dashboard import SnapshotTap

    ctx = multiprocessing.get_context("spawn")
    watchers = ctx.RawValue("i", 0)
    cmd_read, cmd_write = ctx.Pipe(duplex=False)
    out_read, out_write = ctx.Pipe(duplex=False)
    codec = Codec()
    sender = _PipeSender(out_write, codec)

    def recv(block: bool) -> Any:
        if not block and not cmd_read.poll(0):
            return None
        return codec.decode(cmd_read.recv_bytes())

    engine = ScriptedCore(32)
    tap = SnapshotTap(DashboardSettings(0.01), watchers)
    loop = EngineCoreLoop(engine, recv, sender.send, [0.0, 0.0, 0.0], observer=tap)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()

    def run(prefix: str) -> list[Any]:
        fn = pickle.dumps(functools.partial(_add_and_run, prefix=prefix))
        cmd_write.send_bytes(codec.encode(UtilityCall(0, fn)))
        msgs = []
        while True:
            assert out_read.poll(10)
            msg = codec.decode(out_read.recv_bytes())
            msgs.append(msg)
            if isinstance(msg, UtilityResult):
                assert msg.ok, pickle.loads(msg.value)
            stats = getattr(msg, "scheduler_stats", None)
            if (
                isinstance(msg, EngineCoreOutputs)
                and msg.step_seconds is not None
                and stats.num_running == 0
                and stats.num_waiting == 0
            ):
                # the last step; a picture may follow it
                while out_read.poll(0.5):
                    msgs.append(codec.decode(out_read.recv_bytes()))
                return msgs

    unwatched = run("a")
    assert any(isinstance(m, EngineCoreOutputs) and m.step_seconds is not None for m in unwatched)
    assert not [m for m in unwatched if isinstance(m, EngineCoreEvent)]
    assert tap.num_snapshots == 0
    watchers.value = 1
    watched = [
        m.payload for m in run("b") if isinstance(m, EngineCoreEvent) and m.kind == "dashboard"
    ]
    assert watched and any(p["running"] for p in watched)
    assert watched[-1]["in_use"] == 0 and not watched[-1]["running"]  # the idle picture
    cmd_write.send_bytes(codec.encode(Shutdown()))
    thread.join(10)
    assert not thread.is_alive()
    sender.close()
