"""Data parallelism: N engine cores behind one front end (`--data-parallel-size N`).

`DPClient` is an `EngineCoreClient` over N `MPClient`s, one engine-core process each, with
the CPU threads split between them. Each request goes to one core, chosen by a
`DPRouter` policy; its aborts follow it there; the cores' outputs are merged into one
stream (each tagged with `engine_index`) whose scheduler stats are the sum over the cores,
while `core_stats` keeps each core's own for per-engine metrics.

Routing (`--data-parallel-routing round_robin|least_loaded|prefix`) is `dp_router.DPRouter`,
the policy Ray Serve's replicas are routed by too; for `prefix` each core attaches its
step's `KVEventBatch` to its outputs and the router applies them to its index of that core.

A core that dies kills the client, as a dead tensor-parallel worker kills its engine: the
error names the core, every request in flight fails with it (those the core held could not
finish anyway, and a server left on fewer cores than it was sized for would quietly drop
capacity that no health check reports), and the server's watchdog exits non-zero so that a
supervisor restarts the whole set.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from pagemill.runtime.engine.core_client import (
    CoreObserver,
    EngineCoreClient,
    EngineDeadError,
    MPClient,
    default_engine_threads,
)
from pagemill.runtime.engine.dp_router import (
    PREFIX_LOAD_MARGIN,
    PREFIX_LOAD_PENALTY,
    ROUTING_POLICIES,
    DPRouter,
)
from pagemill.runtime.engine.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)

if TYPE_CHECKING:
    from pagemill.runtime.config import EngineConfig
    from pagemill.runtime.engine.core import EngineCore

logger = logging.getLogger(__name__)

__all__ = [
    "PREFIX_LOAD_MARGIN",
    "PREFIX_LOAD_PENALTY",
    "ROUTING_POLICIES",
    "DPClient",
    "DPRouter",
    "combine_stats",
]

T = TypeVar("T")


def combine_stats(stats: Sequence[SchedulerStats]) -> SchedulerStats:
    """The cores' gauges and totals added up; KV usage weighted by each pool's size."""
    blocks = sum(s.num_blocks for s in stats)
    return SchedulerStats(
        num_running=sum(s.num_running for s in stats),
        num_waiting=sum(s.num_waiting for s in stats),
        kv_cache_usage=(
            sum(s.kv_cache_usage * s.num_blocks for s in stats) / blocks if blocks else 0.0
        ),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        num_preemptions=sum(s.num_preemptions for s in stats),
        num_blocks=blocks,
        block_size=stats[0].block_size if stats else 16,
        grammar_cache_bytes=sum(s.grammar_cache_bytes for s in stats),
        spec_num_drafts=sum(s.spec_num_drafts for s in stats),
        spec_num_draft_tokens=sum(s.spec_num_draft_tokens for s in stats),
        spec_num_accepted_tokens=sum(s.spec_num_accepted_tokens for s in stats),
        spec_accepted_per_pos=[
            sum(p)
            for p in itertools.zip_longest(*(s.spec_accepted_per_pos for s in stats), fillvalue=0)
        ],
        compile_graphs_pending=sum(s.compile_graphs_pending for s in stats),
    )


def _gather(futures: list[concurrent.futures.Future[T]]) -> concurrent.futures.Future[list[T]]:
    """One future of all `futures`' results, in order, set once the last is done (the
    first exception, if any). The cores answer on their own reader threads, so the count
    is taken under a lock: two last answers at once must not both settle it."""
    result: concurrent.futures.Future[list[T]] = concurrent.futures.Future()
    lock = threading.Lock()
    left = [len(futures)]

    def done(_: object) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        for f in futures:
            exc = f.exception()
            if exc is not None:
                result.set_exception(exc)
                return
        result.set_result([f.result() for f in futures])

    for f in futures:
        f.add_done_callback(done)
    return result


def _settle(
    target: concurrent.futures.Future[T],
    source: concurrent.futures.Future[list[T]],
    pick: Callable[[list[T]], T],
) -> None:
    exc = source.exception()
    if exc is not None:
        target.set_exception(exc)
    else:
        target.set_result(pick(source.result()))


class DPClient(EngineCoreClient):
    """N engine-core processes as one client (see the module docstring)."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        engine_threads: int | None = None,
        start_timeout: float | None = None,
        observer_factory: Callable[[], CoreObserver] | None = None,
        client_factory: Callable[..., EngineCoreClient] = MPClient,
    ) -> None:
        n = config.data_parallel_size
        if n < 2:
            raise ValueError(f"DPClient needs data_parallel_size >= 2, got {n}")
        total = engine_threads if engine_threads is not None else default_engine_threads(config)
        per_core = None if total is None else max(1, total // n)
        self.clients: list[EngineCoreClient] = [None] * n  # type: ignore[list-item]
        errors: list[BaseException] = []

        def start(rank: int) -> None:
            try:
                self.clients[rank] = client_factory(
                    replace(config, data_parallel_rank=rank),
                    engine_threads=per_core,
                    start_timeout=start_timeout,
                    observer_factory=observer_factory,
                )
            except BaseException as exc:
                errors.append(exc)

        starters = [threading.Thread(target=start, args=(k,)) for k in range(n)]
        for t in starters:
            t.start()
        for t in starters:
            t.join()
        if errors:
            for c in self.clients:
                if c is not None:
                    c.shutdown()
            raise errors[0]
        infos = [c.info for c in self.clients]
        self.info = msgspec.structs.replace(infos[0], num_blocks=sum(i.num_blocks for i in infos))
        self.router = DPRouter(
            config.data_parallel_routing,
            n,
            infos[0].block_size,
            config.cache.prefix_caching_hash_algo,
        )
        self.core_stats = [
            SchedulerStats(num_blocks=i.num_blocks, block_size=i.block_size) for i in infos
        ]
        self._lock = threading.Lock()
        self._outputs: queue.SimpleQueue[EngineCoreOutputs | BaseException] = queue.SimpleQueue()
        self._dead_error: BaseException | None = None
        self._raised: BaseException | None = None
        self._closed = False
        for k, c in enumerate(self.clients):
            c.on_event = functools.partial(self._forward_event, k)
        self._readers = [
            threading.Thread(
                target=self._read, args=(k,), name=f"pagemill-dp-reader-{k}", daemon=True
            )
            for k in range(n)
        ]
        for t in self._readers:
            t.start()

    # ------------------------------------------------------------ commands

    def add_request(self, request: EngineCoreRequest) -> None:
        with self._lock:
            if self._dead_error is not None:
                raise EngineDeadError(f"the engine stopped after an error: {self._dead_error!r}")
            inflight = list(self.router.inflight)
            k = self.router.route(request.request_id, request.prompt_token_ids, request.cache_salt)
            matched = list(self.router.last_matched)
        logger.debug(
            "request %s -> engine core %d (in flight %s, matched blocks %s)",
            request.request_id,
            k,
            inflight,
            matched,
        )
        try:
            self.clients[k].add_request(request)
        except BaseException:
            with self._lock:
                self.router.finish(request.request_id)
            raise

    def abort_requests(
        self, request_ids: list[str], reason: FinishReason = FinishReason.ABORT
    ) -> None:
        by_core: dict[int, list[str]] = {}
        with self._lock:
            for rid in request_ids:
                k = self.router.finish(rid)
                if k is not None:
                    by_core.setdefault(k, []).append(rid)
        for k, ids in by_core.items():
            if self.router.alive[k]:
                self.clients[k].abort_requests(ids, reason)

    def call(self, fn: Callable[[EngineCore], T]) -> concurrent.futures.Future[T]:
        """Runs `fn` on every live core (a prefix-cache reset must reach them all); the
        future holds the first live core's result once all have answered."""
        live = [k for k in range(len(self.clients)) if self.router.alive[k]]
        result: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self._dead_error is not None or not live:
            result.set_exception(
                EngineDeadError(f"the engine stopped after an error: {self._dead_error!r}")
                if self._dead_error is not None
                else EngineDeadError("the engine was shut down")
            )
            return result
        gathered = _gather([self.clients[k].call(fn) for k in live])
        gathered.add_done_callback(lambda f: _settle(result, f, lambda results: results[0]))
        return result

    def call_each(self, fn: Callable[[EngineCore], T]) -> concurrent.futures.Future[list[T]]:
        """Runs `fn` on every core; the future holds their results by engine index (what a
        per-core view, such as the dashboard's pictures, needs). Fails if any core does."""
        result: concurrent.futures.Future[list[T]] = concurrent.futures.Future()
        if self._dead_error is not None or not all(self.router.alive):
            result.set_exception(EngineDeadError(f"the engine stopped: {self._dead_error!r}"))
            return result
        return _gather([c.call(fn) for c in self.clients])

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        if self._raised is not None:
            raise self._raised
        try:
            item = self._outputs.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            # Sticky: the live cores' later outputs must not follow a death already reported.
            self._raised = item
            raise item
        return item

    # ------------------------------------------------------------ per-core readers

    def _read(self, k: int) -> None:
        client = self.clients[k]
        try:
            while True:
                out = client.get_output()
                if out is None:
                    continue
                self._on_output(k, out)
        except EngineDeadError:
            self._core_stopped(k, client.dead_error)
        except BaseException as exc:
            logger.exception("the reader of engine core %d failed", k)
            self._core_stopped(k, exc)

    def _on_output(self, k: int, out: EngineCoreOutputs) -> None:
        out.engine_index = k
        with self._lock:
            router = self.router
            if out.kv_events is not None:
                router.apply_events(k, out.kv_events.events)
                out.kv_events = None
            for o in out.outputs:
                if o.finish_reason is not None:
                    router.finish(o.request_id)
            if out.scheduler_stats is not None:
                self.core_stats[k] = out.scheduler_stats
                router.kv_usage[k] = out.scheduler_stats.kv_cache_usage
                out.scheduler_stats = combine_stats(self.core_stats)
        self._outputs.put(out)

    def _core_stopped(self, k: int, error: BaseException | None) -> None:
        with self._lock:
            self.router.engine_stopped(k)
            if not self._closed and self._dead_error is None:
                self._dead_error = RuntimeError(
                    f"data-parallel engine core {k} of {len(self.clients)} stopped: {error!r}"
                )
                logger.error(
                    "data-parallel engine core %d stopped (%r); the engine stops with it", k, error
                )
            self.router.finish_all()  # the client is dead: nothing is in flight
            dead = self._dead_error
        # Put once per core; the consumer re-raises the first it takes on every later call.
        self._outputs.put(
            EngineDeadError(f"the engine stopped after an error: {dead!r}")
            if dead is not None
            else EngineDeadError("the engine was shut down")
        )

    def _forward_event(self, k: int, kind: str, payload: dict[str, Any]) -> None:
        callback = self.on_event
        if callback is not None:
            # Which core a dashboard picture is of: block ids mean something in one pool only.
            callback(kind, {**payload, "engine_index": k})

    # ------------------------------------------------------------ state

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead_error

    @property
    def num_live_cores(self) -> int:
        return sum(self.router.alive)

    @property
    def step_started_at(self) -> float | None:
        started = [c.step_started_at for c in self.clients if c.step_started_at is not None]
        return min(started) if started else None

    @property
    def engine_steps(self) -> int:
        return sum(c.engine_steps for c in self.clients)

    @property
    def last_step_time(self) -> float | None:
        times = [c.last_step_time for c in self.clients if c.last_step_time is not None]
        return max(times) if times else None

    @property
    def engine_pid(self) -> int | None:
        return self.clients[0].engine_pid

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        for c in self.clients:
            c.shutdown(timeout)
        for t in self._readers:
            t.join(timeout)
