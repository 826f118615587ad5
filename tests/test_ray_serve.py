"""pagemill on Ray Serve (`pagemill.server.ray_serve`): a local Ray, two engine replicas of a
tiny random Llama behind the OpenAI ingress, routed by `PagemillRequestRouter` (prefix).

A streamed chat through the `openai` client must arrive in pieces and equal the same
request answered whole; requests that share a long prompt must land on one replica (its
prefix-cache hits, read from the replicas themselves, cover the shared blocks).
Skipped, saying why, when Ray Serve is not installed (`pip install 'pagemill-server[ray]'`).
"""

from __future__ import annotations

import os
import socket
import time

import pytest
from server_helpers import build_tiny_llama, engine_kwargs

# A busy machine starts Ray's raylet, agents and workers slowly: its default waits are
# not always enough (the raylet then aborts, or the workers are never seen).
os.environ.setdefault("RAY_raylet_start_wait_time_s", "300")
os.environ.setdefault("RAY_worker_register_timeout_seconds", "600")
os.environ.setdefault("RAY_agent_register_timeout_ms", "600000")
# Read when Ray is imported. Under `uv run`, Ray starts each worker through `uv run` too
# (a fresh environment built from the uploaded project); this venv already is theirs.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

serve = pytest.importorskip(
    "ray.serve", reason="Ray Serve is not installed (pip install 'pagemill-server[ray]')"
)
openai = pytest.importorskip("openai")

MODEL = "tiny"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ray_app(tmp_path_factory: pytest.TempPathFactory):
    import ray

    from pagemill.server.ray_serve import build_serve_app

    folder = tmp_path_factory.mktemp("ray-llama")
    build_tiny_llama(folder)
    kwargs = engine_kwargs(folder, num_blocks=64)
    model = kwargs.pop("model")
    port = _free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_serve_app(
            model,
            num_replicas=2,
            routing="prefix",
            served_model_name=MODEL,
            engine_threads=1,
            num_cpus=0.5,
            **kwargs,
        )
        serve.run(app, name="pagemill", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.mark.slow  # a local Ray and three Serve replicas start: about a minute
def test_two_replicas_stream_a_chat_and_route_by_prefix(ray_app: str) -> None:
    client = openai.OpenAI(base_url=ray_app + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "hello world, tell me a story"}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0
    )
    answer = whole.choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True
    )
    pieces, finish = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert len([p for p in pieces if p]) > 1  # streamed, not one block
    assert "".join(pieces) == answer
    assert finish == whole.choices[0].finish_reason == "length"

    # Four requests sharing 4 blocks of prompt: prefix routing keeps them on one replica,
    # whose prefix cache then serves the shared blocks to the three that follow.
    shared = list(range(20, 84))
    for tail in ([3], [4], [5], [6]):
        r = client.completions.create(
            model=MODEL, prompt=[*shared, *tail], max_tokens=2, temperature=0
        )
        assert r.choices[0].finish_reason == "length"
        # Past the next poll of the replicas' routing stats (every 1 s): a poll taken before
        # this request's blocks were cached, arriving after it, replaces what the router
        # assumed cached with the stale account (on a loaded box the follow-ups then split
        # 2/2: hits 64/96). What this checks is the policy, not that race.
        time.sleep(2.5)
    from ray import serve as ray_serve

    from pagemill.server.ray_serve import routing_summary

    # Utility calls go to the least loaded replica, taking turns when both are idle.
    handle = ray_serve.get_deployment_handle("PagemillEngine", app_name="pagemill")
    by_replica = {}
    # A fresh handle may learn of the second replica a moment after the first (a loaded
    # box): keep asking until both have answered, within a bound.
    deadline = time.monotonic() + 120
    while len(by_replica) < 2 and time.monotonic() < deadline:
        summary = handle.call.remote(routing_summary).result(timeout_s=60)
        by_replica[summary["pid"]] = summary
        time.sleep(0.2)
    assert len(by_replica) == 2
    hits = sorted(s["prefix_cache_hits"] for s in by_replica.values())
    # Most of the shared blocks are served on one replica (round robin would split them
    # 64/64). Not all three: the router reads replicas' stats as of their last report, so
    # a follow-up can land on the other replica before the first one's blocks show there.
    assert hits[-1] >= 2 * 64 and hits[-1] > hits[0], hits

    # The ingress's /metrics reports the replicas' own figures (it runs no engine itself).
    import re

    import httpx

    text = httpx.get(ray_app + "/metrics", timeout=30).text

    def series(name: str) -> list[float]:
        pattern = rf"^{name}\{{[^}}]*\}} (\S+)$"
        return sorted(float(v) for v in re.findall(pattern, text, re.M))

    queries = sum(s["prefix_cache_queries"] for s in by_replica.values())
    assert series("pagemill:prefix_cache_hits_total") == [sum(hits)], text[:3000]
    assert series("pagemill:prefix_cache_queries_total") == [queries]
    # Per replica (`engine="i"`): each replica that has answered the ingress, with its own
    # figures (one that served only utility calls has not streamed its stats yet).
    per_replica = series("pagemill:engine_prefix_cache_hits_total")
    assert per_replica[-1] == hits[-1] and set(per_replica) <= set(hits), (per_replica, hits)
    assert sum(per_replica) == sum(hits)
    assert series("vllm:prefix_cache_hits_total") == per_replica


