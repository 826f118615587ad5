"""How a front end drives an engine core: in its thread, on a thread of its own, or in a
process of its own — one interface, `EngineCoreClient`.

    front end (LLMEngine, the server's AsyncEngine)          engine core
    InputProcessor ─ EngineCoreRequest ─> client ─────────> EngineCore.step() loop
    OutputProcessor <─ EngineCoreOutputs ─ client <──────────┘  (token ids only)

- `InprocClient`: the core runs when the front end asks for output (`get_output` steps
  it). The offline `LLM` and `LLMEngine` use it: one thread, nothing to synchronise.
- `ThreadedClient`: the core's busy loop (`EngineCoreLoop`) on a thread of this process;
  messages are handed over as objects. Embedding an engine in a server process
  (`AsyncEngine(LLMEngine(...))`, `pagemill serve --no-engine-process`).
- `MPClient`: the same loop in a spawned process (`run_engine_core`), messages encoded
  with msgspec over two pipes. The engine then shares no interpreter lock with the HTTP
  side: the event loop's Python runs beside the step on another core.

Every client answers each batch of commands with one `EngineCoreOutputs` (a step's, or
fresh stats when nothing ran), so a front end that processes outputs only when they arrive
still sees its aborts take effect. A core that fails beyond containment (a step raised, a
tensor-parallel worker died, the process exited) turns the client dead: `get_output`
raises `EngineDeadError` from then on. Outputs carry `engine_index`, so one front end can
later drive several cores (data parallel) through the same interface.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pagemill.runtime.engine.protocol import (
    AbortRequests,
    Codec,
    EngineCoreEvent,
    EngineCoreFailed,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    FinishReason,
    Message,
    Shutdown,
    UtilityCall,
    UtilityResult,
)

if TYPE_CHECKING:
    from pagemill.runtime.config import EngineConfig
    from pagemill.runtime.engine.core import EngineCore

logger = logging.getLogger(__name__)

T = TypeVar("T")
_PICKLE = pickle.HIGHEST_PROTOCOL


class EngineDeadError(RuntimeError):
    """The engine core stopped (after an error, or shut down); nothing more can be served."""


class CoreObserver(Protocol):
    """Looks at the core after each step, in the core's own thread or process (the
    dashboard's picture tap): returns plain data to send to the front end, or None."""

    def poll(self, core: EngineCore) -> dict[str, Any] | None: ...


class Heartbeat(Protocol):
    """[steps run, end of the last step, start of the running one]: a list on a thread, a
    shared `RawArray("d", 3)` for a process."""

    def __getitem__(self, index: int, /) -> float: ...

    def __setitem__(self, index: int, value: float, /) -> None: ...


class EngineCoreClient(ABC):
    """The front end's handle on one engine core (see the module docstring)."""

    info: EngineCoreReady
    # Called with (kind, payload) for each `EngineCoreEvent` (a dashboard picture), on the
    # thread that receives it.
    on_event: Callable[[str, dict[str, Any]], None] | None = None

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(
        self, request_ids: list[str], reason: FinishReason = FinishReason.ABORT
    ) -> None: ...

    @abstractmethod
    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        """The next outputs (None if `timeout` passed first); raises EngineDeadError."""

    @abstractmethod
    def call(self, fn: Callable[[EngineCore], T]) -> concurrent.futures.Future[T]:
        """Run `fn(core)` between steps. A process client pickles `fn` (a module-level
        function or a `functools.partial` of one) and its result."""

    @abstractmethod
    def shutdown(self, timeout: float = 10.0) -> None: ...

    @property
    @abstractmethod
    def dead_error(self) -> BaseException | None: ...

    # Watchdog figures: read without any message (shared memory for a process).
    @property
    def step_started_at(self) -> float | None:
        """`time.monotonic()` when the running step began; None between steps."""
        return None

    @property
    def engine_steps(self) -> int:
        return 0

    @property
    def last_step_time(self) -> float | None:
        return None

    @property
    def engine_pid(self) -> int | None:
        return os.getpid()


def _stats_only(core: EngineCore) -> EngineCoreOutputs:
    return EngineCoreOutputs(scheduler_stats=core.get_stats())


