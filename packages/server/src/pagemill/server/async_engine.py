"""The engine seen from asyncio: the server's front end over one engine core.

The API process owns the one tokenizer, input processing (the one validator, run off the
event loop) and output processing (detokenization, stop strings, `n > 1`, logprobs,
metrics); the engine core — scheduler, KV pool, model, sampler, grammars — runs behind an
`EngineCoreClient` and speaks token ids only (pagemill.runtime.engine.protocol):

    event loop ── add_request ──> input thread: InputProcessor.process ──> client ─┐
    asyncio queues <── output thread: OutputProcessor.process_outputs <── client <─┘
                       (one call_soon_threadsafe per event loop per step)

Two ways to run the core, behind the same API (`add_request`, `stream`, `abort`,
`release`, `submit`, `call`, `shutdown`, `is_dead`):

- `AsyncEngine(llm_engine)`: the engine's core on a thread of this process (embedding,
  notebooks, tests, `pagemill serve --no-engine-process`).
- `AsyncEngine.launch(config)`: the core in its own process, as `pagemill serve` runs it.
  The core then shares no interpreter lock with the HTTP side: the event loop's Python
  runs beside the step on another core, and a busy loop cannot slow a step.

Commands reach the core between steps, so an abort frees the request's blocks before the
next step is scheduled. A step that raises because of one request is contained by the core
(that request finishes with finish_reason "error"). If the core itself fails (a step
raised beyond containment, the process exited), the client turns dead: every in-flight
request fails with `EngineDeadError`, so does every later command, and the server's
watchdog exits non-zero. `step_started_at` tells the watchdog how long the current step
has run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeVar

from pagemill.runtime.engine.core_client import (
    CoreObserver,
    EngineCoreClient,
    EngineDeadError,
    MPClient,
    ThreadedClient,
)
from pagemill.runtime.engine.front_end import ModelFacts
from pagemill.runtime.engine.output_processor import IterationStats
from pagemill.runtime.engine.protocol import (
    EngineCoreOutputs,
    EngineCoreReady,
    FinishReason,
    SchedulerStats,
)
from pagemill.runtime.lora import LoRARequest

if TYPE_CHECKING:
    from pagemill.runtime import LLMEngine
    from pagemill.runtime.config import EngineConfig
    from pagemill.runtime.engine.core import EngineCore
    from pagemill.runtime.engine.input_processor import InputProcessor
    from pagemill.runtime.engine.llm_engine import EngineStats
    from pagemill.runtime.engine.model_assets import ModelAssets
    from pagemill.runtime.engine.output_processor import OutputProcessor
    from pagemill.runtime.outputs import EmbeddingRequestOutput, RequestOutput
    from pagemill.runtime.pooling_params import PoolingParams
    from pagemill.runtime.sampling_params import SamplingParams
    from pagemill.server.dashboard import DashboardSettings
    from pagemill.server.dashboard.tap import WatcherCount

    # What a request's queue carries: its outputs, then possibly the error that ended it.
    QueueItem: TypeAlias = RequestOutput | EmbeddingRequestOutput | BaseException

logger = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = [
    "AsyncEngine",
    "EngineDeadError",
    "EngineLaunch",
    "QueueFullError",
    "ServerShuttingDownError",
    "StepObserver",
    "StepObservers",
]


class ServerShuttingDownError(EngineDeadError):
    """In-flight requests ended by a shutdown (its timeout ran out) or a fatal engine error."""


class QueueFullError(RuntimeError):
    """The configured limit on pending requests is reached; retry later."""


class StepObserver(Protocol):
    """Told about every output of the engine core (metrics.EngineMetrics implements it).

    It reads the engine's own figures (`view.get_stats()`, `view.iteration_stats`), so
    what a dashboard shows is what the engine counted, not what the HTTP layer happened to
    see. `step_seconds` is the wall time of the core's step, None after commands that ran
    no step. Called on the front end's output thread.
    """

    def on_step(self, engine: StatsView, step_seconds: float | None = None) -> None: ...


class StepObservers:
    """Several `StepObserver`s as one (metrics and the dashboard); one failing does not
    keep the others from being told."""

    def __init__(self, *observers: StepObserver) -> None:
        self.observers = observers

    def on_step(self, engine: StatsView, step_seconds: float | None = None) -> None:
        for observer in self.observers:
            try:
                observer.on_step(engine, step_seconds)
            except Exception:
                logger.exception("a step observer failed")


@dataclass
class StatsView:
    """What a `StepObserver` reads: the core's gauges with the front end's counters."""

    stats: EngineStats
    iteration_stats: IterationStats
    # Each data-parallel core's own stats (None with one core), for per-engine metrics.
    per_engine: list[SchedulerStats] | None = None
    # The core this output came from (its iteration figures are that core's).
    engine_index: int = 0

    def get_stats(self) -> EngineStats:
        return self.stats


@dataclass
class _Tracked:
    """Where the outputs of one live request go."""

    out_queue: asyncio.Queue[QueueItem]
    loop: asyncio.AbstractEventLoop


def _put_all(batch: list[tuple[asyncio.Queue[QueueItem], QueueItem]]) -> None:
    for q, item in batch:
        q.put_nowait(item)


def deliver(items: Iterable[tuple[_Tracked, QueueItem]]) -> None:
    """Hand items to their queues: one wake-up of each event loop, however many items.

    Thread-safe and never blocking: the loop runs the puts when it gets to them. A loop
    that is gone (server shut down mid-request) has nobody left to tell.
    """
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[QueueItem], QueueItem]]] = {}
    for tracked, item in items:
        by_loop.setdefault(tracked.loop, []).append((tracked.out_queue, item))
    for loop, batch in by_loop.items():
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_put_all, batch)


class AsyncEngine(ModelFacts):
    """The front end over an engine core; safe to use from any event loop.

    `max_pending` caps the sequences accepted at once (running + waiting in the engine);
    beyond it `add_request` raises `QueueFullError` (the server answers 429).
    `AsyncEngine(llm_engine)` runs that engine's core on a thread of this process;
    `AsyncEngine.launch(config)` runs a core in its own process.
    """

    def __init__(
        self,
        engine: LLMEngine | None = None,
        *,
        max_pending: int | None = None,
        observer: StepObserver | None = None,
        name: str = "pagemill-engine",
        client: EngineCoreClient | None = None,
        assets: ModelAssets | None = None,
        config: EngineConfig | None = None,
    ) -> None:
        if max_pending is not None and max_pending < 1:
            raise ValueError(f"max_pending must be None or >= 1, got {max_pending}")
        if engine is not None:
            if client is not None:
                raise TypeError("pass an LLMEngine or a client, not both")
            # The engine's own front end, its core moved onto a thread of its own.
            client = ThreadedClient(engine.engine_core, name=name)
            assets, config = engine.assets, engine.config
            self.input_processor: InputProcessor = engine.input_processor
            self.output_processor: OutputProcessor = engine.output_processor
        elif client is None or assets is None:
            raise TypeError("AsyncEngine needs an LLMEngine, or a client and its model assets")
        else:
            # Imported here: what `AsyncEngine.start` needs must not import the engine (and
            # torch) before the core process is started.
            from pagemill.runtime.engine.llm_engine import make_processors

            self.input_processor, self.output_processor = make_processors(
                assets, client.info, config
            )
        self.client = client
        self.assets = assets
        self.config = config
        self.max_pending = max_pending
        self.observer = observer
        # --enable-log-requests: a `request_log.RequestLogger`, told of each accepted request.
        self.request_logger: Any = None
        self._closed = False
        self._held: dict[str, int] = {}  # accepted, not yet released -> slots; under _lock
        self._num_slots = 0
        # Guards the output processor and `_tracked`: the event loop, the input thread and
        # the output thread all reach them.
        self._lock = threading.Lock()
        self._tracked: dict[str, _Tracked] = {}
        self._dead_error: BaseException | None = None
        self._core_stats = SchedulerStats(
            num_blocks=client.info.num_blocks, block_size=client.info.block_size
        )
        self.iteration_stats = IterationStats()
        # Tokenization, chat templates and validation: never on the event loop (a
        # multi-megabyte prompt takes seconds), one thread so encodes never race (a fast
        # tokenizer used from two threads at once can fail with "Already borrowed").
        self.input_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="pagemill-tokenizer"
        )
        # With a dashboard: how many pages watch (shared with a core process), and where
        # its pictures go.
        self.dashboard_watchers: WatcherCount | None = None
        self.on_dashboard: Callable[[dict[str, Any]], None] | None = None
        client.on_event = self._on_event
        self._output_thread = threading.Thread(
            target=self._output_loop, name="pagemill-engine-output", daemon=True
        )
        self._output_thread.start()

    @classmethod
    def launch(
        cls,
        config: EngineConfig | None = None,
        *,
        max_pending: int | None = None,
        observer: StepObserver | None = None,
        engine_threads: int | None = None,
        start_timeout: float | None = None,
        dashboard: DashboardSettings | None = None,
        **engine_kwargs: Any,
    ) -> AsyncEngine:
        """A front end here, an engine core in its own process (`MPClient`).

        Returns once the core is built (model loaded, KV pool sized, step compiled);
        raises RuntimeError saying why if it could not be. `engine_threads` sets torch's
        intra-op threads there (None: on CPU one per usable core, see
        `core_client.default_engine_threads`). `submit`/`call` then take picklable
        functions. `dashboard` lets the core take pictures for the dashboard page.
        `AsyncEngine.start` is the same in two halves.
        """
        launch = cls.start(
            config,
            engine_threads=engine_threads,
            start_timeout=start_timeout,
            dashboard=dashboard,
            **engine_kwargs,
        )
        return launch.result(max_pending=max_pending, observer=observer)

    @classmethod
    def start(
        cls,
        config: EngineConfig | None = None,
        *,
        engine_threads: int | None = None,
        start_timeout: float | None = None,
        dashboard: DashboardSettings | None = None,
        **engine_kwargs: Any,
    ) -> EngineLaunch:
        """Start the core process (and the front end's tokenizer load) and return at once;
        `.result()` waits for both and returns the front end, as `launch` does. The
        caller's own start-up (the server's imports, its app) runs meanwhile, beside the
        core's: so that it does, this module imports nothing heavy before the process is
        started."""
        import multiprocessing

        from pagemill.runtime.config import EngineConfig

        if config is None:
            config = EngineConfig.from_kwargs(**engine_kwargs)  # bad options fail here
        elif engine_kwargs:
            raise TypeError("pass either an EngineConfig or keyword arguments, not both")
        if engine_threads is not None and engine_threads < 1:
            raise ValueError(f"engine_threads must be None or >= 1, got {engine_threads}")
        watchers = factory = None
        if dashboard is not None:
            from pagemill.server.dashboard.tap import SnapshotTap

            watchers = multiprocessing.get_context("spawn").RawValue("i", 0)
            factory = functools.partial(SnapshotTap, dashboard, watchers)
        client: Any
        if config.data_parallel_size > 1:
            from pagemill.runtime.engine.dp_client import DPClient

            assets_future = _load_assets_in_background(config)
            client = DPClient(  # returns once every core is ready
                config,
                engine_threads=engine_threads,
                start_timeout=start_timeout,
                observer_factory=factory,
            )
        else:
            client = MPClient(
                config,
                engine_threads=engine_threads,
                start_timeout=start_timeout,
                observer_factory=factory,
                wait=False,
            )
            assets_future = _load_assets_in_background(config)
        return EngineLaunch(cls, config, client, assets_future, watchers)

    # ------------------------------------------------------------ model facts

    @property
    def engine(self) -> AsyncEngine:
        """Kept for callers of the old two-object API: the front end is the engine view."""
        return self

    @property
    def core_info(self) -> EngineCoreReady:
        return self.client.info

    def prompt_of(self, request_id: str) -> str | None:
        with self._lock:
            return self.output_processor.prompt_of(request_id)

    def get_stats(self) -> EngineStats:
        from pagemill.runtime.engine.llm_engine import EngineStats

        return EngineStats.combine(self._core_stats, self.output_processor)

    # ------------------------------------------------------------ state

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead_error or self.client.dead_error

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    @property
    def num_pending(self) -> int:
        return len(self._held)

    @property
    def num_slots_held(self) -> int:
        """Queue slots in use: a request with n choices holds n (see `add_request`)."""
        return self._num_slots

    @property
    def step_started_at(self) -> float | None:
        """`time.monotonic()` when the step now running began; None between steps."""
        return self.client.step_started_at

    @property
    def engine_pid(self) -> int | None:
        return self.client.engine_pid

    @property
    def engine_steps(self) -> int:
        return self.client.engine_steps

    @property
    def last_step_time(self) -> float | None:
        return self.client.last_step_time

    def _stopped_error(self) -> EngineDeadError | None:
        error = self.dead_error
        if error is not None:
            return EngineDeadError(f"the engine stopped after an error: {error!r}")
        if self._closed:
            return EngineDeadError("the engine was shut down")
        return None

    def _check_alive(self) -> None:
        error = self._stopped_error()
        if error is not None:
            raise error

    # ------------------------------------------------------------ requests

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        *,
        out_queue: asyncio.Queue[QueueItem] | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> asyncio.Queue[QueueItem]:
        """Validate a request (off the event loop) and hand it to the core; its outputs
        arrive on the returned queue.

        Several requests may share one `out_queue` (a batch of prompts in one HTTP call);
        each item is a RequestOutput (a delta, for streaming parameters), an
        EmbeddingRequestOutput (for `PoolingParams`: one, when it is done) or an exception.
        Every problem with the request is a ValueError raised here, before anything is
        streamed. The caller must call `release(request_id)` once it stops reading,
        finished or not. `arrival_time` (monotonic) defaults to now. A request counts
        against `max_pending` once per choice (`params.n`).
        """
        self._check_alive()
        slots = int(getattr(params, "n", 1) or 1)
        with self._lock:
            if self.max_pending is not None and self._num_slots + slots > self.max_pending:
                raise QueueFullError(
                    f"the server already holds {self._num_slots} sequences "
                    f"(limit {self.max_pending})"
                )
            if request_id in self._held:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._held[request_id] = slots
            self._num_slots += slots
        arrival = time.monotonic() if arrival_time is None else float(arrival_time)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[QueueItem] = out_queue if out_queue is not None else asyncio.Queue()
        admit = functools.partial(
            self._admit,
            request_id,
            prompt,
            params,
            priority,
            cache_salt,
            arrival,
            _Tracked(q, loop),
            lora_request,
        )
        done = self.input_pool.submit(admit)
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            # The admission may still run to its end on the tokenizer thread: abort once it
            # has (an abort sent before the request itself would find nothing to stop).
            done.add_done_callback(lambda _: self.release(request_id, finished=False))
            raise
        except BaseException:
            self.release(request_id, finished=False)
            raise
        if self.request_logger is not None:
            self.request_logger.log(request_id, prompt, params)
        return q

    def _admit(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        priority: int,
        cache_salt: str | None,
        arrival: float,
        tracked: _Tracked,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """On the tokenizer thread: validate, register with the output processor, send to
        the core. It returns once the core's channel holds the request, so a caller that
        then stalls the event loop (or its whole interpreter) cannot hold the request back."""
        processed = self.input_processor.process(
            request_id,
            prompt,
            params,
            priority=priority,
            cache_salt=cache_salt,
            arrival_time=arrival,
            lora_request=lora_request,
        )
        with self._lock:  # checked under the lock `_die` takes: no stream is left behind
            self._check_alive()
            known = self.output_processor.is_known
            taken = [r.request_id for r in processed.completions if known(r.request_id)]
            if known(request_id) or taken:
                raise ValueError(f"request id {request_id!r} is already in use")
            self.output_processor.add_request(
                request_id,
                processed.prompt,
                processed.prompt_token_ids,
                params.output_kind,
                arrival,
                processed.completions,
            )
            self._tracked[request_id] = tracked
        for request in processed.completions:
            self.client.add_request(request)

    def abort(self, request_id: str | Sequence[str]) -> None:
        """Abort requests (no-op for finished or unknown ids); blocks are freed before the
        next step."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if not ids:
            return
        with self._lock:
            for rid in ids:
                self._tracked.pop(rid, None)
            to_abort = self.output_processor.abort_requests(ids)
        if to_abort and self._stopped_error() is None:
            self.client.abort_requests(to_abort)

    def release(self, request_id: str, *, finished: bool) -> None:
        """The caller stops reading `request_id`: abort it unless it finished; free its slot.

        Idempotent: every exit path of a handler may call it without double counting.
        """
        with self._lock:
            slots = self._held.pop(request_id, None)
            if slots is None:
                return
            self._num_slots -= slots
        if not finished:
            self.abort(request_id)

    async def stream(
        self, out_queue: asyncio.Queue[QueueItem], request_ids: Sequence[str]
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield RequestOutputs of `request_ids` from `out_queue` until all have finished
        (for pooling requests, EmbeddingRequestOutputs: see `serving_embedding`).

        Leaving early (an exception, a cancelled task, a closed generator) aborts the ones
        still running, so a client that hangs up frees its blocks within a step.
        """
        live = set(request_ids)
        try:
            while live:
                item = await out_queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    live.discard(item.request_id)
                    self.release(item.request_id, finished=True)
                yield item  # type: ignore[misc]
        finally:
            for rid in live:
                self.release(rid, finished=False)

    def fail_all(self, error: BaseException) -> None:
        """Abort every request in flight and end its stream with `error` (shutdown)."""
        with self._lock:
            tracked = self._tracked
            self._tracked = {}
            to_abort = self.output_processor.abort_requests(list(tracked))
        if to_abort and self._stopped_error() is None:
            self.client.abort_requests(to_abort)
        deliver((t, error) for t in tracked.values())

    # ------------------------------------------------------------ calls into the core

    def submit(self, fn: Callable[[EngineCore], T]) -> concurrent.futures.Future[T]:
        """Run `fn(engine_core)` between steps (thread-safe; for stats, tests, the
        dashboard). With a core process, `fn` and its result must pickle."""
        error = self._stopped_error()
        if error is not None:
            fut: concurrent.futures.Future[T] = concurrent.futures.Future()
            fut.set_exception(error)
            return fut
        return self.client.call(fn)

    async def call(self, fn: Callable[[EngineCore], T]) -> T:
        return await asyncio.wrap_future(self.submit(fn))

    def attach_core_observer(self, observer: CoreObserver) -> bool:
        """Have `observer.poll(core)` run after each step in the core's own thread (a
        dashboard tap); False when the core runs in a process (pass it at `launch`)."""
        if isinstance(self.client, ThreadedClient):
            self.client.set_observer(observer)
            return True
        return False

    def _on_event(self, kind: str, payload: dict[str, Any]) -> None:
        callback = self.on_dashboard
        if kind == "dashboard" and callback is not None:
            callback(payload)

    # ------------------------------------------------------------ output thread

    def _output_loop(self) -> None:
        client = self.client
        try:
            while True:
                outputs = client.get_output()
                if outputs is not None:
                    self._on_outputs(outputs)
        except EngineDeadError:
            self._die(client.dead_error)
        except BaseException as exc:  # a bug on this side: the stream is lost, say so
            logger.exception("the engine's output thread failed")
            self._dead_error = exc
            self._die(exc)

    def _on_outputs(self, core: EngineCoreOutputs) -> None:
        with self._lock:
            processed = self.output_processor.process_outputs(core.outputs)
            items = []
            for out in processed.request_outputs:
                rid = out.request_id
                tracked = self._tracked.pop(rid, None) if out.finished else self._tracked.get(rid)
                if tracked is not None:
                    items.append((tracked, out))
        if processed.reqs_to_finish:  # stop strings: the core frees their blocks
            self.client.abort_requests(processed.reqs_to_finish, FinishReason.STOP)
        deliver(items)
        if core.scheduler_stats is not None:
            self._core_stats = core.scheduler_stats
        if core.step_seconds is not None:
            self.iteration_stats = processed.stats
        observer = self.observer
        if observer is not None:
            try:  # metrics must never be what stops the engine
                view = StatsView(
                    self.get_stats(),
                    processed.stats,
                    getattr(self.client, "core_stats", None),
                    core.engine_index,
                )
                observer.on_step(view, core.step_seconds)
            except Exception:
                logger.exception("the step observer failed")

    def _die(self, error: BaseException | None) -> None:
        """The core is gone (or was shut down): fail everything still waiting."""
        stopped = self._stopped_error() or EngineDeadError("the engine was shut down")
        with self._lock:
            tracked = self._tracked
            self._tracked = {}
        deliver((t, stopped) for t in tracked.values())

    # ------------------------------------------------------------ shutdown

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine core (in-flight requests fail with EngineDeadError); idempotent."""
        if self._closed:
            return
        self._closed = True
        self.client.shutdown(timeout)
        self._output_thread.join(timeout)
        self.input_pool.shutdown(wait=False, cancel_futures=True)