def _pending(rid: str, tokens: list[int]):
    from types import SimpleNamespace

    from pagemill.runtime.engine.protocol import EngineCoreRequest
    from pagemill.runtime.sampling_params import SamplingParams

    request = EngineCoreRequest(rid, tokens, SamplingParams(), 4, None, [], 0.0)
    return SimpleNamespace(
        args=[request], kwargs={}, metadata=SimpleNamespace(internal_request_id=rid)
    )


def test_the_request_router_follows_replicas_prefix_caches() -> None:
    """The Serve router alone (no cluster): replicas' routing stats say what they cache."""
    import asyncio
    from types import SimpleNamespace

    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

    from pagemill.blockpool import hash_block_chain
    from pagemill.blockpool.hashing import get_hash_fn
    from pagemill.server.ray_serve import PagemillRequestRouter

    dep = DeploymentID(name="PagemillEngine", app_name="pagemill")
    doc, other = list(range(100, 164)), list(range(300, 364))
    cached = hash_block_chain(get_hash_fn("sha256"), doc, 16)  # as the replica's pool holds it
    a = SimpleNamespace(replica_id=ReplicaID("a", dep), routing_stats={})
    b = SimpleNamespace(
        replica_id=ReplicaID("b", dep),
        routing_stats={"cached_block_hashes": cached, "kv_cache_usage": 0.2},
    )
    router = PagemillRequestRouter(deployment_id=dep, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(policy="prefix", block_size=16, hash_algo="sha256")

    def choose(pending) -> list[str]:
        ranks = asyncio.run(router.choose_replicas([a, b], pending))
        return [r.replica_id.unique_id for rank in ranks for r in rank]

    assert choose(_pending("r1", [*doc, 1])) == ["b", "a"]  # b caches the document
    assert choose(_pending("r2", [*other, 2])) == ["a", "b"]  # unknown: the less loaded
    # r2's prompt is in flight on a, not yet in a's stats: its next reader follows it.
    assert choose(_pending("r3", [*other, 3])) == ["a", "b"]
    assert router.policy.inflight == [2, 1]
    router.on_request_completed(b.replica_id, "r1")
    router.on_request_completed(a.replica_id, "r2")
    router.on_request_completed(a.replica_id, "r3")
    assert router.policy.inflight == [0, 0]
    # Finished, not yet in a's polled stats: still taken as cached on a.
    assert choose(_pending("r5", [*other, 5])) == ["a", "b"]
    router.on_request_completed(a.replica_id, "r5")
    a.routing_stats = {"cached_block_hashes": [], "kv_cache_usage": 0.0}  # a's next poll
    k = router._engine(a)  # takes the new account in
    assert router.policy.matched_blocks(k, router.policy.hash_prompt(other)) == 0
    # Chosen b, but b turned it away and a ran it: counted on a.
    pending = _pending("r4", [*doc, 4])
    assert choose(pending) == ["b", "a"]
    router.on_request_routed(pending, a.replica_id, None)
    assert router.policy.inflight == [1, 0]


def test_a_poll_taken_before_a_request_finished_keeps_its_prompt_cached() -> None:
    """A replica's stats are a snapshot taken before they reach the router: a request that
    finished after it stays counted as cached there until a poll names it as finished
    (then the replica's own account decides), or for UNCONFIRMED_POLLS polls at most."""
    import asyncio
    from types import SimpleNamespace

    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

    from pagemill.server.ray_serve import UNCONFIRMED_POLLS, PagemillRequestRouter

    dep = DeploymentID(name="PagemillEngine", app_name="pagemill")
    doc = list(range(500, 564))
    a = SimpleNamespace(replica_id=ReplicaID("a", dep), routing_stats={})
    b = SimpleNamespace(replica_id=ReplicaID("b", dep), routing_stats={})
    router = PagemillRequestRouter(deployment_id=dep, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(policy="prefix", block_size=16, hash_algo="sha256")

    def choose(pending) -> list[str]:
        ranks = asyncio.run(router.choose_replicas([a, b], pending))
        return [r.replica_id.unique_id for rank in ranks for r in rank]

    def poll(replica, finished: list[str]) -> int:
        # A new dict each time, as each poll of Serve's brings.
        replica.routing_stats = {
            "cached_block_hashes": [],
            "kv_cache_usage": 0.0,
            "finished_request_ids": finished,
        }
        return router._engine(replica)

    hashes = router.policy.hash_prompt(doc)
    first = choose(_pending("r1", [*doc, 1]))[0]
    replica = a if first == "a" else b
    router.on_request_completed(replica.replica_id, "r1")
    # The engine's own id of the request: `_pending` builds it with the same id.
    k = poll(replica, [])  # its snapshot predates r1's end
    assert router.policy.matched_blocks(k, hashes) == len(hashes)
    assert choose(_pending("r2", [*doc, 2]))[0] == first  # the next reader follows it
    router.on_request_completed(replica.replica_id, "r2")
    k = poll(replica, ["r1", "r2"])  # a snapshot after both: they were evicted since
    assert router.policy.matched_blocks(k, hashes) == 0
    # Never named (it fell out of the replica's list): kept for a few polls only.
    choose(_pending("r3", [*doc, 3]))
    router.on_request_completed(replica.replica_id, "r3")
    for _ in range(UNCONFIRMED_POLLS - 1):
        assert router.policy.matched_blocks(poll(replica, []), hashes) == len(hashes)
    assert router.policy.matched_blocks(poll(replica, []), hashes) == 0


def test_a_replicas_routing_stats_name_the_requests_finished_before_them() -> None:
    """`record_routing_stats` reads the finished ids before the core's snapshot (so each
    one named had finished when the snapshot was taken)."""
    import asyncio
    import collections
    import concurrent.futures
    from types import SimpleNamespace

    from pagemill.server.ray_serve import FINISHED_IDS_KEPT, EngineReplica

    replica = EngineReplica.__new__(EngineReplica)  # no engine: a client that answers calls
    replica._finished = collections.deque(["r1", "r2"], maxlen=FINISHED_IDS_KEPT)

    def call(fn):
        replica._finished.append("r3")  # finishes while the core takes the snapshot
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result({"cached_block_hashes": [], "kv_cache_usage": 0.0})
        return done

    replica.client = SimpleNamespace(call=call, shutdown=lambda timeout: None)
    stats = asyncio.run(replica.record_routing_stats())
    assert stats["finished_request_ids"] == ["r1", "r2"]
    assert stats["cached_block_hashes"] == []


def test_the_ingress_client_carries_the_replicas_stats() -> None:
    """The ingress runs no engine: its /metrics figures are the replicas' own, as each
    replica's stream reports them (summed, and per replica under `engine="i"`)."""
    import asyncio
    from types import SimpleNamespace

    from pagemill.runtime.engine.protocol import EngineCoreOutput, SchedulerStats
    from pagemill.server.metrics import EngineMetrics
    from pagemill.server.ray_serve import ReplicaOutputs, ServeEngineClient

    def stats(running: int, queries: int, hits: int) -> SchedulerStats:
        return SchedulerStats(
            num_running=running,
            kv_cache_usage=0.5,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            num_blocks=64,
        )

    streams = {
        "r1": [ReplicaOutputs("A", [EngineCoreOutput("r1", [7])], stats(1, 80, 0))],
        "r2": [
            ReplicaOutputs("B", [EngineCoreOutput("r2", [8])], None),  # before B's first step
            ReplicaOutputs("B", [EngineCoreOutput("r2", [9])], stats(2, 64, 48)),
        ],
        "r3": [ReplicaOutputs("A", [EngineCoreOutput("r3", [5])], stats(1, 160, 64))],
    }

    class Response:
        def __init__(self, items: list) -> None:
            self.items = items

        async def _gen(self):
            for item in self.items:
                yield item

        def __aiter__(self):
            return self._gen()

    handle = SimpleNamespace()
    handle.options = lambda **_: handle
    handle.generate = SimpleNamespace(remote=lambda req: Response(streams[req.request_id]))
    client = ServeEngineClient(handle, SimpleNamespace(), None)  # type: ignore[arg-type]
    metrics = EngineMetrics("m")
    for rid in streams:
        asyncio.run(client._run(_pending(rid, [1, 2, 3]).args[0]))
        while (out := client.get_output(timeout=0)) is not None:
            if out.scheduler_stats is None:
                assert out.engine_index == 1  # B answered before its stats came
                continue
            view = SimpleNamespace(
                get_stats=lambda out=out: out.scheduler_stats,
                per_engine=client.core_stats,
                engine_index=out.engine_index,
                iteration_stats=None,
            )
            metrics.on_step(view, None)
    assert client.core_stats == [stats(1, 160, 64), stats(2, 64, 48)]
    text = metrics.render().decode()
    assert 'pagemill:prefix_cache_queries_total{model_name="m"} 224.0' in text
    assert 'pagemill:prefix_cache_hits_total{model_name="m"} 112.0' in text
    assert 'pagemill:num_requests_running{model_name="m"} 3.0' in text
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 64.0' in text
    assert 'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 48.0' in text
