"""The engine seen from asyncio: one async stream per request, the engine never on the loop.

`LLMEngine.step()` runs a forward pass: milliseconds to seconds, and never something an
event loop may wait on — nor something that may wait on the event loop. Two ways to run it
behind the same client API (`add_request`, `stream`, `abort`, `release`, `submit`, `call`,
`shutdown`, `is_dead`):

- `AsyncEngine(engine)`: in this process, on one dedicated thread that is the only code to
  touch the engine. For embedding, notebooks and tests (any object with the `EngineLike`
  methods will do, so tests drive it with scripted doubles).
- `AsyncEngine.launch(config)`: the engine core in its own process (`engine_process`), as
  `pagemill serve` runs it. The engine then shares no interpreter lock with the HTTP side:
  the event loop's Python (request parsing, SSE encoding, socket writes) runs beside the
  step on another core instead of interleaving with it, and a busy or stalled loop cannot
  slow a step.

Either way commands (add, abort, call) are applied between steps, so an abort frees the
request's blocks before the next step is scheduled; the engine side blocks on its command
queue when there is nothing to run instead of spinning; and a step's outputs reach their
requests' asyncio queues with one `call_soon_threadsafe` per event loop per step.

A step that raises because of one request is contained by the engine core (that request
finishes with finish_reason "error"). If `step()` itself raises, the engine's state is
unknown: the client is marked dead, every in-flight request fails with `EngineDeadError`,
and so does every later command; the server's watchdog then exits non-zero (see
`shutdown`). An engine process that exits for any reason is noticed the same way.
`step_started_at` tells the watchdog how long the current step has run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from .dashboard import DashboardSettings

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine stopped (after an error, or shut down); nothing more can be served."""


class ServerShuttingDownError(EngineDeadError):
    """In-flight requests ended by a shutdown (its timeout ran out) or a fatal engine error."""


class QueueFullError(RuntimeError):
    """The configured limit on pending requests is reached; retry later."""


class EngineLike(Protocol):
    """What the thread drives (pagemill.runtime.LLMEngine satisfies it; tests use doubles)."""

    def add_request(self, request_id: str, prompt: Any, params: Any, **kwargs: Any) -> None: ...
    def step(self) -> list[Any]: ...
    def abort_request(self, request_ids: Sequence[str]) -> None: ...
    def has_unfinished_requests(self) -> bool: ...


class StepObserver(Protocol):
    """Told about every step (metrics.EngineMetrics implements it).

    It reads the engine's own figures (`get_stats()`, `iteration_stats`), so what a
    dashboard shows is what the engine counted, not what the HTTP layer happened to see.
    `step_seconds` is the wall time of `step()`, None after a batch of commands that ran no
    step. In-process it is called on the engine thread; with an engine process, on the
    client's reader thread with a view of the figures the engine process sent.
    """

    def on_step(self, engine: Any, step_seconds: float | None = None) -> None: ...


class StepObservers:
    """Several `StepObserver`s as one (metrics and the dashboard); one failing does not
    keep the others from being told."""

    def __init__(self, *observers: StepObserver) -> None:
        self.observers = observers

    def on_step(self, engine: Any, step_seconds: float | None = None) -> None:
        for observer in self.observers:
            try:
                observer.on_step(engine, step_seconds)
            except Exception:
                logger.exception("a step observer failed")


@dataclass
class _Tracked:
    """Where the outputs of one live request go."""

    out_queue: asyncio.Queue[Any]
    loop: asyncio.AbstractEventLoop


def _put_all(batch: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for q, item in batch:
        q.put_nowait(item)


def deliver(items: Iterable[tuple[_Tracked, Any]]) -> None:
    """Hand items to their queues: one wake-up of each event loop, however many items.

    Thread-safe and never blocking: the loop runs the puts when it gets to them. A loop
    that is gone (server shut down mid-request) has nobody left to tell.
    """
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], Any]]] = {}
    for tracked, item in items:
        by_loop.setdefault(tracked.loop, []).append((tracked.out_queue, item))
    for loop, batch in by_loop.items():
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_put_all, batch)


@dataclass
class _Add:
    request_id: str
    prompt: Any
    params: Any
    kwargs: dict[str, Any]
    tracked: _Tracked
    done: concurrent.futures.Future[None]


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _FailAll:
    error: BaseException


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    done: concurrent.futures.Future[Any]


_SHUTDOWN = object()


