"""pagemill engine replicas on Ray Serve (`pip install 'pagemill-server[ray]'`).

Two deployments make the application:

- `PagemillEngine`: N replicas (a fixed `num_replicas`, or Ray Serve's autoscaling between
  `min_replicas` and `max_replicas`), each one pagemill engine core: on a thread of the
  replica's process (the replica is already a process of its own), or in a process of its
  own through the engine-core client (`engine_process=True`). A replica takes tokenized
  requests (`EngineCoreRequest`) and streams each one's outputs back.
- `PagemillIngress`: the OpenAI-compatible app of `pagemill serve` (`build_app`, the same
  routes, streaming and errors) over an `AsyncEngine` whose engine-core client
  (`ServeEngineClient`) sends each request to the engine deployment. Tokenization, chat
  templates and detokenization happen here, so the replicas only ever see token ids.

Which replica takes a request is decided by `PagemillRequestRouter`, a Ray Serve
`RequestRouter` running the same policy as `pagemill serve -dp N` (`DPRouter`:
round_robin, least_loaded, or prefix with its load penalty). For `prefix` it knows what
each replica caches from the replica's routing stats (`record_routing_stats`: the block
hashes in its prefix cache, polled by Serve every `routing_stats_period_s`) and, between
polls, from the prompts it routed there itself. A poll's account is a snapshot taken before
it arrives: requests that finished after it keep their prompts counted as cached (the stats
name the requests that had finished when the snapshot was taken), so a poll never makes the
router forget what the next reader of a document needs.

Launch:
    pagemill serve MODEL --ray --num-replicas 2 [--data-parallel-routing prefix]
or, with Ray Serve's own CLI (arguments are `build_serve_app`'s, as key=value):
    serve run pagemill.server.ray_serve:app_builder model=MODEL num_replicas=2
The same code runs on a Ray cluster (`ray start --head`, then either command on it).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import os
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

try:
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from ray.serve.request_router import (
        PendingRequest,
        ReplicaID,
        RequestRouter,
        RunningReplica,
    )
except ImportError as exc:  # pragma: no cover - depends on the extra
    raise ImportError(
        "pagemill.server.ray_serve needs Ray Serve: pip install 'pagemill-server[ray]'"
    ) from exc

from pagemill.runtime.config import EngineConfig
from pagemill.runtime.engine.core_client import EngineCoreClient, EngineDeadError
from pagemill.runtime.engine.dp_client import combine_stats
from pagemill.runtime.engine.dp_router import DPRouter
from pagemill.runtime.engine.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

    from pagemill.runtime.engine.core import EngineCore

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_ROUTING_STATS_PERIOD_S = 1.0
# Finished request ids a replica remembers for its routing stats: a poll names those that
# finished before its snapshot. Far more than finish between two polls.
FINISHED_IDS_KEPT = 4096
# A finished request's prompt stays counted as cached on its replica until a poll names it,
# or until the UNCONFIRMED_POLLS-th poll that does not (it fell out of FINISHED_IDS_KEPT).
UNCONFIRMED_POLLS = 3


def routing_summary(core: EngineCore) -> dict[str, Any]:
    """What the router needs of a replica: the block hashes its prefix cache holds (the
    index a KV-event stream would rebuild) and how full its pool is."""
    kv = core.scheduler.kv_cache_manager
    stats = kv.prefix_cache_stats
    return {
        "cached_block_hashes": list(kv.block_pool.cached_block_hash_to_block),
        "kv_cache_usage": kv.usage,
        "num_running": len(core.scheduler.running),
        "prefix_cache_queries": stats.queries,
        "prefix_cache_hits": stats.hits,
        "pid": os.getpid(),
    }


# ---------------------------------------------------------------- the engine replica


@dataclass
class ReplicaOutputs:
    """What a replica streams for a request: its outputs, and the replica's scheduler
    figures as of its latest step (the ingress's /metrics and dashboard read them: the
    ingress runs no engine of its own), named by `replica` (an id of that replica's life)."""

    replica: str
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats | None = None


class EngineReplica:
    """One pagemill engine core as a Serve replica: `generate` streams one request."""

    def __init__(
        self,
        config: EngineConfig,
        engine_process: bool = False,
        engine_threads: int | None = None,
    ) -> None:
        if config.data_parallel_size != 1:
            raise ValueError("a Ray Serve engine replica runs one core: data_parallel_size=1")
        self.client: EngineCoreClient
        if engine_process:
            from pagemill.runtime.engine.core_client import MPClient

            self.client = MPClient(config, engine_threads=engine_threads)
        else:
            from pagemill.runtime.engine.core import EngineCore
            from pagemill.runtime.engine.core_client import ThreadedClient

            if engine_threads is not None:
                import torch

                torch.set_num_threads(engine_threads)
            self.client = ThreadedClient(EngineCore.from_config(config), name="pagemill-replica")
        self.replica_id = uuid.uuid4().hex
        self._stats: SchedulerStats | None = None
        # Requests whose stream ended, newest last (see `record_routing_stats`).
        self._finished: collections.deque[str] = collections.deque(maxlen=FINISHED_IDS_KEPT)
        self._lock = threading.Lock()
        # request id -> (its loop, its queue of outputs), while it streams.
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._reader = threading.Thread(target=self._read, name="pagemill-replica-reader")
        self._reader.daemon = True
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                out = self.client.get_output()
            except EngineDeadError as exc:
                with self._lock:
                    streams, self._streams = self._streams, {}
                for loop, q in streams.values():
                    loop.call_soon_threadsafe(q.put_nowait, exc)
                return
            if out is None:
                continue
            if out.scheduler_stats is not None:
                self._stats = out.scheduler_stats
            for o in out.outputs:
                with self._lock:
                    entry = self._streams.get(o.request_id)
                if entry is not None:
                    entry[0].call_soon_threadsafe(entry[1].put_nowait, o)

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[ReplicaOutputs]:
        """The request's outputs as the core makes them (a list per wake-up, with the
        replica's latest stats); a caller that goes away (its stream cancelled) aborts the
        request, freeing its blocks."""
        rid = request.request_id
        q: asyncio.Queue[Any] = asyncio.Queue()
        with self._lock:
            self._streams[rid] = (asyncio.get_running_loop(), q)
        finished = False
        try:
            self.client.add_request(request)
            while not finished:
                batch = [await q.get()]
                while not q.empty():
                    batch.append(q.get_nowait())
                for item in batch:
                    if isinstance(item, BaseException):
                        raise item
                finished = any(o.finish_reason is not None for o in batch)
                yield ReplicaOutputs(self.replica_id, batch, self._stats)
        finally:
            with self._lock:
                self._streams.pop(rid, None)
            if not finished and self.client.dead_error is None:
                self.client.abort_requests([rid])
            self._finished.append(rid)

    def info(self) -> EngineCoreReady:
        return self.client.info

    async def call(self, fn: Callable[[EngineCore], T]) -> T:
        return await asyncio.wrap_future(self.client.call(fn))

    async def record_routing_stats(self) -> dict[str, Any]:
        """Polled by Serve for `PagemillRequestRouter` (see `routing_summary`), with the ids
        of the requests that had finished before the snapshot (`finished_request_ids`):
        read first, so each of them had left the core, its blocks cached, when the core
        took the snapshot (an aborted one is named too: what it cached is what the
        snapshot shows)."""
        finished = list(self._finished)
        summary = await self.call(routing_summary)
        summary["finished_request_ids"] = finished
        return summary

    def check_health(self) -> None:
        """Serve replaces a replica whose engine stopped (as `pagemill serve` exits)."""
        error = self.client.dead_error
        if error is not None:
            raise RuntimeError(f"the engine stopped: {error!r}")

    def __del__(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.shutdown(5.0)


# ---------------------------------------------------------------- the router


class PagemillRequestRouter(RequestRouter):
    """Ray Serve's request router running pagemill's data-parallel policy (`DPRouter`)
    over the engine replicas (see the module docstring). Requests that are not an
    `EngineCoreRequest` (a utility call) go to the least loaded replica."""

    def initialize_state(
        self, policy: str = "prefix", block_size: int = 16, hash_algo: str = "sha256", **_: Any
    ) -> None:
        self.policy = DPRouter(policy, 0, block_size, hash_algo)
        self._engine_of: dict[ReplicaID, int] = {}
        self._stats_seen: dict[int, int] = {}
        # Serve's id of a routed request -> the engine's (the replica names finished
        # requests by the latter).
        self._engine_rid: dict[str, str] = {}
        # Per engine: finished requests its polled stats have not named yet, by engine
        # request id -> (prompt hashes, polls left before they are dropped).
        self._unconfirmed: dict[int, dict[str, tuple[list[Any], int]]] = {}

    def _engine(self, replica: RunningReplica) -> int:
        k = self._engine_of.get(replica.replica_id)
        if k is None:
            k = self._engine_of[replica.replica_id] = self.policy.add_engine()
        stats = replica.routing_stats
        if stats and self._stats_seen.get(k) != id(stats):
            # A new poll: the replica's own account replaces what was assumed before, except
            # for requests that finished after its snapshot (the stats do not name them).
            self._stats_seen[k] = id(stats)
            cached = set(stats.get("cached_block_hashes", ()))
            unconfirmed = self._unconfirmed.setdefault(k, {})
            if "finished_request_ids" in stats:
                named = set(stats["finished_request_ids"])
                for rid, (hashes, polls) in list(unconfirmed.items()):
                    if rid in named or polls <= 1:
                        del unconfirmed[rid]
                    else:
                        unconfirmed[rid] = (hashes, polls - 1)
                        cached.update(hashes)
            else:  # stats without the names: the snapshot is taken as the whole truth
                unconfirmed.clear()
            self.policy.cached[k] = cached
            self.policy.kv_usage[k] = float(stats.get("kv_cache_usage", 0.0))
        return k

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_engine = {self._engine(r): r for r in candidate_replicas}
        router = self.policy
        for k in range(router.num_cores):
            router.alive[k] = k in by_engine
        request = next(
            (a for a in (pending_request.args if pending_request else ()) if _is_request(a)),
            None,
        )
        if pending_request is None or request is None:
            k = router._least_loaded(list(by_engine))
        else:
            rid = pending_request.metadata.internal_request_id
            router.finish(rid)  # a retry: routed again, counted once
            k = router.route(rid, request.prompt_token_ids, request.cache_salt)
            self._engine_rid[rid] = request.request_id
        chosen = by_engine[k]
        rest = [r for r in candidate_replicas if r is not chosen]
        return [[chosen], rest] if rest else [[chosen]]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        k = self._engine_of.get(replica_id)
        if k is not None:
            self.policy.move(pending_request.metadata.internal_request_id, k)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        # Its blocks stay cached there until evicted; the first poll of the replica's stats
        # taken after it finished says which still are (without this, the next reader of
        # the same document would miss it for up to a polling period or two).
        assigned = self.policy.assigned(internal_request_id)
        engine_rid = self._engine_rid.pop(internal_request_id, None)
        self.policy.finish(internal_request_id, assume_cached=True)
        if assigned is not None and engine_rid is not None and assigned[1]:
            k, hashes = assigned
            self._unconfirmed.setdefault(k, {})[engine_rid] = (hashes, UNCONFIRMED_POLLS)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        k = self._engine_of.get(replica_id)
        if k is not None:
            for rid in self.policy.engine_stopped(k):
                self._engine_rid.pop(rid, None)
            self._unconfirmed.pop(k, None)


def _is_request(arg: Any) -> bool:
    return isinstance(arg, EngineCoreRequest)


# ---------------------------------------------------------------- the ingress's client


class ServeEngineClient(EngineCoreClient):
    """The front end's engine-core client over the engine deployment: each request is a
    streaming call to the replica the router picks; aborts cancel that call.

    Each replica's stream carries its scheduler figures; `core_stats` keeps the latest of
    every replica seen (indexed in the order they first answered: the `engine` label of
    the per-engine metrics) and the outputs carry their sum, as `DPClient` does for its
    cores, so the ingress's /metrics shows the replicas' real numbers.
    They are as fresh as each replica's latest output: an idle replica keeps the figures
    of its last step, and one that Serve replaced keeps its index until the ingress
    restarts (its successor gets a new one)."""

    def __init__(
        self, handle: DeploymentHandle, info: EngineCoreReady, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.info = info
        self._stream = handle.options(stream=True)
        self._unary = handle
        self._outputs: queue.SimpleQueue[EngineCoreOutputs | BaseException] = queue.SimpleQueue()
        self._responses: dict[str, Any] = {}
        self._replica_index: dict[str, int] = {}
        self.core_stats: list[SchedulerStats] = []
        self._closed = False
        # Serve handles are asyncio objects: the replica's own loop drives every call (the
        # front end calls in from its threads).
        self._loop = loop

    def add_request(self, request: EngineCoreRequest) -> None:
        if self._closed:
            raise EngineDeadError("the engine was shut down")
        asyncio.run_coroutine_threadsafe(self._run(request), self._loop)

    async def _run(self, request: EngineCoreRequest) -> None:
        rid = request.request_id
        try:
            response: Any = self._stream.generate.remote(request)
            self._responses[rid] = response
            async for item in response:
                self._outputs.put(self._from_replica(item))
        except asyncio.CancelledError:
            pass  # aborted here: the front end has already finished the request
        except Exception as exc:  # that request alone fails (a replica died under it)
            if rid in self._responses:
                logger.error("request %s failed on its engine replica: %r", rid, exc)
                message = f"the engine replica failed: {exc!r}"
                self._outputs.put(
                    EngineCoreOutputs([EngineCoreOutput(rid, [], FinishReason.ERROR, message)])
                )
        finally:
            self._responses.pop(rid, None)

    def _from_replica(self, item: ReplicaOutputs) -> EngineCoreOutputs:
        k = self._replica_index.setdefault(item.replica, len(self._replica_index))
        if item.stats is None:
            return EngineCoreOutputs(item.outputs, engine_index=k)
        stats = list(self.core_stats)
        if k < len(stats):
            stats[k] = item.stats
        else:  # a replica seen for the first time, before its own stats came
            stats += [SchedulerStats() for _ in range(k - len(stats))] + [item.stats]
        self.core_stats = stats  # a new list: readers on other threads see a whole one
        return EngineCoreOutputs(item.outputs, scheduler_stats=combine_stats(stats), engine_index=k)

    def abort_requests(
        self, request_ids: list[str], reason: FinishReason = FinishReason.ABORT
    ) -> None:
        def cancel() -> None:
            for rid in request_ids:
                response = self._responses.pop(rid, None)
                if response is not None:
                    response.cancel()

        if not self._closed:
            self._loop.call_soon_threadsafe(cancel)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        try:
            item = self._outputs.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            self._outputs.put(item)
            raise item
        return item

    def call(self, fn: Callable[[EngineCore], T]) -> concurrent.futures.Future[T]:
        """Runs `fn` on one replica (the least loaded)."""

        async def run() -> T:
            result: T = await self._unary.call.remote(fn)
            return result

        return asyncio.run_coroutine_threadsafe(run(), self._loop)

    @property
    def dead_error(self) -> BaseException | None:
        return None

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._outputs.put(EngineDeadError("the engine was shut down"))


# ---------------------------------------------------------------- the ingress


@serve.ingress()
class PagemillIngress:
    """`pagemill serve`'s OpenAI app over the engine deployment."""

    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self,
        engine: DeploymentHandle,
        config: EngineConfig,
        served_model_name: str | Sequence[str],
        app_kwargs: dict[str, Any] | None = None,
    ) -> None:
        from pagemill.runtime.engine.model_assets import ModelAssets
        from pagemill.server.async_engine import AsyncEngine
        from pagemill.server.entrypoints.openai.api_server import build_app
        from pagemill.server.metrics import EngineMetrics

        assets = ModelAssets.load(config)
        info: EngineCoreReady = await engine.info.remote()
        names = [served_model_name] if isinstance(served_model_name, str) else served_model_name
        metrics = EngineMetrics(names[0])
        # Names of our own: Serve's ASGI wrapper shares this object (its `app` property, ...).
        self._pagemill_engine = AsyncEngine(
            client=ServeEngineClient(engine, info, asyncio.get_running_loop()),
            assets=assets,
            config=config,
            observer=metrics,
        )
        self._pagemill_app = build_app(
            self._pagemill_engine, list(names), metrics=metrics, **(app_kwargs or {})
        )

    def __serve_build_asgi_app__(self) -> Any:
        return self._pagemill_app


# ---------------------------------------------------------------- the application


def build_serve_app(
    model: str | None = None,
    *,
    config: EngineConfig | None = None,
    num_replicas: int | None = 1,
    min_replicas: int | None = None,
    max_replicas: int | None = None,
    target_ongoing_requests: float = 8.0,
    routing: str | None = None,
    served_model_name: str | Sequence[str] | None = None,
    engine_process: bool = False,
    engine_threads: int | None = None,
    num_cpus: float | None = None,
    num_gpus: float | None = None,
    max_ongoing_requests: int = 64,
    routing_stats_period_s: float = DEFAULT_ROUTING_STATS_PERIOD_S,
    app_kwargs: dict[str, Any] | None = None,
    **engine_kwargs: Any,
) -> Any:
    """The Serve application: an ingress and `num_replicas` engine replicas (or, with
    `max_replicas`, Ray Serve's autoscaling between `min_replicas` and `max_replicas`,
    aiming at `target_ongoing_requests` per replica). The engine is `config`, or
    `EngineConfig.from_kwargs(model=model, **engine_kwargs)` (checked here, before any
    replica starts). `routing` defaults to the config's `data_parallel_routing`."""
    if config is None:
        if model is None:
            raise ValueError("build_serve_app needs a model or an EngineConfig")
        config = EngineConfig.from_kwargs(model=model, **engine_kwargs)  # bad options fail here
    elif engine_kwargs:
        raise TypeError("pass either an EngineConfig or engine keyword arguments, not both")
    if config.data_parallel_size != 1:
        raise ValueError("with Ray Serve, scale out with replicas, not data_parallel_size")
    router: dict[str, Any] = {
        "request_router_class": PagemillRequestRouter,
        "request_router_kwargs": {
            "policy": routing or config.data_parallel_routing,
            "block_size": config.cache.block_size,
            "hash_algo": config.cache.prefix_caching_hash_algo,
        },
        "request_routing_stats_period_s": routing_stats_period_s,
    }
    options: dict[str, Any] = {
        "name": "PagemillEngine",
        "max_ongoing_requests": max_ongoing_requests,
        "request_router_config": RequestRouterConfig(**router),
    }
    if max_replicas is not None:
        options["autoscaling_config"] = {
            "min_replicas": 1 if min_replicas is None else min_replicas,
            "max_replicas": max_replicas,
            "target_ongoing_requests": target_ongoing_requests,
        }
    else:
        options["num_replicas"] = num_replicas
    actor = {"num_cpus": num_cpus, "num_gpus": num_gpus}
    if any(v is not None for v in actor.values()):
        options["ray_actor_options"] = {k: v for k, v in actor.items() if v is not None}
    engine: Any = serve.deployment(EngineReplica, **options)
    ingress: Any = serve.deployment(PagemillIngress, name="PagemillIngress")
    name = served_model_name if served_model_name is not None else config.model
    return ingress.bind(
        engine.bind(config, engine_process, engine_threads), config, name, app_kwargs
    )


def run(
    config: EngineConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    num_replicas: int = 1,
    max_replicas: int | None = None,
    served_model_name: Sequence[str] | None = None,
    engine_threads: int | None = None,
    api_key: str | None = None,
) -> int:
    """`pagemill serve MODEL --ray`: joins the Ray cluster of $RAY_ADDRESS (or starts a
    local one), serves until interrupted."""
    import ray

    address = os.environ.get("RAY_ADDRESS")
    ray.init(address=address or None)
    serve.start(http_options={"host": host, "port": port})
    app = build_serve_app(
        config=config,
        num_replicas=num_replicas,
        min_replicas=num_replicas if max_replicas is not None else None,
        max_replicas=max_replicas,
        served_model_name=list(served_model_name) if served_model_name else None,
        engine_threads=engine_threads,
        app_kwargs={"api_key": api_key} if api_key else None,
    )
    try:
        serve.run(app, name="pagemill", route_prefix="/", blocking=True)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
    return 0


_INT_ARGS = (
    "num_replicas",
    "min_replicas",
    "max_replicas",
    "engine_threads",
    "max_ongoing_requests",
)
_FLOAT_ARGS = ("target_ongoing_requests", "num_cpus", "num_gpus", "routing_stats_period_s")


def app_builder(args: dict[str, str]) -> Any:
    """For `serve run pagemill.server.ray_serve:app_builder model=... num_replicas=2`:
    Serve passes the key=value pairs as strings; numbers and booleans are read here, other
    engine options (block_size=32, max_model_len=2048, ...) go to the engine config."""
    kwargs: dict[str, Any] = {}
    for key, value in args.items():
        if key in _INT_ARGS:
            kwargs[key] = int(value)
        elif key in _FLOAT_ARGS:
            kwargs[key] = float(value)
        elif key == "engine_process":
            kwargs[key] = str(value).lower() in ("1", "true", "yes")
        else:
            kwargs[key] = _engine_value(value)
    model = kwargs.pop("model", None)
    if model is None:
        raise ValueError("serve run pagemill.server.ray_serve:app_builder needs model=...")
    return build_serve_app(str(model), **kwargs)


def _engine_value(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    for parse in (int, float):
        try:
            return parse(value)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(value.lower(), value)
