"""The dashboard page in a real headless Chromium (Debian's, driven by Playwright).

The engine core is scripted (`dashboard_helpers.ScriptedCore`: the real scheduler and block
pool, no model, behind the server's real front end), so the pool's state is known exactly:
requests with a shared 3-block prefix must show those blocks with ref count 2 and both
owners on hover, and once every request has ended the grid must show no block in use. A
screenshot of a busier moment (preemptions, cached blocks, charts) is written too: to the
test's tmp folder, and to docs/dashboard.png for the README when PAGEMILL_UPDATE_SCREENSHOT=1.

Skipped, saying why, when Playwright or a Chromium is missing (`.ci/run` installs Debian's
chromium with apt when it can).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dashboard_helpers import ScriptedCore, find_chromium
from server_helpers import front_end, toy_assets

from pagemill.runtime import SamplingParams
from pagemill.server import AsyncEngine, ServerThread, build_app
from pagemill.server.dashboard import DashboardHub, DashboardSettings

REPO = Path(__file__).resolve().parents[1]
PREFIX = list(range(1, 49))  # three full 16-token blocks
NUM_BLOCKS = 112


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (it is in the workspace's dev dependencies)")
    path = find_chromium()
    if path is None:
        pytest.skip("no Chromium found (apt-get install chromium, or set PAGEMILL_CHROMIUM)")
    with sync_playwright() as pw:
        try:
            b = pw.chromium.launch(
                executable_path=path, headless=True, args=["--no-sandbox", "--disable-gpu"]
            )
        except Exception as exc:
            pytest.skip(f"Chromium at {path} does not start headless: {exc}")
        yield b
        b.close()


@pytest.fixture
def served() -> Iterator[tuple[str, ScriptedCore, AsyncEngine, DashboardHub]]:
    engine = ScriptedCore(NUM_BLOCKS, max_num_seqs=6, step_delay=0.01)
    client = front_end(engine, assets=toy_assets(vocab_size=4096))
    hub = DashboardHub(DashboardSettings(0.05), model_name="scripted")
    app = build_app(client, "scripted", dashboard=hub)
    try:
        with ServerThread(app) as url:
            yield url, engine, client, hub
    finally:
        client.shutdown()


def _wait_snapshots(page: Any, more_than: int) -> int:
    page.wait_for_function(f"() => +document.body.dataset.snapshots > {more_than}", timeout=10_000)
    return int(page.evaluate("document.body.dataset.snapshots"))


def _cells(page: Any) -> list[dict[str, str]]:
    return page.eval_on_selector_all(
        "#grid .cell",
        "cs => cs.map(c => ({state: c.dataset.state, ref: c.dataset.ref, text: c.textContent}))",
    )


def _script_shared_prefix(e: ScriptedCore) -> None:
    e.add("req-a", [*PREFIX, 100, 101, 102], max_tokens=30)
    e.schedule_once()  # a's blocks are computed and cached: b's prefix hits them
    e.add("req-b", [*PREFIX, 200, 201], max_tokens=30)
    e.add("req-c", list(range(300, 340)), max_tokens=30)
    e.schedule_once()


@contextlib.contextmanager
def _workload(client: AsyncEngine) -> Iterator[None]:
    """A shared system prompt, a pool too small for all: sent through the front end (on an
    event loop of its own), so the charts get the front end's token counts and latencies."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    ids = [f"chat-{i}" for i in range(14)]
    try:
        for i, rid in enumerate(ids):
            prompt = [*PREFIX, *range(1000 + 50 * i, 1000 + 50 * i + 20 + 7 * i)]
            params = SamplingParams(max_tokens=150 + 60 * (i % 4), ignore_eos=True)
            asyncio.run_coroutine_threadsafe(client.add_request(rid, prompt, params), loop).result(
                10
            )
        client.submit(_unpause).result(10)
        yield
    finally:
        for rid in ids:
            client.release(rid, finished=False)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _unpause(e: ScriptedCore) -> None:
    e.paused = False


def _run_fast(e: ScriptedCore) -> None:
    e.step_delay = 0.0
    e.paused = False


def _pause(e: ScriptedCore) -> None:
    e.paused = True


