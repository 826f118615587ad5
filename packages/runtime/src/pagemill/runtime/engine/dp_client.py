"""Data parallelism: N engine cores behind one front end (`--data-parallel-size N`).

`DPClient` is an `EngineCoreClient` over N `MPClient`s, one engine-core process each, with
the CPU threads split between them. Each request goes to one core, chosen by a
`DPRouter` policy; its aborts follow it there; the cores' outputs are merged into one
stream (each tagged with `engine_index`) whose scheduler stats are the sum over the cores,
while `core_stats` keeps each core's own for per-engine metrics.

Routing policies (`--data-parallel-routing`):
- round_robin: in turn.
- least_loaded: fewest requests in flight (routed here, not finished), then lowest KV use.
- prefix: the core whose prefix cache holds the longest leading run of the prompt's block
  hashes, known from the cores' KV events (each core attaches its step's `KVEventBatch`
  to its outputs; the router applies them to one hash set per core, and hashes the prompt
  with the cores' own hash function and block size). Affinity only holds while that core
  is within `PREFIX_LOAD_MARGIN` requests of the least loaded one, and each request in
  flight costs `PREFIX_LOAD_PENALTY` blocks of match: without that, one popular prefix
  would pin all traffic on one core (the failure SGLang's and vLLM's router issues
  describe), and the others would only warm up once it was saturated.

A core that dies fails the requests it holds (finish_reason "error") and takes no more;
the others keep serving. The client is dead only when every core is.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from pagemill.blockpool import hash_block_chain
from pagemill.blockpool.hashing import BlockHash, get_hash_fn
from pagemill.runtime.engine.core_client import (
    CoreObserver,
    EngineCoreClient,
    EngineDeadError,
    MPClient,
    default_engine_threads,
)
from pagemill.runtime.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from pagemill.runtime.engine.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)

if TYPE_CHECKING:
    from pagemill.runtime.config import EngineConfig
    from pagemill.runtime.engine.core import EngineCore

logger = logging.getLogger(__name__)

T = TypeVar("T")

PREFIX_LOAD_MARGIN = 4
PREFIX_LOAD_PENALTY = 1.0


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
    )


class DPRouter:
    """Picks a core for each request; thread-safe (the caller holds the client's lock)."""

    def __init__(
        self, policy: str, num_cores: int, block_size: int, hash_algo: str = "sha256"
    ) -> None:
        self.policy = policy
        self.num_cores = num_cores
        self.block_size = block_size
        self.hash_fn = get_hash_fn(hash_algo)
        self.inflight = [0] * num_cores
        self.kv_usage = [0.0] * num_cores
        self.alive = [True] * num_cores
        self.cached: list[set[BlockHash]] = [set() for _ in range(num_cores)]
        self.routed = [0] * num_cores
        self._next = 0

    def apply_events(self, core: int, events: Sequence[Any]) -> None:
        index = self.cached[core]
        for ev in events:
            if isinstance(ev, BlockStored):
                index.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                index.difference_update(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                index.clear()

    def prompt_hashes(self, request: EngineCoreRequest) -> list[BlockHash]:
        salt = request.cache_salt
        return hash_block_chain(
            self.hash_fn,
            request.prompt_token_ids,
            self.block_size,
            () if salt is None else (salt,),
        )

    def matched_blocks(self, core: int, hashes: Sequence[BlockHash]) -> int:
        index = self.cached[core]
        n = 0
        for h in hashes:
            if h not in index:
                break
            n += 1
        return n

    def choose(self, request: EngineCoreRequest) -> int:
        live = [k for k in range(self.num_cores) if self.alive[k]]
        if not live:
            raise EngineDeadError("every data-parallel engine core has stopped")
        if self.policy == "round_robin":
            for _ in range(self.num_cores):
                k = self._next % self.num_cores
                self._next += 1
                if self.alive[k]:
                    return k
        least = self._least_loaded(live)
        if self.policy == "least_loaded":
            return least
        hashes = self.prompt_hashes(request)
        floor = self.inflight[least]
        best, best_score = least, 0.0
        for k in live:
            if self.inflight[k] > floor + PREFIX_LOAD_MARGIN:
                continue
            matched = self.matched_blocks(k, hashes)
            if not matched:
                continue
            score = matched - PREFIX_LOAD_PENALTY * (self.inflight[k] - floor)
            if score > best_score:
                best, best_score = k, score
        return best

    def _least_loaded(self, live: list[int]) -> int:
        # Ties go to the core after the last one picked, so equal cores take turns.
        start = self._next
        self._next += 1
        order = [live[(start + i) % len(live)] for i in range(len(live))]
        return min(order, key=lambda k: (self.inflight[k], self.kv_usage[k]))


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
                    # The dashboard pictures core 0 only.
                    observer_factory=observer_factory if rank == 0 else None,
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
        self._where: dict[str, int] = {}  # request id -> core, while in flight
        self._outputs: queue.SimpleQueue[EngineCoreOutputs | BaseException] = queue.SimpleQueue()
        self._dead_error: BaseException | None = None
        self._closed = False
        self.clients[0].on_event = self._forward_event
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
            k = self.router.choose(request)
            self._where[request.request_id] = k
            self.router.inflight[k] += 1
            self.router.routed[k] += 1
        logger.debug("request %s -> engine core %d", request.request_id, k)
        try:
            self.clients[k].add_request(request)
        except BaseException:
            with self._lock:
                if self._where.pop(request.request_id, None) is not None:
                    self.router.inflight[k] -= 1
            raise

    def abort_requests(
        self, request_ids: list[str], reason: FinishReason = FinishReason.ABORT
    ) -> None:
        by_core: dict[int, list[str]] = {}
        with self._lock:
            for rid in request_ids:
                k = self._where.pop(rid, None)
                if k is not None:
                    self.router.inflight[k] -= 1
                    by_core.setdefault(k, []).append(rid)
        for k, ids in by_core.items():
            if self.router.alive[k]:
                self.clients[k].abort_requests(ids, reason)

    def call(self, fn: Callable[[EngineCore], T]) -> concurrent.futures.Future[T]:
        """Runs `fn` on every live core (a prefix-cache reset must reach them all); the
        future holds the first live core's result once all have answered."""
        live = [k for k in range(len(self.clients)) if self.router.alive[k]]
        result: concurrent.futures.Future[T] = concurrent.futures.Future()
        if not live:
            result.set_exception(EngineDeadError("every data-parallel engine core has stopped"))
            return result
        futures = [self.clients[k].call(fn) for k in live]

        def done(_: object) -> None:
            if all(f.done() for f in futures) and result.set_running_or_notify_cancel():
                for f in futures:
                    if f.exception() is not None:
                        result.set_exception(f.exception())
                        return
                result.set_result(futures[0].result())

        for f in futures:
            f.add_done_callback(done)
        return result

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        try:
            item = self._outputs.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            self._outputs.put(item)
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
                if o.finish_reason is not None and self._where.pop(o.request_id, None) is not None:
                    router.inflight[k] -= 1
            if out.scheduler_stats is not None:
                self.core_stats[k] = out.scheduler_stats
                router.kv_usage[k] = out.scheduler_stats.kv_cache_usage
                out.scheduler_stats = combine_stats(self.core_stats)
        self._outputs.put(out)

    def _core_stopped(self, k: int, error: BaseException | None) -> None:
        with self._lock:
            self.router.alive[k] = False
            lost = [rid for rid, core in self._where.items() if core == k]
            for rid in lost:
                del self._where[rid]
            self.router.inflight[k] = 0
            self.router.cached[k].clear()
            all_dead = not any(self.router.alive)
        if not self._closed:
            logger.error("data-parallel engine core %d stopped: %r", k, error)
            if lost:
                message = f"engine core {k} stopped: {error!r}"
                self._outputs.put(
                    EngineCoreOutputs(
                        [EngineCoreOutput(rid, [], FinishReason.ERROR, message) for rid in lost],
                        engine_index=k,
                    )
                )
        if all_dead:
            if error is not None and self._dead_error is None and not self._closed:
                self._dead_error = error
            self._outputs.put(
                EngineDeadError(
                    f"the engine stopped after an error: {self._dead_error!r}"
                    if self._dead_error is not None
                    else "the engine was shut down"
                )
            )

    def _forward_event(self, kind: str, payload: dict[str, Any]) -> None:
        callback = self.on_event
        if callback is not None:
            callback(kind, payload)

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