class InprocClient(EngineCoreClient):
    """The core in the caller's thread: `get_output` runs one step."""

    def __init__(self, core: EngineCore) -> None:
        self.engine_core = core
        self.info = core.ready_message()
        self._dead: BaseException | None = None

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(
        self, request_ids: list[str], reason: FinishReason = FinishReason.ABORT
    ) -> None:
        self.engine_core.abort_requests(request_ids, reason)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        # The step runs now, in this thread (there is nothing to wait for: `timeout` does
        # not apply). Always a step, even an empty one: it hands the model runner the
        # requests that finished since the last, so their rows go at once.
        core = self.engine_core
        t0 = time.perf_counter()
        out = core.step()
        out.step_seconds = time.perf_counter() - t0
        out.scheduler_stats = core.get_stats()
        return out

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def call(self, fn: Callable[[EngineCore], T]) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        try:
            fut.set_result(fn(self.engine_core))
        except Exception as exc:
            fut.set_exception(exc)
        return fut

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    def shutdown(self, timeout: float = 10.0) -> None:
        self.engine_core.shutdown()


# ---------------------------------------------------------------- the core's busy loop


@dataclass
class _LocalCall:
    """A utility call within one process: the function and future as they are."""

    fn: Callable[[EngineCore], Any]
    future: concurrent.futures.Future[Any]


# What the core's loop takes from its command channel.
Command = Message | _LocalCall


class EngineCoreLoop:
    """The core's own loop, wherever it runs: apply commands between steps, step while
    there is work, block on the command channel when there is none.

    `recv(block)` returns the next command (None when `block` is False and there is
    none) and raises EOFError when the front end is gone; `send` hands a message to the
    front end (the process transport encodes it on a sender thread, so no step waits on
    a pipe). `heartbeat` ([steps run, end of the last step, start of the running one]) is
    written after every step for a watchdog to read without any message.
    """

    def __init__(
        self,
        core: EngineCore,
        recv: Callable[[bool], Command | None],
        send: Callable[[Message], None],
        heartbeat: Heartbeat,
        observer: CoreObserver | None = None,
    ) -> None:
        self.core = core
        self.recv = recv
        self.send = send
        self.heartbeat = heartbeat
        self.observer = observer

    def run(self) -> None:
        core = self.core
        while True:
            commands = []
            try:
                block = not core.has_unfinished_requests()
                while True:
                    msg = self.recv(block)
                    if msg is None:
                        break
                    commands.append(msg)
                    block = False
            except EOFError:
                return  # the front end is gone
            for msg in commands:
                if isinstance(msg, Shutdown):
                    return
                self._apply(msg)
            if core.has_unfinished_requests():
                hb = self.heartbeat
                hb[2] = time.monotonic()  # a step is running since
                t0 = time.perf_counter()
                out = core.step()
                out.step_seconds = time.perf_counter() - t0
                hb[0] += 1
                hb[1] = time.monotonic()
                hb[2] = 0.0
                out.scheduler_stats = core.get_stats()
                self.send(out)
            elif commands:
                self.send(_stats_only(core))
            else:
                continue
            if self.observer is not None:
                try:
                    payload = self.observer.poll(core)
                except Exception:
                    logger.exception("a core observer failed")
                    payload = None
                if payload is not None:
                    self.send(EngineCoreEvent("dashboard", payload))

    def _apply(self, msg: Command) -> None:
        core = self.core
        if isinstance(msg, EngineCoreRequest):
            try:
                core.add_request(msg)
            except Exception as exc:  # validated by the front end: a bug there, not here
                logger.exception("request %s could not be added", msg.request_id)
                self.send(
                    EngineCoreOutputs(
                        [
                            EngineCoreOutput(
                                msg.request_id,
                                [],
                                FinishReason.ERROR,
                                f"{type(exc).__name__}: {exc}",
                            )
                        ]
                    )
                )
        elif isinstance(msg, AbortRequests):
            core.abort_requests(msg.request_ids, msg.reason)
        elif isinstance(msg, _LocalCall):
            if msg.future.set_running_or_notify_cancel():
                try:
                    msg.future.set_result(msg.fn(core))
                except Exception as exc:
                    msg.future.set_exception(exc)
        elif isinstance(msg, UtilityCall):
            try:
                # Unpickled here, not with the message: a function this process cannot
                # import (a test module, a script's __main__) fails its call alone.
                value = pickle.dumps(pickle.loads(msg.fn)(core), protocol=_PICKLE)
                ok = True
            except Exception as exc:
                value, ok = pickle.dumps(_picklable_error(exc), protocol=_PICKLE), False
            self.send(UtilityResult(msg.call_id, ok, value))
        else:
            raise TypeError(f"not a command for the engine core: {type(msg).__name__}")


