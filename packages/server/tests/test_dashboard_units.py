"""The dashboard's pieces one by one: picture, events, chart buckets, rate limit, key, flags."""

from __future__ import annotations

import base64
import json
from types import SimpleNamespace

import pytest

from pagemill.blockpool import KVCacheManager
from pagemill.scheduler import Request, RequestStatus, Scheduler
from pagemill.scheduler.config import SchedulerConfig
from pagemill.server.cli import build_parser, dashboard_enabled
from pagemill.server.dashboard import DashboardSettings, LocalWatchers, SnapshotTap
from pagemill.server.dashboard.events import events_between
from pagemill.server.dashboard.series import SeriesRecorder
from pagemill.server.dashboard.snapshot import snapshot_scheduler
from pagemill.server.entrypoints.openai.auth import basic_key_matches

PREFIX = list(range(1, 33))  # two full blocks


def _scheduler(num_blocks: int = 16, **cfg: int) -> Scheduler:
    kv = KVCacheManager(num_blocks, 16, enable_caching=True)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_model_len=512, **cfg), kv)


def _step(s: Scheduler) -> None:
    out = s.schedule()
    s.update_from_output(out, {r.request_id: 5 for r in out.scheduled if r.sample})


def test_picture_of_shared_prefix_then_all_free() -> None:
    s = _scheduler()
    s.add_request(Request("a", [*PREFIX, 90, 91], max_tokens=4, ignore_eos=True))
    _step(s)
    s.add_request(Request("b", [*PREFIX, 80], max_tokens=4, ignore_eos=True))
    _step(s)
    snap = snapshot_scheduler(s, now=1.0)
    json.dumps(snap)  # JSON-able as is
    a, b = snap["running"]
    assert a["blocks"][:2] == b["blocks"][:2]
    assert snap["grid"][a["blocks"][0]] == "2" and snap["grid"][a["blocks"][1]] == "2"
    assert snap["shared"] == 2 and snap["in_use"] == len(set(a["blocks"]) | set(b["blocks"]))
    assert b["cached_tokens"] == 32 and b["phase"] == "decode" and a["status"] == "running"
    assert snap["prefix_cache"]["hits"] == 32 and snap["t"] == 1.0
    s.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    end = snapshot_scheduler(s)
    assert end["in_use"] == 0 and not end["running"]
    assert end["grid"].count("c") == end["evictable"] == 2  # the full prefix blocks stay cached
    assert set(end["grid"]) == {".", "c"}


def test_waiting_rows_are_capped_and_the_grid_too() -> None:
    s = _scheduler(num_blocks=40, max_num_seqs=1)
    for i in range(5):
        s.add_request(Request(f"w{i}", [i + 1] * 20, max_tokens=2))
    _step(s)
    snap = snapshot_scheduler(s, max_waiting=2, max_grid_blocks=10)
    assert [r["id"] for r in snap["waiting"]] == ["w1", "w2"]
    assert snap["num_waiting"] == 4 and "blocks" not in snap["waiting"][0]
    assert len(snap["grid"]) == 10 and snap["num_blocks"] == 40
    assert snap["running"][0]["phase"] == "decode"


def test_ref_counts_of_ten_and_more_are_plus() -> None:
    s = _scheduler(num_blocks=64, max_num_seqs=12)
    s.add_request(Request("r0", [*PREFIX, 1], max_tokens=8, ignore_eos=True))
    _step(s)
    for i in range(1, 11):
        s.add_request(Request(f"r{i}", [*PREFIX, 100 + i], max_tokens=8, ignore_eos=True))
    _step(s)
    assert snapshot_scheduler(s)["grid"][:2] == "++"


def test_events_name_the_preempted_and_count_evictions() -> None:
    base = {
        "t": 0.0,
        "preemptions": 1,
        "evictions": 4,
        "running": [{"id": "x", "preemptions": 1}],
        "waiting": [{"id": "y", "preemptions": 0}],
    }
    cur = {
        "t": 1.0,
        "preemptions": 3,
        "evictions": 6,
        "running": [{"id": "x", "preemptions": 1}],
        "waiting": [{"id": "y", "preemptions": 1}, {"id": "z", "preemptions": 1}],
    }
    assert events_between(None, cur) == []
    pre, ev = events_between(base, cur)
    assert pre == {"t": 1.0, "kind": "preempt", "count": 2, "ids": ["y", "z"]}
    assert ev == {"t": 1.0, "kind": "evict", "count": 2}
    assert events_between(cur, cur) == []