def test_dashboard_page_shows_the_pool(browser: Any, served: Any, tmp_path: Path) -> None:
    url, engine, client, hub = served
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("requestfailed", lambda req: errors.append(f"failed: {req.url}"))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(url + "/dashboard")
    seen = _wait_snapshots(page, 0)  # the first picture, taken on connect
    assert page.text_content("#status") == "live"
    assert len(_cells(page)) == NUM_BLOCKS
    assert all(c["state"] == "free" for c in _cells(page))

    # A known pool state: a and b share three prefix blocks, c is alone.
    client.submit(_script_shared_prefix).result(10)
    seen = _wait_snapshots(page, seen)
    kv = engine.kv
    table_a = [b.block_id for b in kv.req_to_blocks["req-a"]]
    table_b = [b.block_id for b in kv.req_to_blocks["req-b"]]
    assert table_a[:3] == table_b[:3]
    cells = _cells(page)
    for block in table_a[:3]:
        assert cells[block] == {"state": "shared", "ref": "2", "text": "2"}
    in_use = {b.block_id for t in kv.req_to_blocks.values() for b in t}
    assert {i for i, c in enumerate(cells) if c["state"] in ("used", "shared")} == in_use
    assert page.text_content("#c-shared") == "3"
    assert page.locator("#running tr").count() == 3
    page.hover(f'#grid .cell[data-block="{table_a[0]}"]')
    tip = page.text_content("#tip")
    assert "ref count 2" in tip and "req-a" in tip and "req-b" in tip

    # Everything ends: no block in use, the full prefix blocks stay cached (evictable).
    client.submit(lambda e: e.finish_all()).result(10)
    page.wait_for_function(
        "() => document.querySelectorAll('#running tr').length === 0", timeout=10_000
    )
    cells = _cells(page)
    assert not [c for c in cells if c["state"] in ("used", "shared")]
    assert sum(c["state"] == "cached" for c in cells) >= 3
    assert page.text_content("#c-used") == "0"

    # A busy moment for the README: a shared system prompt, a pool too small for all.
    with _workload(client):
        time.sleep(3.0)
        client.submit(_pause).result(10)
        hub.flush()
        seen = _wait_snapshots(page, int(page.evaluate("document.body.dataset.snapshots")) - 1)
        time.sleep(0.3)
        shared = page.query_selector('#grid .cell[data-state="shared"]')
        if shared is not None:  # show a shared block's owners in the picture
            shared.hover()
        shot = tmp_path / "dashboard.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
        if os.environ.get("PAGEMILL_UPDATE_SCREENSHOT") == "1":
            shutil.copyfile(shot, REPO / "docs" / "dashboard.png")
        assert any(p.get("tok_s") for p in hub.series.history())  # the charts have tokens

        # Run to the end: all free again.
        client.submit(_run_fast).result(10)
        deadline = time.monotonic() + 20
        while engine.scheduler.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.05)
        page.wait_for_function(
            "() => document.querySelectorAll('#running tr').length === 0", timeout=10_000
        )
        assert not [c for c in _cells(page) if c["state"] in ("used", "shared")]
        assert engine.kv.get_num_free_blocks() == NUM_BLOCKS
        assert not errors, errors
        page.close()


def _simulate_html(out: Path) -> Path:
    from pagemill.server.cli import main

    html = out / "sim.html"
    code = main(
        [
            "simulate",
            "--model",
            "smollm2-135m",
            "--gpu",
            "rtx-4090",
            "--num-blocks",
            "96",
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "16",
            "--max-num-batched-tokens",
            "256",
            "--num-requests",
            "24",
            "--prompt-len",
            "64",
            "--output-len",
            "48",
            "--system-prompt-len",
            "128",
            "--budgets",
            "64,256",
            "--request-rate",
            "200",
            "--no-plots",
            "--out-dir",
            str(out),
            "--html",
            str(html),
        ]
    )
    assert code == 0
    return html


