"""The engine, driven by its own thread, seen from asyncio as one async stream per request.

`LLMEngine.step()` runs a forward pass: seconds on a CPU, milliseconds on a GPU, and never
something an event loop may wait on. So one dedicated thread owns the engine and is the
only code that ever touches it. The event loop talks to it through a thread-safe command
queue (add, abort, call), and the thread hands outputs back to per-request asyncio queues
with `loop.call_soon_threadsafe`. Commands are applied between steps, so an abort frees
the request's blocks before the next step is scheduled. When there is nothing to run the
thread blocks on the command queue instead of spinning.

If a step raises, the engine's state is unknown: the thread marks the client dead, fails
every in-flight request with `EngineDeadError`, and answers every later command with it
(/health turns 503).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine thread stopped after an error; nothing more can be served."""


class QueueFullError(RuntimeError):
    """The configured limit on pending requests is reached; retry later."""


class EngineLike(Protocol):
    """What the thread drives (pagemill.runtime.LLMEngine satisfies it; tests use doubles)."""

    def add_request(self, request_id: str, prompt: Any, params: Any, **kwargs: Any) -> None: ...
    def step(self) -> list[Any]: ...
    def abort_request(self, request_ids: Sequence[str]) -> None: ...
    def has_unfinished_requests(self) -> bool: ...


class StepObserver(Protocol):
    """Called on the engine thread after every step (metrics.EngineMetrics implements it).

    It reads the engine's own figures (`get_stats()`, `iteration_stats`), so what a
    dashboard shows is what the engine counted, not what the HTTP layer happened to see.
    """

    def on_step(self, engine: Any) -> None: ...


@dataclass
class _Tracked:
    """Where the outputs of one live request go."""

    out_queue: asyncio.Queue[Any]
    loop: asyncio.AbstractEventLoop


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
class _Call:
    fn: Callable[[Any], Any]
    done: concurrent.futures.Future[Any]


_SHUTDOWN = object()


def _deliver(tracked: _Tracked, item: Any) -> None:
    # The loop may be gone (server shut down mid-request): nobody is left to tell.
    with contextlib.suppress(RuntimeError):
        tracked.loop.call_soon_threadsafe(tracked.out_queue.put_nowait, item)


class AsyncEngine:
    """Runs an engine on a background thread; safe to use from any event loop.

    `max_pending` caps the requests accepted at once (running + waiting in the engine);
    beyond it `add_request` raises `QueueFullError` (the server answers 429).
    """

    def __init__(self, engine: EngineLike, *, max_pending: int | None = None,
                 observer: StepObserver | None = None, name: str = "pagemill-engine") -> None:
        if max_pending is not None and max_pending < 1:
            raise ValueError(f"max_pending must be None or >= 1, got {max_pending}")
        self.engine = engine
        self.max_pending = max_pending
        self.observer = observer
        self.dead_error: BaseException | None = None
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._held: set[str] = set()  # accepted and not yet released; under _lock
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ client side

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    @property
    def num_pending(self) -> int:
        return len(self._held)

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self.dead_error!r}")

    def submit(self, fn: Callable[[Any], T]) -> concurrent.futures.Future[T]:
        """Run `fn(engine)` on the engine thread between steps (thread-safe; for stats, tests)."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self.dead_error is not None:
            fut.set_exception(EngineDeadError(f"the engine stopped after an error: {self.dead_error!r}"))
            return fut
        self._commands.put(_Call(fn, fut))
        return fut

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
        command queue counts towards the request's latency.
        """
        self._check_alive()
        with self._lock:
            if self.max_pending is not None and len(self._held) >= self.max_pending:
                raise QueueFullError(f"the server already holds {len(self._held)} requests "
                                     f"(limit {self.max_pending})")
            if request_id in self._held:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._held.add(request_id)
        kwargs.setdefault("arrival_time", time.monotonic())
        q: asyncio.Queue[Any] = out_queue if out_queue is not None else asyncio.Queue()
        tracked = _Tracked(q, asyncio.get_running_loop())
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._commands.put(_Add(request_id, prompt, params, kwargs, tracked, done))
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            # The add may already have happened on the engine thread: undo it.
            self.release(request_id, finished=False)
            raise
        except BaseException:
            self.release(request_id, finished=True)
            raise
        return q

    def abort(self, request_id: str | Sequence[str]) -> None:
        """Abort requests (no-op for finished or unknown ids); blocks are freed before the next step."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if ids and self.dead_error is None:
            self._commands.put(_Abort(ids))

    def release(self, request_id: str, *, finished: bool) -> None:
        """The caller stops reading `request_id`: abort it unless it finished; free its slot.

        Idempotent: every exit path of a handler may call it without double counting.
        """
        with self._lock:
            if request_id not in self._held:
                return
            self._held.discard(request_id)
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

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (in-flight requests are aborted); idempotent."""
        if self._thread.is_alive():
            self._commands.put(_SHUTDOWN)
            self._thread.join(timeout)

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
                    self._stop_all()
                    return
                for command in commands:
                    self._apply(command)
                if self.engine.has_unfinished_requests():
                    self._dispatch(self.engine.step())
                    if self.observer is not None:
                        self.observer.on_step(self.engine)
                elif commands and self.observer is not None:
                    self.observer.on_step(self.engine)
        except BaseException as exc:
            logger.exception("the engine thread failed; the server can no longer serve")
            self._die(exc)

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
        elif isinstance(command, _Call) and command.done.set_running_or_notify_cancel():
            try:
                command.done.set_result(command.fn(self.engine))
            except Exception as exc:
                command.done.set_exception(exc)

    def _dispatch(self, outputs: list[Any]) -> None:
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue  # aborted between the step and now
            if out.finished:
                del self._tracked[out.request_id]
            _deliver(tracked, out)

    def _stop_all(self) -> None:
        ids = list(self._tracked)
        if ids:
            with contextlib.suppress(Exception):
                self.engine.abort_request(ids)
        for rid in ids:
            _deliver(self._tracked.pop(rid), EngineDeadError("the engine was shut down"))

    def _die(self, exc: BaseException) -> None:
        self.dead_error = exc
        error = EngineDeadError(f"the engine stopped after an error: {exc!r}")
        for tracked in self._tracked.values():
            _deliver(tracked, error)
        self._tracked.clear()
        # Keep answering commands so no caller waits forever on a future.
        while True:
            command = self._commands.get()
            if command is _SHUTDOWN:
                return
            if isinstance(command, (_Add, _Call)) and command.done.set_running_or_notify_cancel():
                command.done.set_exception(error)
