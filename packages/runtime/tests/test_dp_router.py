"""The data-parallel router's policies on their own (no engine): fed KV events as the
cores would send them, and in-flight counts as the client keeps them."""

from __future__ import annotations

from pagemill.blockpool import hash_block_chain
from pagemill.blockpool.hashing import get_hash_fn
from pagemill.runtime.engine.dp_client import PREFIX_LOAD_MARGIN, DPRouter, combine_stats
from pagemill.runtime.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from pagemill.runtime.engine.protocol import EngineCoreRequest, SchedulerStats
from pagemill.runtime.sampling_params import SamplingParams

BS = 4


def _req(tokens: list[int], salt: str | None = None) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id="r",
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(),
        max_tokens=4,
        eos_token_id=None,
        stop_token_ids=[],
        arrival_time=0.0,
        cache_salt=salt,
    )


def _stored(tokens: list[int], salt: str | None = None) -> BlockStored:
    # Hashed independently of the router: the core's chain over full blocks.
    extra = () if salt is None else (salt,)
    n = len(tokens) // BS * BS
    hashes = hash_block_chain(get_hash_fn("sha256"), tokens[:n], BS, extra)
    return BlockStored(hashes, None, tokens[:n], BS, None, "GPU")


def test_prefix_goes_to_the_core_that_cached_it() -> None:
    r = DPRouter("prefix", 3, BS)
    prefix = list(range(100, 140))
    r.apply_events(2, [_stored(prefix)])
    r.apply_events(0, [_stored(prefix[:8])])
    assert r.choose(_req([*prefix, 1, 2, 3])) == 2
    # Another salt shares nothing with what was cached unsalted.
    assert r.matched_blocks(2, r.prompt_hashes(_req(prefix, salt="t"))) == 0
    # Removed and cleared blocks stop attracting.
    r.apply_events(2, [BlockRemoved(r.prompt_hashes(_req(prefix))[:1], "GPU")])
    assert r.choose(_req([*prefix, 9])) == 0
    r.apply_events(0, [AllBlocksCleared()])
    assert r.matched_blocks(0, r.prompt_hashes(_req(prefix))) == 0


def test_prefix_affinity_yields_to_load() -> None:
    r = DPRouter("prefix", 2, BS)
    prefix = list(range(40))
    r.apply_events(0, [_stored(prefix)])
    picks = []
    for _ in range(40):
        k = r.choose(_req([*prefix, 7]))
        picks.append(k)
        r.inflight[k] += 1
    counts = [picks.count(0), picks.count(1)]
    assert max(counts) <= 1.5 * min(counts), counts
    assert abs(r.inflight[0] - r.inflight[1]) <= PREFIX_LOAD_MARGIN + 1


def test_least_loaded_and_round_robin_balance() -> None:
    r = DPRouter("least_loaded", 3, BS)
    r.inflight = [5, 1, 3]
    assert r.choose(_req([1])) == 1
    r.inflight = [2, 2, 2]
    r.kv_usage = [0.5, 0.9, 0.1]
    assert r.choose(_req([1])) == 2
    r = DPRouter("least_loaded", 2, BS)
    picks = []
    for _ in range(10):
        k = r.choose(_req([1]))
        r.inflight[k] += 1
        picks.append(k)
    assert picks.count(0) == picks.count(1) == 5
    r = DPRouter("round_robin", 3, BS)
    r.alive[1] = False
    assert [r.choose(_req([1])) for _ in range(4)] == [0, 2, 0, 2]


def test_combined_stats_add_up() -> None:
    a = SchedulerStats(1, 2, 0.5, 10, 4, 1, 100, BS)
    b = SchedulerStats(3, 0, 0.0, 6, 2, 0, 300, BS)
    c = combine_stats([a, b])
    assert (c.num_running, c.num_waiting, c.num_blocks) == (4, 2, 400)
    assert (c.prefix_cache_queries, c.prefix_cache_hits) == (16, 6)
    assert c.kv_cache_usage == 0.125


