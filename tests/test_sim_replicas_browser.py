"""`pagemill simulate --replicas N --html` in a real headless Chromium: the routers side by
side above the replay, and each router's run drawn with one block pool per replica.

Skipped, saying why, when Playwright or a Chromium is missing (as the dashboard's browser
tests are).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dashboard_helpers import find_chromium


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


def test_routers_side_by_side_and_replicas_pools(browser: Any, tmp_path: Path) -> None:
    from pagemill.server.cli import main

    html = tmp_path / "routing.html"
    argv = ["simulate", "--model", "smollm2-135m", "--gpu", "rtx-4090", "--num-blocks", "64"]
    argv += ["--max-model-len", "512", "--system-prompt-len", "128", "--prompt-len", "16"]
    argv += ["--output-len", "8", "--prefixes", "3", "--users-per-prefix", "2"]
    argv += ["--replicas", "3", "--router", "round_robin,prefix", "--no-plots"]
    assert main([*argv, "--out-dir", str(tmp_path), "--html", str(html)]) == 0
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(html.as_uri())
    page.wait_for_function("() => +document.body.dataset.snapshots > 0", timeout=10_000)
    sections = page.eval_on_selector_all("#routers .router", "ss => ss.map(s => s.id)")
    assert sections == ["router-round_robin", "router-prefix"]
    # Side by side: the two sections share a row.
    tops = page.eval_on_selector_all(
        "#routers .router", "ss => ss.map(s => Math.round(s.getBoundingClientRect().top))"
    )
    assert len(set(tops)) == 1, tops
    runs = page.eval_on_selector_all("#replay-run option", "os => os.map(o => o.textContent)")
    assert runs == ["router round_robin", "router prefix"]
    for label in runs:
        page.select_option("#replay-run", label=label)
        heads = page.eval_on_selector_all("#grid .core h3", "hs => hs.map(h => h.textContent)")
        assert len(heads) == 3 and all(h.startswith(f"core {i} ") for i, h in enumerate(heads))
        pools = page.eval_on_selector_all(
            "#grid .core .grid", "gs => gs.map(g => g.children.length)"
        )
        assert pools == [64, 64, 64]
    assert not errors, errors