def _picklable_error(exc: BaseException) -> BaseException:
    try:
        pickle.dumps(exc, protocol=_PICKLE)
        return exc
    except Exception:
        return RuntimeError(repr(exc))


# ---------------------------------------------------------------- clients with a loop


class _Dead:
    """Put in the output queue when the core stops: every later `get_output` raises."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


class _LoopClient(EngineCoreClient):
    """What the thread and process clients share: an output queue, a dead state, and the
    heartbeat the core's loop writes (a list in this process, shared memory for another)."""

    heartbeat: Heartbeat

    def __init__(self) -> None:
        self._outputs: queue.SimpleQueue[EngineCoreOutputs | _Dead] = queue.SimpleQueue()
        self._dead_error: BaseException | None = None
        self._closed = False
        self._dead_event = threading.Event()

    @property
    def step_started_at(self) -> float | None:
        return self.heartbeat[2] or None

    @property
    def engine_steps(self) -> int:
        return int(self.heartbeat[0])

    @property
    def last_step_time(self) -> float | None:
        return self.heartbeat[1] or None

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead_error

    def _stopped(self) -> EngineDeadError | None:
        if self._dead_error is not None:
            return EngineDeadError(f"the engine stopped after an error: {self._dead_error!r}")
        if self._closed or self._dead_event.is_set():
            return EngineDeadError("the engine was shut down")
        return None

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        try:
            item = self._outputs.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, _Dead):
            self._outputs.put(item)  # every later caller learns it too
            raise self._stopped() or EngineDeadError("the engine was shut down")
        return item

    def _die(self, error: BaseException | None) -> None:
        if error is not None and self._dead_error is None:
            self._dead_error = error
        if not self._dead_event.is_set():
            self._dead_event.set()
            self._outputs.put(_Dead(error))

    def _emit_event(self, kind: str, payload: dict[str, Any]) -> None:
        callback = self.on_event
        if callback is not None:
            try:
                callback(kind, payload)
            except Exception:
                logger.exception("an engine event handler failed")


class ThreadedClient(_LoopClient):
    """The core's loop on a thread of this process: the only code that touches the core."""

    def __init__(
        self, core: EngineCore, observer: CoreObserver | None = None, name: str = "pagemill-engine"
    ) -> None:
        super().__init__()
        self.engine_core = core
        self.info = core.ready_message()
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.heartbeat = [0.0, 0.0, 0.0]
        self._loop = EngineCoreLoop(core, self._recv, self._send, self.heartbeat, observer)
        core.on_worker_failure(self._die)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def set_observer(self, observer: CoreObserver | None) -> None:
        """Look at the core after each step from now on (the loop reads it each step)."""
        self._loop.observer = observer

    def _recv(self, block: bool) -> Command | None:
        if block:
            return self._commands.get()
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _send(self, msg: Message) -> None:
        if isinstance(msg, EngineCoreOutputs):
            self._outputs.put(msg)
        elif isinstance(msg, EngineCoreEvent):
            self._emit_event(msg.kind, msg.payload)

    def _run(self) -> None:
        try:
            self._loop.run()
        except BaseException as exc:
            logger.exception("the engine core failed; it can no longer serve")
            self._die(exc)
            self._refuse_calls(exc)
            return
        self._die(None)
        self._refuse_calls(None)

    def _refuse_calls(self, error: BaseException | None) -> None:
        """Fail the utility calls nobody will run (keep answering until shutdown)."""
        dead = self._stopped() or EngineDeadError("the engine was shut down")
        while True:
            try:
                msg = self._commands.get(timeout=None if error is not None else 0)
            except queue.Empty:
                return
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, _LocalCall) and msg.future.set_running_or_notify_cancel():
                msg.future.set_exception(dead)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._commands.put(request)

    def abort_requests(
        self, request_ids: list[str], reason: FinishReason = FinishReason.ABORT
    ) -> None:
        self._commands.put(AbortRequests(list(request_ids), reason))

    def call(self, fn: Callable[[EngineCore], T]) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        error = self._stopped()
        if error is not None:
            fut.set_exception(error)
        else:
            self._commands.put(_LocalCall(fn, fut))
        return fut

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._commands.put(Shutdown())
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine_core.shutdown()  # e.g. the tensor-parallel workers
        self._die(None)


