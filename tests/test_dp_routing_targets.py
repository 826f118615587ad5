"""The `prefix` routing policy's targets (issue 29), on the real router in front of real
schedulers and block pools fed by their own KV events (`benchmarks/dp_prefix_routing.py
--simulate`: no model, deterministic, a second or two a run).

Shared-prefix chat (6 system prompts of 400 tokens, 8 users each, 2 turns; 2 cores of 100
blocks of 16: the prefixes fit in two pools, not in one): `prefix` beats `round_robin`'s
prefix-cache hit rate by at least 0.3 and computes at most 0.6x its prefill tokens. One
shared prompt for everyone: `prefix` keeps the cores' request counts within 1.5x.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "dp_prefix_routing.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dp_prefix_routing", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("seed", [0, 1])
def test_prefix_routing_beats_round_robin_on_shared_prefixes(bench: ModuleType, seed: int) -> None:
    workload = bench.chat_workload(prefixes=6, prefix_len=400, users_per_prefix=8, seed=seed)
    assert len({t.prefix for t in workload}) == 6 and len(workload) == 96
    rr = bench.simulate(workload, "round_robin", cores=2, pool_blocks=100)
    px = bench.simulate(workload, "prefix", cores=2, pool_blocks=100)
    assert px["prefix_hit_rate"] >= rr["prefix_hit_rate"] + 0.3, (rr, px)
    assert px["prefill_tokens_computed"] <= 0.6 * rr["prefill_tokens_computed"], (rr, px)
    assert max(px["routed"]) <= 1.5 * min(px["routed"]), px


@pytest.mark.parametrize("arrivals", [1, 4])
def test_prefix_routing_stays_balanced_on_one_prefix(bench: ModuleType, arrivals: int) -> None:
    workload = bench.chat_workload(prefixes=1, prefix_len=400, users_per_prefix=48, seed=3)
    px = bench.simulate(workload, "prefix", cores=2, pool_blocks=100, arrivals_per_tick=arrivals)
    assert max(px["routed"]) <= 1.5 * min(px["routed"]), px
    # Nothing to keep apart: both cores cache the one prompt and hit it.
    assert min(px["per_engine_hit_rate"]) > 0.8, px


def test_the_workload_is_chats_on_shared_documents(bench: ModuleType) -> None:
    workload = bench.chat_workload(prefixes=3, prefix_len=40, users_per_prefix=4, turns=3)
    by_user: dict[int, list[list[int]]] = {}
    for t in workload:
        by_user.setdefault(t.user, []).append(t.prompt)
    assert len(by_user) == 12 and all(len(p) == 3 for p in by_user.values())
    for prompts in by_user.values():  # each turn extends the conversation before it
        assert all(b[: len(a)] == a and len(b) > len(a) for a, b in itertools.pairwise(prompts))
    systems = {tuple(t.prompt[:40]) for t in workload}
    assert len(systems) == 3


class _Core:
    """An engine-core client stand-in: takes requests, answers nothing until shut down."""

    def __init__(self, config: object, **_: object) -> None:
        import queue

        from pagemill.runtime.engine.protocol import EngineCoreReady

        self.info = EngineCoreReady(1024, 100, 16, "float32", "cpu", 0)
        self.q: queue.SimpleQueue[BaseException] = queue.SimpleQueue()
        self.dead_error = None
        self.on_event = None

    def add_request(self, request: object) -> None:
        pass

    def get_output(self, timeout: float | None = None) -> None:
        raise self.q.get()

    def shutdown(self, timeout: float = 10.0) -> None:
        from pagemill.runtime.engine.core_client import EngineDeadError

        self.q.put(EngineDeadError("shut down"))


def test_the_routing_log_meets_what_the_cores_reported(
    bench: ModuleType, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`--launch`'s evidence: the client's routing lines parse, and are set against each
    request's cached tokens (a prefix the router counted on that core, reported missed,
    is the router's belief gone wrong: eviction, or an index out of date)."""
    import json
    import logging

    from pagemill.runtime.config import EngineConfig
    from pagemill.runtime.engine.dp_client import DPClient
    from pagemill.runtime.engine.protocol import EngineCoreRequest
    from pagemill.runtime.sampling_params import SamplingParams

    doc = list(range(100, 132))  # two blocks of 16
    prompts = {"a": [*doc, 1], "b": [*doc, 2], "c": list(range(200, 233))}
    client = DPClient(
        EngineConfig(data_parallel_size=2, data_parallel_routing="prefix"),
        engine_threads=2,
        client_factory=_Core,  # type: ignore[arg-type]
    )
    try:
        with caplog.at_level(logging.DEBUG, logger="pagemill.runtime.engine.dp_client"):
            for rid, prompt in prompts.items():
                client.add_request(
                    EngineCoreRequest(f"cmpl-{rid}-0", prompt, SamplingParams(), 4, None, [], 0.0)
                )
    finally:
        client.shutdown()
    log = tmp_path / "server.log"
    log.write_text("".join(r.getMessage() + "\n" for r in caplog.records))
    requests = tmp_path / "requests.jsonl"
    cached = {"a": 0, "b": 0, "c": 0}  # b shares a's document and core, but missed it
    group = {"a": 0, "b": 0, "c": 1}
    requests.write_text(
        "".join(
            json.dumps({"id": f"cmpl-{rid}", "cached_tokens": cached[rid], "prefix": group[rid]})
            + "\n"
            for rid in prompts
        )
    )
    report = bench.routing_report(log, requests, prefix_len=32, block_size=16)
    assert report == {
        "routed_lines": 3,
        "first_on_core": 2,
        "evicted": 1,
        "believed_cached_but_missed": 1,
        "cached_elsewhere_sent_cold": 0,
    }
    rows = [json.loads(line) for line in requests.read_text().splitlines()]
    assert rows[0]["core"] == rows[1]["core"] != rows[2]["core"]
    assert rows[1]["matched"][rows[1]["core"]] == 2
