"""`pagemill simulate --replicas N --router ...`: N real schedulers and pools behind the
engine's own router, on a virtual clock (pagemill.server.sim.replicas)."""

from __future__ import annotations

import argparse
import base64
import gzip
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from pagemill.runtime.engine.dp_router import ROUTING_POLICIES
from pagemill.server.sim import (
    ROUTERS,
    ChatSpec,
    Deployment,
    LengthDist,
    PagedSimulator,
    ReplicaSimulator,
    WorkloadSpec,
    generate_chat_workload,
    generate_workload,
    load_gpu,
    load_model,
)
from pagemill.server.sim.cli import register

# Two pools of 100 blocks of 16 tokens; 6 documents of 400 tokens: they fit in two pools,
# not in one (the setting, where routing by prefix should pay).
SMALL = [
    "--model",
    "smollm2-135m",
    "--gpu",
    "rtx-4090",
    "--num-blocks",
    "100",
    "--max-model-len",
    "1024",
    "--system-prompt-len",
    "400",
    "--prompt-len",
    "24",
    "--output-len",
    "24",
    "--length-dist",
    "fixed",
    "--no-plots",
]


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pagemill")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


def small_deployment(**changes: object) -> Deployment:
    base = Deployment(
        load_model("smollm2-135m"),
        load_gpu("rtx-4090"),
        max_model_len=1024,
        max_num_batched_tokens=512,
        num_blocks=100,
    )
    return replace(base, **changes)


def test_routers_are_the_engines_policies() -> None:
    assert ROUTERS == ROUTING_POLICIES


def _table_rows(text: str, title: str) -> dict[str, list[str]]:
    """The rows of the table under `== title` (run name -> its cells)."""
    block = text.split(f"== {title}", 1)[1].split("\n\n", 1)[0]
    lines = block.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("run "))
    rows = {}
    for line in lines[header + 2 :]:
        if not line.strip() or " vs " in line or line.startswith(("requests", "(")):
            break
        name, cells = line[:28].strip(), line[28:].split()
        rows[name] = cells
    return rows