class _FakeCore:
    """An EngineCoreClient stand-in: records requests, dies on demand."""

    def __init__(self, config, **_: object) -> None:
        import queue

        from pagemill.runtime.engine.protocol import EngineCoreReady

        self.info = EngineCoreReady(128, 10, BS, "float32", "cpu", 0)
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.added: list[str] = []
        self.dead_error = None
        self.on_event = None

    def add_request(self, request: EngineCoreRequest) -> None:
        self.added.append(request.request_id)

    def abort_requests(self, ids, reason=None) -> None:
        pass

    def call(self, fn):
        import concurrent.futures
        import threading

        fut: concurrent.futures.Future = concurrent.futures.Future()
        # Answered on another thread, as a core's reader thread answers.
        threading.Thread(target=lambda: fut.set_result(fn(self))).start()
        return fut

    def get_output(self, timeout=None):
        item = self.q.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def die(self) -> None:
        from pagemill.runtime.engine.core_client import EngineDeadError

        self.dead_error = RuntimeError("core gone")
        self.q.put(EngineDeadError("dead"))

    def shutdown(self, timeout: float = 10.0) -> None:
        from pagemill.runtime.engine.core_client import EngineDeadError

        self.q.put(EngineDeadError("shut down"))


def test_a_dead_core_stops_the_client_and_names_itself() -> None:
    import pytest

    from pagemill.runtime.config import EngineConfig
    from pagemill.runtime.engine.core_client import EngineDeadError
    from pagemill.runtime.engine.dp_client import DPClient
    from pagemill.runtime.engine.protocol import EngineCoreOutputs

    config = EngineConfig(data_parallel_size=2, data_parallel_routing="round_robin")
    client = DPClient(config, engine_threads=2, client_factory=_FakeCore)
    try:
        for i in range(4):
            r = _req([1, 2, 3])
            r.request_id = f"r{i}"
            client.add_request(r)
        a, b = client.clients  # type: ignore[misc]
        assert (a.added, b.added) == (["r0", "r2"], ["r1", "r3"])
        b.die()
        with pytest.raises(EngineDeadError, match="core 1 of 2 stopped"):
            client.get_output(timeout=5)
        assert "core 1" in str(client.dead_error)
        # The live core's later outputs do not follow the reported death.
        a.q.put(EngineCoreOutputs([]))
        with pytest.raises(EngineDeadError):
            client.get_output(timeout=0.2)
        r = _req([1])
        r.request_id = "r4"
        with pytest.raises(EngineDeadError, match="core 1"):
            client.add_request(r)
        assert a.added == ["r0", "r2"]
        with pytest.raises(EngineDeadError):
            client.call(lambda core: None).result(timeout=1)
    finally:
        client.shutdown()
    assert client.num_live_cores == 0


def test_every_core_reports_to_the_dashboard_tagged_with_its_index() -> None:
    from pagemill.runtime.config import EngineConfig
    from pagemill.runtime.engine.dp_client import DPClient

    config = EngineConfig(data_parallel_size=2, data_parallel_routing="round_robin")
    factories = []

    def make(config, observer_factory=None, **kwargs):
        factories.append(observer_factory)
        return _FakeCore(config, **kwargs)

    client = DPClient(config, engine_threads=2, observer_factory=dict, client_factory=make)
    try:
        assert factories == [dict, dict]  # every core takes its own pictures
        seen = []
        client.on_event = lambda kind, payload: seen.append((kind, payload))
        b = client.clients[1]
        b.on_event("dashboard", {"t": 1.0})  # as core 1's reader thread would
        assert seen == [("dashboard", {"t": 1.0, "engine_index": 1})]
        a = client.clients[0]
        assert client.call_each(lambda core: core is a).result(5) == [True, False]
        assert client.call(lambda core: core is a).result(5) is True
    finally:
        client.shutdown()


def test_a_prefix_in_flight_attracts_before_its_events_arrive() -> None:
    r = DPRouter("prefix", 2, BS)
    doc = list(range(200, 240))
    first = r.route("a", [*doc, 1])
    # No event yet (its prefill is still running): the next reader of `doc` follows it.
    assert r.route("b", [*doc, 2]) == first
    assert r.matched_blocks(first, r.hash_prompt(doc)) == len(doc) // BS
    assert r.finish("a") == first and r.finish("b") == first and r.finish("b") is None
    # Both finished and nothing was announced: nothing is assumed held any more.
    assert r.matched_blocks(first, r.hash_prompt(doc)) == 0
    assert r.inflight == [0, 0] and r.routed[first] == 2