def test_a_real_eviction_is_counted_by_the_pool() -> None:
    s = _scheduler(num_blocks=4)
    s.add_request(Request("a", PREFIX, max_tokens=1, ignore_eos=True))  # caches one block
    _step(s)
    _step(s)
    assert not s.has_unfinished_requests()
    cached = snapshot_scheduler(s)
    assert cached["evictable"] >= 1
    s.add_request(Request("b", list(range(500, 560)), max_tokens=1))  # needs every block
    _step(s)
    assert snapshot_scheduler(s)["evictions"] == cached["evictable"]


def _stats(running: int = 2, kv: float = 0.5) -> SimpleNamespace:
    return SimpleNamespace(num_running=running, num_waiting=1, kv_cache_usage=kv)


def _it(
    gen: int = 2, ttft: tuple[float, ...] = (), itl: tuple[float, ...] = (0.01,)
) -> SimpleNamespace:
    return SimpleNamespace(
        num_generation_tokens=gen,
        num_prompt_tokens=0,
        time_to_first_tokens=list(ttft),
        inter_token_latencies=list(itl),
    )


def test_series_buckets_and_gaps() -> None:
    rec = SeriesRecorder(bucket_s=0.5)
    assert rec.add_step(_stats(), _it(ttft=(0.2,)), 0.01, now=10.0) == []
    assert rec.add_step(_stats(4), _it(), 0.03, now=10.2) == []
    (p,) = rec.add_step(_stats(), _it(), 0.01, now=10.6)
    assert p["t"] == 10.5 and p["tok_s"] == 8.0 and p["batch"] == 3.0 and p["steps"] == 2
    assert p["ttft"] == 200.0 and p["itl"] == 10.0 and p["step_ms"] == 20.0 and p["kv"] == 50.0
    assert rec.flush(now=10.7) == []
    closed = rec.flush(now=12.0)  # idle since 10.6: the bucket closes, then a gap
    assert closed[0]["t"] == 11.0 and closed[1] == {"t": 11.5, "gap": True}
    assert rec.flush(now=20.0) == []
    assert rec.add_step(_stats(), _it(gen=0, itl=()), 0.01, now=30.0) == []  # a fresh bucket
    assert [x.get("gap", False) for x in rec.history()] == [False, False, True]


class _Engine:
    def __init__(self, busy: bool) -> None:
        self.busy = busy
        self.scheduler = _scheduler()

    def has_unfinished_requests(self) -> bool:
        return self.busy


def test_tap_takes_nothing_unwatched_and_is_rate_limited() -> None:
    watchers = LocalWatchers()
    tap = SnapshotTap(DashboardSettings(interval_s=60), watchers)
    engine = _Engine(busy=True)
    assert tap.poll(engine) is None and tap.num_snapshots == 0  # nobody watches
    watchers.value = 1
    first = tap.poll(engine)
    assert first is not None and first["cost_us"] >= 0
    assert tap.poll(engine) is None  # within the interval
    engine.busy = False
    assert tap.poll(engine) is not None  # going idle: one more, so the page is not stale
    assert tap.num_snapshots == 2
    with pytest.raises(ValueError):
        DashboardSettings(interval_s=0)


def test_basic_auth_takes_the_key_as_password() -> None:
    def basic(text: str) -> str:
        return "Basic " + base64.b64encode(text.encode()).decode()

    assert basic_key_matches(basic("anyone:k3y"), "k3y")
    assert basic_key_matches(basic(":k3y"), "k3y")
    assert not basic_key_matches(basic("anyone:nope"), "k3y")
    assert not basic_key_matches(basic("k3y"), "k3y")  # no colon
    assert not basic_key_matches("Basic %%%", "k3y")
    assert not basic_key_matches("Bearer k3y", "k3y")