def test_cli_prefix_routing_beats_round_robin(capsys, tmp_path: Path) -> None:
    argv = ["simulate", *SMALL, "--replicas", "2", "--router", "all", "--seed", "3"]
    assert run([*argv, "--out-dir", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    results = json.loads((tmp_path / "a" / "results.json").read_text())["routing"]
    routers = results["routers"]
    assert list(routers) == list(ROUTERS) and results["replicas"] == 2
    n = results["num_requests"]
    assert n == 6 * 8 * 2  # the default chat: 6 prompts x 8 users x 2 turns
    for name, r in routers.items():
        total, reps = r["total"], r["replicas"]
        assert sum(r["routed"]) == n and total["num_finished"] == n
        assert [rep["num_finished"] for rep in reps] == r["routed"]
        queries, hits = sum(r["prefix_queries"]), sum(r["prefix_hits"])
        assert total["prefix_cache_hit_rate"] == pytest.approx(hits / queries)
        for rep, q, h in zip(reps, r["prefix_queries"], r["prefix_hits"], strict=True):
            assert rep["prefix_cache_hit_rate"] == pytest.approx(h / q)
        # The printed side-by-side table says what results.json says.
        cells = _table_rows(out, "routers side by side")[name]
        assert int(cells[0]) == n
        assert int(cells[-3].replace(",", "")) == total["prompt_tokens_computed"]
        assert cells[-2] == f"{total['prefix_cache_hit_rate']:.0%}"
    rr, px = routers["round_robin"], routers["prefix"]
    rr_hit, px_hit = rr["total"]["prefix_cache_hit_rate"], px["total"]["prefix_cache_hit_rate"]
    assert px_hit >= rr_hit + 0.3, (rr_hit, px_hit)
    rr_prefill = sum(rr["prefix_queries"]) - sum(rr["prefix_hits"])
    px_prefill = sum(px["prefix_queries"]) - sum(px["prefix_hits"])
    assert px_prefill <= 0.6 * rr_prefill, (rr_prefill, px_prefill)
    assert max(px["routed"]) <= 1.5 * min(px["routed"])
    # Less prefill to compute, so the first tokens come no later.
    assert px["total"]["ttft_mean_s"] < rr["total"]["ttft_mean_s"]
    m = re.search(r"prefix vs round_robin: prefix hit rate (\d+)% vs (\d+)%", out)
    assert m and (int(m[1]), int(m[2])) == (round(px_hit * 100), round(rr_hit * 100))
    # Deterministic: the same seed, the same figures.
    assert run([*argv, "--out-dir", str(tmp_path / "b")]) == 0
    again = json.loads((tmp_path / "b" / "results.json").read_text())["routing"]
    assert again == results


def test_cli_refuses_bad_router_and_replicas(capsys, tmp_path: Path) -> None:
    for bad in (["--router", "fastest"], ["--router", "prefix,bogus"], ["--replicas", "0"]):
        with pytest.raises(SystemExit):
            run(["simulate", *SMALL, "--replicas", "2", *bad])
        err = capsys.readouterr().err
        assert f"argument {bad[0]}" in err, err
    assert run(["simulate", *SMALL, "--router", "prefix", "--out-dir", str(tmp_path)]) == 2
    assert "--router needs --replicas" in capsys.readouterr().err
    both = ["--replicas", "2", "--experiments", "static", "--out-dir", str(tmp_path)]
    assert run(["simulate", *SMALL, *both]) == 2
    assert "--experiments" in capsys.readouterr().err
    # A system prompt that leaves no room for the chat is refused, not clipped.
    too_long = ["--replicas", "2", "--system-prompt-len", "1023", "--out-dir", str(tmp_path)]
    assert run(["simulate", *SMALL, *too_long]) == 2
    assert "--system-prompt-len" in capsys.readouterr().err


def _recording(page: str) -> dict:
    blob = re.search(r'<script type="application/json" id="pagemill-replay">([^<]+)<', page)
    assert blob
    return json.loads(gzip.decompress(base64.b64decode(blob[1])))


def test_cli_html_has_each_routers_section_and_replicas(capsys, tmp_path: Path) -> None:
    page_path = tmp_path / "routing.html"
    argv = ["simulate", *SMALL, "--replicas", "3", "--router", "round_robin,prefix"]
    argv += ["--users-per-prefix", "2", "--out-dir", str(tmp_path), "--html", str(page_path)]
    assert run(argv) == 0
    assert f"wrote {page_path}" in capsys.readouterr().out
    page = page_path.read_text()
    sections = re.findall(r'<section class="router" id="router-(\w+)"', page)
    assert sections == ["round_robin", "prefix"]
    assert 'id="router-least_loaded"' not in page
    assert "dashboard/static/" not in page and "<script src=" not in page  # self-contained
    rec = _recording(page)
    assert [r["name"] for r in rec["runs"]] == ["router round_robin", "router prefix"]
    for r in rec["runs"]:
        assert r["frames"] and r["series"]
        assert all(len(f["cores"]) == 3 for f in r["frames"])
        last = r["frames"][-1]
        assert last["in_use"] == 0 and not last["running"]  # every request finished


def test_one_replica_is_the_one_engine_simulator() -> None:
    d = small_deployment(num_blocks=256)
    spec = WorkloadSpec(
        num_requests=40,
        prompt_len=LengthDist(48),
        output_len=LengthDist(24),
        request_rate=300.0,
        system_prompt_len=64,
        seed=5,
    )
    requests = generate_workload(spec, d.max_model_len)
    one = PagedSimulator(d, name="x").run(requests)
    for router in ROUTERS:
        got = ReplicaSimulator.for_deployment(d, 1, router).run(requests)
        assert replace(got.total, name="x") == one
        assert got.routed == [40]


def test_turns_wait_for_the_turn_before_and_pools_end_empty() -> None:
    d = small_deployment()
    spec = ChatSpec(prefixes=2, prefix_len=64, users_per_prefix=3, turns=3, seed=1)
    requests = generate_chat_workload(spec, d.max_model_len)
    assert len(requests) == spec.num_requests == 18
    finish: dict[str, float] = {}
    sent: dict[str, float] = {}

    def observe(clock, scheds, k, updates, dt) -> None:
        for u in updates:
            req = scheds[k].get_request(u.request_id)
            if req is not None:
                sent.setdefault(u.request_id, req.arrival_time)
            if u.finished:
                finish[u.request_id] = clock

    sim = ReplicaSimulator.for_deployment(d, 2, "prefix", observer=observe)
    result = sim.run(requests)
    assert result.total.num_finished == 18
    for r in requests:
        if r.after is not None:
            assert sent[r.request_id] >= finish[r.after]
    for s in sim.schedulers:
        kv = s.kv_cache_manager
        assert kv.get_num_free_blocks() == kv.num_blocks
        assert not s.has_unfinished_requests()
    # The router's view of each replica is the pool's own cached-hash index.
    for k, s in enumerate(sim.schedulers):
        assert sim.router.cached[k] == set(s.kv_cache_manager.block_pool.cached_block_hash_to_block)


def test_chat_workload_extends_each_users_history() -> None:
    spec = ChatSpec(prefixes=3, prefix_len=40, users_per_prefix=4, turns=3, seed=2)
    requests = generate_chat_workload(spec)
    by_id = {r.request_id: r for r in requests}
    assert len({r.prompt_token_ids[:40] for r in requests}) == 3
    for r in requests:
        if r.after is None:
            continue
        before = by_id[r.after]
        assert before.index < r.index and before.user == r.user and before.group == r.group
        # The turn before, its answer, then a new message.
        n = before.prompt_len + before.output_len
        assert r.prompt_token_ids[: before.prompt_len] == before.prompt_token_ids
        assert r.prompt_len > n
    with pytest.raises(ValueError, match="max_model_len"):
        generate_chat_workload(spec, max_model_len=100)