class AsyncEngine:
    """Runs an engine on a background thread; safe to use from any event loop.

    `max_pending` caps the requests accepted at once (running + waiting in the engine);
    beyond it `add_request` raises `QueueFullError` (the server answers 429).
    `AsyncEngine.launch(config)` runs the engine in its own process instead, behind the
    same API.
    """

    def __init__(self, engine: EngineLike, *, max_pending: int | None = None,
                 observer: StepObserver | None = None, name: str = "pagemill-engine") -> None:
        self._init_client(engine, max_pending, observer)
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @classmethod
    def launch(cls, config: Any = None, *, max_pending: int | None = None,
               observer: StepObserver | None = None, engine_threads: int | None = None,
               start_timeout: float | None = None, dashboard: DashboardSettings | None = None,
               **engine_kwargs: Any) -> AsyncEngine:
        """Start an `LLMEngine(config)` (or `LLMEngine(**engine_kwargs)`) in its own process.

        Returns once the engine is built (model loaded, KV pool sized, step compiled).
        `engine_threads` sets torch's intra-op threads there (None: on CPU one per usable
        core, with OpenMP's idle spin bounded; see `engine_process.default_engine_threads`).
        `client.engine` is then a view (tokenizer, `encode`, `apply_chat_template`,
        `max_model_len`, `model_config`, `config`), and `submit`/`call` take picklable
        functions (module-level, or `functools.partial` of one). `dashboard` (a
        `dashboard.DashboardSettings`) lets the engine process take pictures for the
        dashboard page. See `engine_process`.
        """
        from .engine_process import EngineProcessClient

        return EngineProcessClient(config, max_pending=max_pending, observer=observer,
                                   engine_threads=engine_threads, start_timeout=start_timeout,
                                   dashboard=dashboard, **engine_kwargs)

    def _init_client(self, engine: Any, max_pending: int | None,
                     observer: StepObserver | None) -> None:
        if max_pending is not None and max_pending < 1:
            raise ValueError(f"max_pending must be None or >= 1, got {max_pending}")
        self.engine = engine
        self.max_pending = max_pending
        self.observer = observer
        self.dead_error: BaseException | None = None
        self._closed = False
        self._held: dict[str, int] = {}  # accepted, not yet released -> slots; under _lock
        self._num_slots = 0
        self._lock = threading.Lock()
        self._step_started: float | None = None  # monotonic start of the running step

    # ------------------------------------------------------------ client side

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
        return self._step_started

    def _stopped_error(self) -> EngineDeadError | None:
        if self.dead_error is not None:
            return EngineDeadError(f"the engine stopped after an error: {self.dead_error!r}")
        if self._closed:
            return EngineDeadError("the engine was shut down")
        return None

    def _check_alive(self) -> None:
        error = self._stopped_error()
        if error is not None:
            raise error

    async def call(self, fn: Callable[[Any], T]) -> T:
        return await asyncio.wrap_future(self.submit(fn))

    async def add_request(self, request_id: str, prompt: str | list[int], params: Any, *,
                          out_queue: asyncio.Queue[Any] | None = None,
                          **kwargs: Any) -> asyncio.Queue[Any]:
        """Hand a request to the engine; its outputs arrive on the returned queue.

        Several requests may share one `out_queue` (a batch of prompts in one HTTP call);
        each item is a RequestOutput (a delta, for streaming parameters) or an exception.
        The engine's own validation errors (ValueError) are raised here, before anything
        is streamed. The caller must call `release(request_id)` once it stops reading,
        finished or not. `arrival_time` (monotonic) defaults to now: the time spent in the
        command queue counts towards the request's latency. A request counts against
        `max_pending` once per choice (`params.n`).
        """
        self._check_alive()
        slots = int(getattr(params, "n", 1) or 1)
        with self._lock:
            if self.max_pending is not None and self._num_slots + slots > self.max_pending:
                raise QueueFullError(f"the server already holds {self._num_slots} sequences "
                                     f"(limit {self.max_pending})")
            if request_id in self._held:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._held[request_id] = slots
            self._num_slots += slots
        kwargs.setdefault("arrival_time", time.monotonic())
        q: asyncio.Queue[Any] = out_queue if out_queue is not None else asyncio.Queue()
        tracked = _Tracked(q, asyncio.get_running_loop())
        try:
            done = self._post_add(request_id, prompt, params, kwargs, tracked)
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            # The add may already have happened on the engine side: undo it.
            self.release(request_id, finished=False)
            raise
        except BaseException:
            self.release(request_id, finished=True)
            raise
        return q

    def abort(self, request_id: str | Sequence[str]) -> None:
        """Abort requests (no-op for finished or unknown ids); blocks are freed before the next step."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if ids and self.dead_error is None and not self._closed:
            self._post_abort(ids)

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

    async def stream(self, out_queue: asyncio.Queue[Any], request_ids: Sequence[str]
                     ) -> AsyncIterator[Any]:
        """Yield RequestOutputs of `request_ids` from `out_queue` until all have finished.

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
                yield item
        finally:
            for rid in live:
                self.release(rid, finished=False)

    # ------------------------------------------------------------ transport (in-process)

    def submit(self, fn: Callable[[Any], T]) -> concurrent.futures.Future[T]:
        """Run `fn(engine)` on the engine thread between steps (thread-safe; for stats, tests)."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        error = self._stopped_error()
        if error is not None:
            fut.set_exception(error)
            return fut
        self._commands.put(_Call(fn, fut))
        return fut

    def _post_add(self, request_id: str, prompt: Any, params: Any, kwargs: dict[str, Any],
                  tracked: _Tracked) -> concurrent.futures.Future[None]:
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._commands.put(_Add(request_id, prompt, params, kwargs, tracked, done))
        return done

    def _post_abort(self, request_ids: list[str]) -> None:
        self._commands.put(_Abort(request_ids))

    def fail_all(self, error: BaseException) -> None:
        """Abort every request in flight and end its stream with `error` (shutdown)."""
        if self.dead_error is None and not self._closed:
            self._commands.put(_FailAll(error))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (in-flight requests are aborted); idempotent."""
        self._closed = True
        if self._thread.is_alive():
            self._commands.put(_SHUTDOWN)
            self._thread.join(timeout)
        stop = getattr(self.engine, "shutdown", None)
        if stop is not None and not self._thread.is_alive():
            stop()  # e.g. the engine's tensor-parallel workers

    # ------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                # Block only when there is nothing to step; else take what has arrived.
                commands = [self._commands.get()] if idle else []
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                if any(c is _SHUTDOWN for c in commands):
                    self._stop_all(commands)
                    return
                for command in commands:
                    self._apply(command)
                if self.engine.has_unfinished_requests():
                    t0 = time.perf_counter()
                    self._step_started = time.monotonic()
                    outputs = self.engine.step()
                    self._step_started = None
                    step_seconds = time.perf_counter() - t0
                    self._dispatch(outputs)
                    self._observe(step_seconds)
                elif commands:
                    self._observe(None)
        except BaseException as exc:
            logger.exception("the engine thread failed; the server can no longer serve")
            self._die(exc)

    def _observe(self, step_seconds: float | None) -> None:
        if self.observer is None:
            return
        try:  # metrics must never be what stops the engine
            self.observer.on_step(self.engine, step_seconds)
        except Exception:
            logger.exception("the step observer failed")

    def _apply(self, command: Any) -> None:
        if isinstance(command, _Add):
            if command.done.set_running_or_notify_cancel():
                try:
                    self.engine.add_request(command.request_id, command.prompt, command.params,
                                            **command.kwargs)
                except Exception as exc:  # the engine's validation of this one request
                    command.done.set_exception(exc)
                    return
                self._tracked[command.request_id] = command.tracked
                command.done.set_result(None)
        elif isinstance(command, _Abort):
            ids = [rid for rid in command.request_ids if rid in self._tracked]
            if ids:
                self.engine.abort_request(ids)
                for rid in ids:
                    del self._tracked[rid]
        elif isinstance(command, _FailAll):
            ids = list(self._tracked)
            if ids:
                self.engine.abort_request(ids)
                deliver((self._tracked.pop(rid), command.error) for rid in ids)
        elif isinstance(command, _Call) and command.done.set_running_or_notify_cancel():
            try:
                command.done.set_result(command.fn(self.engine))
            except Exception as exc:
                command.done.set_exception(exc)

    def _dispatch(self, outputs: list[Any]) -> None:
        items = []
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue  # aborted between the step and now
            if out.finished:
                del self._tracked[out.request_id]
            items.append((tracked, out))
        deliver(items)

    def _stop_all(self, unapplied: list[Any]) -> None:
        ids = list(self._tracked)
        if ids:
            with contextlib.suppress(Exception):
                self.engine.abort_request(ids)
        error = EngineDeadError("the engine was shut down")
        deliver((self._tracked.pop(rid), error) for rid in ids)
        self._fail_queued(error, unapplied)

    def _fail_queued(self, error: BaseException, commands: list[Any] | None = None) -> None:
        """Fail the futures of commands that will never be applied (taken or still queued)."""
        pending = list(commands or [])
        while True:
            try:
                pending.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for command in pending:
            if isinstance(command, (_Add, _Call)) and command.done.set_running_or_notify_cancel():
                command.done.set_exception(error)

    def _die(self, exc: BaseException) -> None:
        self.dead_error = exc
        error = EngineDeadError(f"the engine stopped after an error: {exc!r}")
        deliver((tracked, error) for tracked in self._tracked.values())
        self._tracked.clear()
        # Keep answering commands so no caller waits forever on a future.
        while True:
            command = self._commands.get()
            if command is _SHUTDOWN:
                self._fail_queued(error)
                return
            if isinstance(command, (_Add, _Call)) and command.done.set_running_or_notify_cancel():
                command.done.set_exception(error)