def test_dashboard_flags() -> None:
    args = build_parser().parse_args(["serve"])
    assert args.dashboard is None and args.dashboard_interval == 0.25
    assert not args.dashboard_show_prompts
    assert dashboard_enabled(None, "127.0.0.1", None)
    assert not dashboard_enabled(None, "0.0.0.0", None)
    assert dashboard_enabled(None, "0.0.0.0", "key")
    assert not dashboard_enabled(False, "127.0.0.1", None)
    assert dashboard_enabled(True, "0.0.0.0", None)
    args = build_parser().parse_args(
        ["serve", "--no-dashboard", "--dashboard-show-prompts", "--dashboard-interval", "0.1"]
    )
    assert args.dashboard is False and args.dashboard_show_prompts
    assert args.dashboard_interval == 0.1
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--dashboard-interval", "0"])


def test_a_page_stream_ends_when_the_hub_closes() -> None:
    import asyncio

    from pagemill.server.dashboard import DashboardHub
    from pagemill.server.dashboard.routes import feed

    async def main() -> list[str]:
        hub = DashboardHub()
        chunks: list[str] = []

        async def read() -> None:
            async for chunk in feed(hub):
                chunks.append(chunk)

        task = asyncio.ensure_future(read())
        while hub.watchers.value != 1:
            await asyncio.sleep(0.01)
        hub.publish_snapshot(
            {"t": 1.0, "preemptions": 0, "evictions": 0, "running": [], "waiting": []}
        )
        await asyncio.sleep(0.05)
        hub.close()  # server shutdown: the stream must end, not hold the drain open
        await asyncio.wait_for(task, 2)
        assert hub.watchers.value == 0
        assert [c async for c in feed(hub)] == []  # a page arriving after the close
        return chunks

    chunks = asyncio.run(main())
    assert chunks[0].startswith("event: init\n") and chunks[1].startswith("event: snapshot\n")


def test_replay_recording_of_a_simulated_run(tmp_path) -> None:
    import base64
    import gzip
    import re

    from pagemill.server.dashboard.replay import ReplayRecorder, write_replay_html
    from pagemill.server.sim import Deployment, PagedSimulator, load_gpu, load_model
    from pagemill.server.sim.workload import LengthDist, WorkloadSpec, generate_workload

    dep = Deployment(
        load_model("smollm2-135m"),
        load_gpu("rtx-4090"),
        max_model_len=512,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        num_blocks=64,
    )
    reqs = generate_workload(
        WorkloadSpec(
            num_requests=20,
            prompt_len=LengthDist(64),
            output_len=LengthDist(40),
            system_prompt_len=64,
        ),
        512,
    )
    rec = ReplayRecorder("run", max_frames=8, frame_dt=1e-4)
    result = PagedSimulator(dep, observer=rec).run(reqs)
    run = rec.as_dict()
    assert 2 <= len(run["frames"]) <= 9
    assert run["frames"][-1]["in_use"] == 0  # every block free at the end
    assert any(f["in_use"] for f in run["frames"])
    assert run["series"] and sum(p["tok_s"] for p in run["series"]) > 0
    if result.num_preemptions:
        assert any(e["kind"] == "preempt" for e in run["events"])
    html = write_replay_html(tmp_path / "r.html", [run], "tiny <test>")
    text = html.read_text()
    assert "<title>pagemill simulation: tiny &lt;test&gt;</title>" in text
    blob = re.search(r'id="pagemill-replay">([^<]*)<', text).group(1)
    data = json.loads(gzip.decompress(base64.b64decode(blob)))
    assert data["config"] == {"mode": "replay", "title": "tiny <test>"}
    assert data["runs"][0]["frames"][-1]["grid"] == run["frames"][-1]["grid"]


def test_the_hub_keeps_the_newest_picture_and_names_what_happened() -> None:
    from pagemill.server.dashboard import DashboardHub

    hub = DashboardHub()

    def pic(t: float, preemptions: int) -> dict:
        return {
            "t": t,
            "preemptions": preemptions,
            "evictions": 0,
            "waiting": [],
            "running": [{"id": "x", "preemptions": preemptions}],
        }

    hub.publish_snapshot(pic(1.0, 0))
    hub.publish_snapshot(pic(3.0, 1))
    hub.publish_snapshot(pic(2.0, 0))  # older (taken on demand, delivered late): dropped
    hub.publish_snapshot(pic(4.0, 1))
    assert hub.latest is not None and hub.latest["t"] == 4.0
    assert [(e["kind"], e["count"], e["ids"]) for e in hub.events] == [("preempt", 1, ["x"])]