def test_simulation_replays_in_the_same_page(browser: Any, tmp_path: Path) -> None:
    html = _simulate_html(tmp_path)
    text = html.read_text()
    assert "dashboard/static/" not in text and "http://" not in text  # one file, no network
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(html.as_uri())
    _wait_snapshots(page, 0)
    assert page.text_content("#status") == "replay"
    runs = page.eval_on_selector_all("#replay-run option", "os => os.map(o => o.textContent)")
    assert "prefix: prefix cache on" in runs and "static: paged, saturated" in runs
    assert len(_cells(page)) == 96
    frames = int(page.get_attribute("#replay-slider", "max"))
    assert frames > 3
    # Somewhere in the run the pool is in use; at the end every block is free again.
    page.fill("#replay-slider", str(frames // 3))
    page.dispatch_event("#replay-slider", "input")
    page.wait_for_function(
        "() => document.querySelectorAll('#running tr').length > 0", timeout=5_000
    )
    assert any(c["state"] in ("used", "shared") for c in _cells(page))
    page.fill("#replay-slider", str(frames))
    page.dispatch_event("#replay-slider", "input")
    page.wait_for_function(
        "() => document.querySelectorAll('#running tr').length === 0", timeout=5_000
    )
    assert not [c for c in _cells(page) if c["state"] in ("used", "shared")]
    page.select_option("#replay-run", label="prefix: prefix cache on")
    page.click("#replay-play")
    time.sleep(0.5)
    assert "frame" in page.text_content("#replay-frame")
    assert not errors, errors
    page.close()


def test_data_parallel_cores_each_show_their_pool(browser: Any) -> None:
    """Two cores' pictures (real schedulers and pools, tagged as `DPClient` tags them): the
    page draws one grid per core, each with its own block ids, and a hover names the core
    and the block's owners there."""
    from fastapi import FastAPI

    from pagemill.blockpool import KVCacheManager
    from pagemill.scheduler import Request, Scheduler
    from pagemill.scheduler.config import SchedulerConfig
    from pagemill.server.dashboard.routes import install_dashboard
    from pagemill.server.dashboard.snapshot import snapshot_scheduler

    def core(num_blocks: int) -> Scheduler:
        kv = KVCacheManager(num_blocks, 16, enable_caching=True)
        return Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_model_len=512), kv)

    def step(s: Scheduler) -> None:
        out = s.schedule()
        s.update_from_output(out, {r.request_id: 5 for r in out.scheduled if r.sample})

    cores = [core(40), core(24)]
    cores[0].add_request(Request("req-a", [*PREFIX, 7], max_tokens=8, ignore_eos=True))
    step(cores[0])
    cores[0].add_request(Request("req-b", [*PREFIX, 9], max_tokens=8, ignore_eos=True))
    step(cores[0])
    cores[1].add_request(Request("req-c", list(range(500, 540)), max_tokens=8, ignore_eos=True))
    step(cores[1])
    hub = DashboardHub(DashboardSettings(0.05), model_name="dp")
    for k, s in enumerate(cores):
        hub.publish_snapshot({**snapshot_scheduler(s), "engine_index": k})
    app = FastAPI()
    install_dashboard(app, hub)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        with ServerThread(app) as url:
            page.goto(url + "/dashboard")
            _wait_snapshots(page, 0)
            assert page.locator("#grid .core").count() == 2
            counts = [page.locator(f"#grid .core:nth-child({k + 1}) .cell").count() for k in (0, 1)]
            assert counts == [40, 24]
            shared = [b.block_id for b in cores[0].kv_cache_manager.req_to_blocks["req-a"]][:3]
            for k, s in enumerate(cores):
                in_use = {b.block_id for t in s.kv_cache_manager.req_to_blocks.values() for b in t}
                states = page.eval_on_selector_all(
                    f'#grid .cell[data-engine="{k}"]', "cs => cs.map(c => c.dataset.state)"
                )
                assert {i for i, st in enumerate(states) if st in ("used", "shared")} == in_use
            page.hover(f'#grid .cell[data-engine="0"][data-block="{shared[0]}"]')
            tip = page.text_content("#tip")
            assert "core 0" in tip and "ref count 2" in tip and "req-a" in tip and "req-b" in tip
            ids = page.eval_on_selector_all("#running td.id", "ts => ts.map(t => t.textContent)")
            assert sorted(ids) == ["core 0 · req-a", "core 0 · req-b", "core 1 · req-c"]
            assert "2 engine cores" in page.text_content("#pool-note")
            assert not errors, errors
    finally:
        page.close()
