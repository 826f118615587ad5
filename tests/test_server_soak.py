"""Soak: 1,000 concurrent short streams against `pagemill serve` on loopback (slow).

Every stream must either complete (its last event is [DONE] after a finish_reason) or be
refused cleanly with 429 + Retry-After; no other status, no truncated stream. The server's
RSS before and after is reported (and bounded loosely: a leak per request would show).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import build_tiny_llama
from test_server_shutdown import start

pytestmark = pytest.mark.slow

STREAMS = 1000


def rss_mib(pid: int) -> float:
    total = 0
    for p in [pid, *map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split())]:
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


async def one(http: httpx.AsyncClient, url: str, i: int) -> str:
    async with http.stream(
        "POST",
        url + "/v1/completions",
        json={"prompt": [5 + i % 50, 6, 8], "max_tokens": 4, "ignore_eos": True, "stream": True},
    ) as r:
        if r.status_code == 429:
            assert r.headers.get("retry-after")
            await r.aread()
            return "429"
        assert r.status_code == 200, r.status_code
        events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length", events[-2]
    return "ok"


async def soak(url: str) -> dict[str, int]:
    limits = httpx.Limits(max_connections=STREAMS, max_keepalive_connections=STREAMS)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        results = await asyncio.gather(*(one(http, url, i) for i in range(STREAMS)))
    return {k: results.count(k) for k in set(results)}


def test_thousand_concurrent_streams(tmp_path: Path) -> None:
    build_tiny_llama(tmp_path, max_len=256)
    s = start(tmp_path, "--max-queue-len", "512", "--max-num-seqs", "128")
    try:
        before = rss_mib(s.proc.pid)
        t0 = time.monotonic()
        counts = asyncio.run(soak(s.url))
        took = time.monotonic() - t0
        after_first = rss_mib(s.proc.pid)
        counts2 = asyncio.run(soak(s.url))
        after = rss_mib(s.proc.pid)
        print(
            f"soak: {STREAMS} streams x2 -> {counts} / {counts2} in {took:.1f} s; server RSS "
            f"{before:.0f} -> {after_first:.0f} -> {after:.0f} MiB"
        )
        assert set(counts) <= {"ok", "429"} and set(counts2) <= {"ok", "429"}
        assert counts.get("ok", 0) >= 128
        # A second identical round must not keep growing the server (no per-request leak).
        assert after - after_first < max(64.0, 0.25 * after_first)
        assert httpx.get(s.url + "/health").status_code == 200
    finally:
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(60)