@pytest.mark.parametrize("show", [True, False])
def test_prompts_are_joined_on_the_api_side_only_when_asked(show: bool) -> None:
    """The engine core holds no text (a picture from a core process has ids only): with
    --dashboard-show-prompts the hub adds each row's prompt from the front end."""
    from pagemill.server.dashboard import DashboardHub

    s = _scheduler()
    s.add_request(Request("r-1", [*PREFIX, 7], max_tokens=4, ignore_eos=True))
    s.add_request(Request("r-2", [*PREFIX, 8], max_tokens=4, ignore_eos=True))
    _step(s)
    picture = snapshot_scheduler(s, now=1.0)  # what the core sends: no prompt text
    assert all("prompt" not in row for row in picture["running"] + picture["waiting"])
    prompts = {"r-1": "the first prompt " * 40, "r-2": None}  # r-2 was sent as token ids
    client = SimpleNamespace(prompt_of=prompts.get, dashboard_watchers=LocalWatchers())
    hub = DashboardHub(DashboardSettings(show_prompts=show))
    hub.attach(client)
    hub.publish_snapshot(picture)
    assert hub.latest is not None
    rows = {row["id"]: row for row in hub.latest["running"] + hub.latest["waiting"]}
    if show:
        assert rows["r-1"]["prompt"] == prompts["r-1"][:240]
    else:
        assert "prompt" not in rows["r-1"]
    assert "prompt" not in rows["r-2"]


def test_data_parallel_cores_keep_their_own_pools_in_one_picture() -> None:
    """Two cores' pictures (tagged by the client with their engine index) become one: each
    core's grid and figures under `cores`, totals where one core's figures go, every row and
    event naming its core; a late picture of one core does not replace its newer one."""
    from pagemill.server.dashboard import DashboardHub

    s0, s1 = _scheduler(num_blocks=16), _scheduler(num_blocks=24)
    s0.add_request(Request("a", [*PREFIX, 90], max_tokens=4, ignore_eos=True))
    _step(s0)
    s0.add_request(Request("b", [*PREFIX, 80], max_tokens=4, ignore_eos=True))
    _step(s0)
    s1.add_request(Request("c", list(range(100, 140)), max_tokens=4, ignore_eos=True))
    _step(s1)
    one, two = snapshot_scheduler(s0, now=1.0), snapshot_scheduler(s1, now=1.5)
    hub = DashboardHub()
    hub.publish_snapshot({**one, "engine_index": 0})
    hub.publish_snapshot({**two, "engine_index": 1})
    snap = hub.latest
    assert snap is not None
    json.dumps(snap)
    assert [c["engine"] for c in snap["cores"]] == [0, 1]
    assert [c["grid"] for c in snap["cores"]] == [one["grid"], two["grid"]]
    assert snap["num_blocks"] == 40 and snap["in_use"] == one["in_use"] + two["in_use"]
    assert snap["shared"] == 2 and snap["cores"][1]["shared"] == 0
    assert snap["prefix_cache"]["hits"] == 32
    assert snap["prefix_cache"]["queries"] == (
        one["prefix_cache"]["queries"] + two["prefix_cache"]["queries"]
    )
    assert {(r["id"], r["engine"]) for r in snap["running"]} == {("a", 0), ("b", 0), ("c", 1)}
    assert snap["t"] == 1.5

    hub.publish_snapshot({**one, "t": 0.5, "engine_index": 0})  # older than core 0's: dropped
    assert hub.latest["cores"][0]["t"] == 1.0
    s1.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    later = snapshot_scheduler(s1, now=2.0)
    hub.publish_snapshot({**later, "preemptions": 1, "engine_index": 1})
    assert [(e["kind"], e["engine"]) for e in hub.events] == [("preempt", 1)]
    assert hub.latest["cores"][1]["in_use"] == 0 and hub.latest["in_use"] == one["in_use"]
