"""The server over two data-parallel engine cores (`pagemill serve -dp 2`).

Greedy answers to concurrent requests equal one engine's; with `prefix` routing a request
that shares a long prefix goes to the core that cached it (seen in the per-engine prefix
hit counters of /metrics); a core that dies ends the server with status 1, as a dead
tensor-parallel worker does, after failing the requests in flight.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_helpers import ServeThread, build_tiny_llama, engine_kwargs

from pagemill.runtime.config import EngineConfig
from pagemill.runtime.engine.llm_engine import LLMEngine
from pagemill.runtime.sampling_params import RequestOutputKind, SamplingParams
from pagemill.server import AsyncEngine, build_app
from pagemill.server.cli import build_parser
from pagemill.server.dashboard import DashboardHub, DashboardSettings
from pagemill.server.entrypoints.watchdog import Watchdog
from pagemill.server.metrics import EngineMetrics

MODEL = "tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("dp-llama")
    build_tiny_llama(folder)
    return folder


def test_data_parallel_flags() -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "m", "-dp", "2", "--data-parallel-routing", "prefix"])
    assert (args.data_parallel_size, args.data_parallel_routing) == (2, "prefix")
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "m", "--data-parallel-routing", "random"])
    with pytest.raises(ValueError, match="pagemill serve"):
        LLMEngine(model="unused", data_parallel_size=2)


def _complete(url: str, prompt: list[int], n: int = 6) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    return {"status": r.status_code, "body": r.json()}


def _engine_series(text: str, name: str) -> dict[str, float]:
    out = {}
    for m in re.finditer(rf'^pagemill:{name}_total\{{.*?engine="(\d+)".*?\}} (\S+)$', text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


@pytest.mark.slow  # three engine processes start: about a minute on a busy CPU
def test_dp2_prefix_routing_matches_one_engine(model_dir: Path) -> None:
    kwargs = engine_kwargs(model_dir, num_blocks=64)
    prompts = [[5 + i, 6, 8, 9, 10 + i] for i in range(4)]
    shared = list(range(20, 84))  # 4 blocks of 16
    reference = LLMEngine(EngineConfig.from_kwargs(**kwargs))
    try:
        want = []
        for p in [*prompts, [*shared, 3]]:
            params = SamplingParams(
                max_tokens=6,
                temperature=0,
                ignore_eos=True,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            reference.add_request(f"ref{len(want)}", p, params)
            done = None
            while reference.has_unfinished_requests():
                for out in reference.step():
                    if out.finished:
                        done = out
            assert done is not None
            want.append(done.outputs[0].text)
    finally:
        reference.shutdown()

    config = EngineConfig.from_kwargs(
        **kwargs, data_parallel_size=2, data_parallel_routing="prefix"
    )
    metrics = EngineMetrics(MODEL)
    settings = DashboardSettings(0.05)
    client = AsyncEngine.launch(config, engine_threads=2, observer=metrics, dashboard=settings)
    try:
        hub = DashboardHub(settings, model_name=MODEL)
        app = build_app(client, MODEL, metrics=metrics, dashboard=hub)
        with ServeThread(app, client, shutdown_timeout=1) as srv:
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                got = list(pool.map(lambda p: _complete(srv.url, p), prompts))
            for g, w in zip(got, want):
                assert g["status"] == 200
                assert g["body"]["choices"][0]["text"] == w

            # Warm one core with the long prefix, then send requests that share it.
            first = _complete(srv.url, [*shared, 3])
            assert first["body"]["choices"][0]["text"] == want[-1]
            time.sleep(0.2)
            router = client.client.router  # type: ignore[attr-defined]
            hashes = router.prompt_hashes(_probe(shared))
            owner = max(range(2), key=lambda k: router.matched_blocks(k, hashes))
            assert router.matched_blocks(owner, hashes) == len(hashes) == 4
            for tail in ([4], [5], [6]):
                assert _complete(srv.url, shared + tail)["status"] == 200
            text = httpx.get(srv.url + "/metrics").text
            hits = _engine_series(text, "engine_prefix_cache_hits")
            assert hits.get(str(owner), 0) >= 3 * 64, text[:2000]
            assert hits.get(str(1 - owner), 0) < 64
            queries = _engine_series(text, "engine_prefix_cache_queries")
            total = re.search(r"^pagemill:prefix_cache_hits_total\{.*?\} (\S+)$", text, re.M)
            assert total and float(total.group(1)) == sum(hits.values())
            assert set(queries) == {"0", "1"} and sum(queries.values()) > 0
            # vLLM's names: one series per core, each with its own engine label.
            vllm_hits = {
                m.group(1): float(m.group(2))
                for m in re.finditer(
                    r'^vllm:prefix_cache_hits_total\{.*?engine="(\d+)".*?\} (\S+)$', text, re.M
                )
            }
            assert vllm_hits == hits
            running = re.findall(r'^vllm:num_requests_running\{.*?engine="(\d+)"', text, re.M)
            assert sorted(running) == ["0", "1"]

            # The dashboard pictures each core's pool, its prefix hits in that core's.
            snap = httpx.get(srv.url + "/dashboard/snapshot").json()["snapshot"]
            cores = snap["cores"]
            assert [c["engine"] for c in cores] == [0, 1]
            assert all(c["num_blocks"] == 64 and len(c["grid"]) == 64 for c in cores)
            assert cores[owner]["prefix_cache"]["hits"] == hits[str(owner)]
            assert cores[owner]["grid"].count("c") >= 4  # the shared prefix stays cached

    finally:
        client.shutdown()


def _first_event(lines: Iterator[str]) -> str:
    return next(line for line in lines if line.startswith("data: {"))


@pytest.mark.slow  # two engine processes start: half a minute on a busy CPU
def test_dp2_a_dead_core_ends_the_server(model_dir: Path) -> None:
    config = EngineConfig.from_kwargs(
        **engine_kwargs(model_dir, max_model_len=1024, num_blocks=128),
        data_parallel_size=2,
        data_parallel_routing="round_robin",
    )
    client = AsyncEngine.launch(config, engine_threads=2)
    body = {
        "model": MODEL,
        "prompt": [5, 6, 7],
        "max_tokens": 1000,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        app = build_app(client, MODEL)
        watchdog = Watchdog(client, 30, 1)
        with (
            ServeThread(app, client, shutdown_timeout=1, watchdog=watchdog) as srv,
            httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as one,
            httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as two,
        ):
            lines = [one.iter_lines(), two.iter_lines()]
            for it in lines:  # both generating, one on each core (round robin)
                assert _first_event(it)
            assert client.client.router.inflight == [1, 1]  # type: ignore[attr-defined]
            victim = client.client.clients[1]  # type: ignore[attr-defined]
            os.kill(victim.process.pid, signal.SIGKILL)
            # The victim's request and the other core's both end with an error event.
            for it in lines:
                rest = "\n".join(it)
                assert '"code": 503' in rest and rest.rstrip().endswith("data: [DONE]")
            assert srv.wait(20) == 1
        assert "data-parallel engine core 1 of 2 stopped" in str(client.dead_error)
        assert "exited unexpectedly" in str(client.dead_error)
        assert client.is_dead
    finally:
        client.shutdown()


def _probe(tokens: list[int]):
    from pagemill.runtime.engine.protocol import EngineCoreRequest

    return EngineCoreRequest("probe", tokens, SamplingParams(), 1, None, [], 0.0)