# ---------------------------------------------------------------- the core in a process

# How long (in spin iterations, some tens of microseconds) the engine's idle OpenMP threads
# spin before they sleep; see `default_engine_threads`.
ENGINE_GOMP_SPINCOUNT = "20000"
# How long a core process waits, before it reports ready, for the grammar side started
# beside its model's load (normally done well before; a wedged start must not hold it).
GRAMMAR_START_WAIT_S = 60.0


def default_engine_threads(config: EngineConfig, own_process: bool = True) -> int | None:
    """Torch threads for a served CPU engine: one per usable core in an engine process, one
    per core but one on a thread of the server process (`own_process=False`).

    The engine process shares the cores with the HTTP side, and OpenMP's idle threads spin
    (by default for long enough to span the gap between two steps) on the cores the HTTP
    side needs. Bounding the spin (`ENGINE_GOMP_SPINCOUNT`, set for the engine process
    unless GOMP_SPINCOUNT or OMP_WAIT_POLICY is set) keeps the threads hot inside a step
    and lets them sleep between steps, and then every core can run the step (see the
    server README for the measurements). In the server process OpenMP is already running
    with its default spin, so there a core is left to the HTTP side. None (torch's default)
    on a GPU or when OMP_NUM_THREADS is set.
    """
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    try:
        if config.resolve_device() != "cpu":
            return None
    except Exception:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) - (0 if own_process else 1))


@contextlib.contextmanager
def _engine_environment() -> Iterator[None]:
    """os.environ as the engine process should start with it (a spawned child copies it, and
    OpenMP reads it once, when torch loads)."""
    if os.environ.get("GOMP_SPINCOUNT") or os.environ.get("OMP_WAIT_POLICY"):
        yield
        return
    os.environ["GOMP_SPINCOUNT"] = ENGINE_GOMP_SPINCOUNT
    try:
        yield
    finally:
        os.environ.pop("GOMP_SPINCOUNT", None)