def _load_assets_in_background(config: EngineConfig) -> concurrent.futures.Future[ModelAssets]:
    """The front end's tokenizer loads while the core process starts (it is seconds of
    single-threaded Python on either side, so a start need not pay them one after the
    other). A download happens here: the core waits on the hub's file locks if it asks for
    the same files meanwhile."""
    loading = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model-assets")
    future = loading.submit(_load_assets, config)
    loading.shutdown(wait=False)
    return future


def _load_assets(config: EngineConfig) -> ModelAssets:
    # Imported on the loading thread: the module brings torch (seconds) with it.
    from pagemill.runtime.engine.model_assets import ModelAssets

    return ModelAssets.load(config)


class EngineLaunch:
    """A core process being started and the front end's assets loading (`AsyncEngine.start`)."""

    def __init__(
        self,
        engine_cls: type[AsyncEngine],
        config: EngineConfig,
        client: EngineCoreClient,
        assets: concurrent.futures.Future[ModelAssets],
        watchers: WatcherCount | None,
    ) -> None:
        self.engine_cls = engine_cls
        self.config = config
        self.client = client
        self.assets = assets
        self.watchers = watchers

    def result(
        self, *, max_pending: int | None = None, observer: StepObserver | None = None
    ) -> AsyncEngine:
        """The front end once the core is ready; RuntimeError saying why if it could not
        start (its process is stopped then)."""
        client = self.client
        try:
            wait_ready = getattr(client, "wait_ready", None)
            if wait_ready is not None:
                wait_ready()
            try:
                assets = self.assets.result()
            except Exception as exc:  # as a core that cannot start: RuntimeError saying why
                raise RuntimeError(f"the engine could not start: {exc}") from exc
            front = self.engine_cls(
                max_pending=max_pending,
                observer=observer,
                client=client,
                assets=assets,
                config=self.config,
            )
        except BaseException:
            client.shutdown()
            raise
        front.dashboard_watchers = self.watchers
        return front

    def cancel(self) -> None:
        """Stop the core (the caller will not serve after all)."""
        self.client.shutdown()
