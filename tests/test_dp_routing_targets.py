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