class _PipeSender:
    """Encodes and writes on its own thread, so whoever sends never waits on the pipe
    (unless it asks to: `send(msg, wait=True)` returns once the bytes are in the pipe)."""

    def __init__(self, conn: Connection, codec: Codec) -> None:
        self.conn = conn
        self.codec = codec
        self._queue: queue.SimpleQueue[tuple[Message, threading.Event | None] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(
            target=self._run, name="pagemill-engine-sender", daemon=True
        )
        self._thread.start()

    def send(self, msg: Message, wait: bool = False) -> None:
        done = threading.Event() if wait else None
        self._queue.put((msg, done))
        if done is not None:
            done.wait()

    def _run(self) -> None:
        broken = False  # the other side is gone: keep draining, so no sender waits forever
        while True:
            item = self._queue.get()
            if item is None:
                return
            msg, done = item
            if not broken:
                try:
                    self.conn.send_bytes(self.codec.encode(msg))
                except OSError:  # the peer is gone; its own pipe says so too
                    broken = True
            if done is not None:
                done.set()

    def close(self, timeout: float = 10.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)


def run_engine_core(
    commands: Connection,
    outputs: Connection,
    config: EngineConfig,
    engine_threads: int | None,
    log_level: int,
    heartbeat: Heartbeat,
    observer_factory: Callable[[], CoreObserver] | None = None,
) -> None:
    """Entry point of an engine-core process (spawned: nothing is inherited but these)."""
    # Ctrl-C reaches the whole process group: the front end decides when to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s [engine]: %(message)s")
    codec = Codec()
    sender = _PipeSender(outputs, codec)
    try:
        import torch

        if engine_threads is None:
            engine_threads = default_engine_threads(config)
        if engine_threads is not None:
            torch.set_num_threads(engine_threads)
        logger.info("engine process %d: %d torch threads", os.getpid(), torch.get_num_threads())
        from pagemill.runtime.engine.core import EngineCore

        core = EngineCore.from_config(config)
    except BaseException as exc:
        logger.exception("the engine could not be built")
        sender.send(EngineCoreFailed(f"{type(exc).__name__}: {exc}", at_start=True))
        sender.close()
        return

    def fail(error: BaseException, trace: str = "") -> None:
        sender.send(EngineCoreFailed(repr(error), trace))
        sender.close(5)
        os._exit(1)

    # A tensor-parallel worker that dies while the engine idles: exit now, as after a
    # failed step, rather than at the next request.
    core.on_worker_failure(fail)

    def recv(block: bool) -> Message | None:
        if not block and not commands.poll(0):
            return None
        return codec.decode(commands.recv_bytes())  # EOFError: the front end is gone

    observer = observer_factory() if observer_factory is not None else None
    loop = EngineCoreLoop(core, recv, sender.send, heartbeat, observer)
    # The grammar side, started beside the model's load (`EngineCore.from_config`), is
    # finished before ready, so that it does not take a CPU from the first requests' steps.
    # If it hangs, the first grammar waits for it instead.
    grammars = core.structured_output
    if grammars is not None and not grammars.wait_prestarted(GRAMMAR_START_WAIT_S):
        logger.warning(
            "the grammar workers are still starting after %.0f s; serving anyway",
            GRAMMAR_START_WAIT_S,
        )
    sender.send(core.ready_message())
    try:
        loop.run()
    except BaseException as exc:
        logger.exception("an engine step failed; the engine process exits")
        fail(exc, traceback.format_exc())
    core.shutdown()
    sender.close()


class MPClient(_LoopClient):
    """The engine core in a spawned process; returns once it reported ready and raises
    RuntimeError (saying why) if it could not be built.

    With `wait=False` it returns as soon as the process is started, and `wait_ready()`
    then finishes the start: the caller does its own start-up work (imports, the
    tokenizer) while the core's runs on another core. Nothing else may be called first.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        engine_threads: int | None = None,
        start_timeout: float | None = None,
        observer_factory: Callable[[], CoreObserver] | None = None,
        wait: bool = True,
    ) -> None:
        super().__init__()
        if engine_threads is not None and engine_threads < 1:
            raise ValueError(f"engine_threads must be None or >= 1, got {engine_threads}")
        self.codec = Codec()
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._call_ids = itertools.count()
        ctx = multiprocessing.get_context("spawn")
        # Written by the core after every step, read here without any message or lock.
        self.heartbeat = ctx.RawArray("d", 3)
        cmd_read, cmd_write = ctx.Pipe(duplex=False)
        out_read, out_write = ctx.Pipe(duplex=False)
        self.process = ctx.Process(
            target=run_engine_core,
            name="pagemill-engine-core",
            daemon=True,
            args=(
                cmd_read,
                out_write,
                config,
                engine_threads,
                logging.getLogger().getEffectiveLevel(),
                self.heartbeat,
                observer_factory,
            ),
        )
        with _engine_environment():
            self.process.start()
        # Our copies of the child's ends: closing them lets EOF mean "the other side is gone".
        cmd_read.close()
        out_write.close()
        self._commands_conn = cmd_write
        self._outputs_conn = out_read
        self._start_timeout = start_timeout
        self._started = False
        if wait:
            self.wait_ready()

    def wait_ready(self) -> EngineCoreReady:
        """Wait until the core reported ready (at once if it has); raises RuntimeError
        saying why if it could not be built, having stopped its process."""
        if self._started:
            return self.info
        try:
            self.info = self._wait_ready(self._start_timeout)
        except BaseException:
            self._closed = True
            self._kill()
            raise
        # Commands are encoded and written on a thread of their own, so neither the event
        # loop nor the output thread ever waits on a full pipe while the core steps.
        self._writer = _PipeSender(self._commands_conn, self.codec)
        self._reader = threading.Thread(
            target=self._read_loop, name="pagemill-engine-reader", daemon=True
        )
        self._reader.start()
        self._started = True
        return self.info

    def _wait_ready(self, timeout: float | None) -> EngineCoreReady:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 1.0 if deadline is None else min(1.0, max(0.0, deadline - time.monotonic()))
            if self._outputs_conn.poll(wait):
                try:
                    msg = self.codec.decode(self._outputs_conn.recv_bytes())
                except EOFError:
                    self.process.join(5)
                    raise RuntimeError(
                        "the engine process exited during start-up "
                        f"(exit code {self.process.exitcode})"
                    ) from None
                if isinstance(msg, EngineCoreReady):
                    return msg
                if isinstance(msg, EngineCoreFailed):
                    raise RuntimeError(f"the engine could not start: {msg.message}")
            elif not self.process.is_alive():
                raise RuntimeError(
                    f"the engine process exited during start-up (exit code {self.process.exitcode})"
                )
            if deadline is not None and time.monotonic() >= deadline:
                raise RuntimeError(f"the engine did not start within {timeout:.0f}s")

    # ------------------------------------------------------------ commands

    def _write(self, msg: Message) -> None:
        """Queue a command for the writer thread (if the process is gone, the reader
        reports it and every waiting caller fails then)."""
        self._writer.send(msg)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Returns once the request is in the pipe (the writer thread orders it with every
        other command); call it off the event loop."""
        error = self._stopped()
        if error is not None:
            raise error
        self._writer.send(request, wait=True)

    def abort_requests(
        self, request_ids: list[str], reason: FinishReason = FinishReason.ABORT
    ) -> None:
        if self._stopped() is None:
            self._write(AbortRequests(list(request_ids), reason))

    def call(self, fn: Callable[[EngineCore], T]) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        error = self._stopped()
        if error is not None:
            fut.set_exception(error)
            return fut
        try:
            blob = pickle.dumps(fn, protocol=_PICKLE)
        except Exception as exc:
            fut.set_exception(TypeError(f"cannot send this to the engine process: {exc}"))
            return fut
        call_id = next(self._call_ids)
        self._calls[call_id] = fut
        self._write(UtilityCall(call_id, blob))
        if self._dead_event.is_set():  # died while we registered: nobody will answer
            self._fail_calls()
        return fut

    # ------------------------------------------------------------ reader thread

    def _read_loop(self) -> None:
        conn = self._outputs_conn
        try:
            while True:
                msg = self.codec.decode(conn.recv_bytes())
                if isinstance(msg, EngineCoreOutputs):
                    self._outputs.put(msg)
                elif isinstance(msg, EngineCoreEvent):
                    self._emit_event(msg.kind, msg.payload)
                elif isinstance(msg, UtilityResult):
                    fut = self._calls.pop(msg.call_id, None)
                    if fut is not None and fut.set_running_or_notify_cancel():
                        try:
                            value = pickle.loads(msg.value)
                        except Exception as exc:
                            fut.set_exception(exc)
                            continue
                        if msg.ok:
                            fut.set_result(value)
                        else:
                            fut.set_exception(value)
                elif isinstance(msg, EngineCoreFailed):
                    logger.error("the engine process failed: %s\n%s", msg.message, msg.traceback)
                    self._die(RuntimeError(msg.message))
                    self._fail_calls()
                    return
        except (EOFError, OSError):
            pass
        except BaseException as exc:  # a bug on this side: the stream is lost, say so
            logger.exception("the engine reader failed")
            self._die(exc)
            self._fail_calls()
            return
        if self._closed:
            self._die(None)
        else:
            self.process.join(5)
            code = self.process.exitcode
            logger.error("the engine process exited unexpectedly (exit code %s)", code)
            self._die(RuntimeError(f"the engine process exited unexpectedly (exit code {code})"))
        self._fail_calls()

    def _fail_calls(self) -> None:
        error = self._stopped() or EngineDeadError("the engine was shut down")
        for call_id in list(self._calls):
            fut = self._calls.pop(call_id, None)
            if fut is not None and fut.set_running_or_notify_cancel():
                fut.set_exception(error)

    # ------------------------------------------------------------ watchdog figures

    @property
    def engine_pid(self) -> int | None:
        return self.process.pid

    # ------------------------------------------------------------ shutdown

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine process; idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self._started:  # still starting (wait=False): nothing to say goodbye to
            self._kill()
            self._die(None)
            return
        self._write(Shutdown())
        self._writer.close(timeout)
        self.process.join(timeout)
        self._kill(close=False)
        self._reader.join(timeout)  # EOF once the process is gone
        self._die(None)
        self._fail_calls()
        self._close_pipes()

    def _kill(self, close: bool = True) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        if close:
            self._close_pipes()

    def _close_pipes(self) -> None:
        for conn in (self._commands_conn, self._outputs_conn):
            with contextlib.suppress(OSError):
                conn.close()


__all__ = [
    "ENGINE_GOMP_SPINCOUNT",
    "CoreObserver",
    "EngineCoreClient",
    "EngineCoreLoop",
    "EngineDeadError",
    "InprocClient",
    "MPClient",
    "ThreadedClient",
    "default_engine_threads",
]
