"""The engine core in its own process, behind the `AsyncEngine` API (`AsyncEngine.launch`).

Why a process: in one interpreter the engine thread and the event loop share the GIL.
Every torch op releases it and takes it back, so whenever the loop thread holds it (parsing
a request, encoding an SSE chunk, writing a socket) the step waits — up to the 5 ms switch
interval per op while the loop is busy — and the HTTP side can never run beside the step
on another core. In its own process the engine's Python never waits for the server's, and
the server's Python uses a core of its own.

    API process                                   engine process (spawned)
    ───────────                                   ────────────────────────
    event loop ── commands ─> writer thread ─pipe─> step loop: apply commands between
                                                    steps, step(), pickle the outputs
    asyncio queues <─ reader thread <───────pipe─── sender thread (so no step ever waits
    (one call_soon_threadsafe per step)             on the pipe, whoever reads it)

Messages are pickled tuples. To the engine: ("add", id, prompt, params, kwargs),
("abort", ids), ("call", call_id, pickled fn), ("shutdown",). From it: ("ready", info),
("failed", message) at start-up, ("added", id, error | None), ("step", rows, stats,
iteration_stats, step_seconds) with the outputs as plain tuples (cheaper to pickle on the
step's thread), ("stats", stats) after commands that ran no step,
("result", call_id, ok, value) and ("dead", message) when a step raised (the process then
exits), and ("dashboard", picture) while a dashboard page watches (see `dashboard.tap`: the
API process says so through a shared integer, no message, and pictures are rate-limited). A request's prompt and prompt ids travel with its first output only; the reader
puts them back on the later ones, so a long prompt is not re-sent at every token.

The engine process exits when told to, when a step fails, and when the API process goes
away (its command pipe reaches EOF). The API process notices an engine process that exits
for any reason (its output pipe reaches EOF): the client turns dead, every in-flight
request fails with `EngineDeadError` and /health answers 503.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, TypeVar

from .async_engine import AsyncEngine, EngineDeadError, StepObserver, _Tracked, deliver

if TYPE_CHECKING:
    from .dashboard import DashboardSettings, SnapshotTap

logger = logging.getLogger(__name__)

T = TypeVar("T")

_PROTOCOL = pickle.HIGHEST_PROTOCOL


# ---------------------------------------------------------------- engine process side


def _picklable_error(exc: BaseException) -> BaseException:
    try:
        pickle.dumps(exc, protocol=_PROTOCOL)
        return exc
    except Exception:
        return RuntimeError(repr(exc))


class _CoreLoop:
    """The engine process's main loop: the only code that touches the engine."""

    def __init__(self, engine: Any, commands: Connection, outputs: Connection,
                 heartbeat: Any = None, tap: SnapshotTap | None = None) -> None:
        self.engine = engine
        self.tap = tap  # None: no dashboard
        self.heartbeat = heartbeat
        self.commands = commands
        self.outputs = outputs
        self._out: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._prompt_sent: set[str] = set()
        self._sender = threading.Thread(target=self._send_loop, name="pagemill-engine-sender",
                                         daemon=True)
        self._sender.start()

    def _send_loop(self) -> None:
        try:
            while True:
                data = self._out.get()
                if data is None:
                    return
                self.outputs.send_bytes(data)
        except OSError:  # the API process is gone; the command pipe will say so too
            pass

    def send(self, msg: tuple[Any, ...]) -> None:
        # Pickled here, on the step's thread, so the engine cannot change what was sent.
        self._out.put(pickle.dumps(msg, protocol=_PROTOCOL))

    def close(self, timeout: float = 10.0) -> None:
        self._out.put(None)
        self._sender.join(timeout)

    def run(self) -> None:
        engine = self.engine
        while True:
            if not engine.has_unfinished_requests():
                self.commands.poll(None)  # idle: sleep until a command (or EOF) arrives
            applied = False
            while self.commands.poll(0):
                try:
                    msg = self.commands.recv()
                except EOFError:
                    return  # the API process is gone
                if msg[0] == "shutdown":
                    return
                self._apply(msg)
                applied = True
            if engine.has_unfinished_requests():
                t0 = time.perf_counter()
                if self.heartbeat is not None:
                    self.heartbeat[2] = time.monotonic()  # a step is running since
                outputs = engine.step()
                step_seconds = time.perf_counter() - t0
                if self.heartbeat is not None:
                    self.heartbeat[0] += 1  # steps run
                    self.heartbeat[1] = time.monotonic()  # when the last one ended
                    self.heartbeat[2] = 0.0
                self.send(("step", self._encode(outputs), engine.get_stats(),
                           getattr(engine, "iteration_stats", None), step_seconds))
            elif applied:
                self.send(("stats", engine.get_stats()))
            else:
                continue
            if self.tap is not None:
                snap = self.tap.poll(engine)
                if snap is not None:
                    self.send(("dashboard", snap))

    def _apply(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "add":
            _, rid, prompt, params, kwargs = msg
            try:
                self.engine.add_request(rid, prompt, params, **kwargs)
            except Exception as exc:  # the engine's validation of this one request
                self.send(("added", rid, _picklable_error(exc)))
                return
            self.send(("added", rid, None))
        elif kind == "abort":
            self.engine.abort_request(list(msg[1]))
        elif kind == "call":
            _, call_id, blob = msg
            try:
                # Unpickled here, not with the message: a function this process cannot
                # import (a test module, a script's __main__) fails its call alone.
                fn = pickle.loads(blob)
                result = fn(self.engine)
                pickle.dumps(result, protocol=_PROTOCOL)  # fail here, not in the sender
            except Exception as exc:
                self.send(("result", call_id, False, _picklable_error(exc)))
                return
            self.send(("result", call_id, True, result))

    def _encode(self, outputs: list[Any]) -> list[tuple[Any, ...]]:
        """The step's outputs as plain tuples (pickled 2-3x faster than the dataclasses, on
        the step's own thread), each request's prompt with its first output only."""
        rows = []
        sent = self._prompt_sent
        for out in outputs:
            rid = out.request_id
            first = rid not in sent
            if out.finished:
                sent.discard(rid)
            else:
                sent.add(rid)
            prompt, prompt_ids = (out.prompt, out.prompt_token_ids) if first else (None, None)
            rows.append((rid, prompt, prompt_ids, out.finished, _fields(out.metrics),
                         [_fields(c) for c in out.outputs]))
        return rows


def _fields(obj: Any) -> tuple[Any, ...]:
    # A dataclass's fields in __init__ order: `type(obj)(*_fields(obj))` rebuilds it.
    return tuple(vars(obj).values())


def _decode(rows: list[tuple[Any, ...]], prompts: dict[str, tuple[Any, Any]]) -> list[Any]:
    """RequestOutputs again; `prompts` (the reader's) puts each request's prompt back."""
    from pagemill.runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput

    outputs = []
    for rid, prompt, prompt_ids, finished, metrics, completions in rows:
        if prompt_ids is None:
            prompt, prompt_ids = prompts.pop(rid, (None, [])) if finished else prompts.get(
                rid, (None, []))
        elif not finished:
            prompts[rid] = (prompt, prompt_ids)
        outputs.append(RequestOutput(rid, prompt, prompt_ids,
                                     [CompletionOutput(*c) for c in completions], finished,
                                     RequestMetrics(*metrics)))
    return outputs


# How long (in spin iterations, some tens of microseconds) the engine's idle OpenMP threads
# spin before they sleep; see `default_engine_threads`.
ENGINE_GOMP_SPINCOUNT = "20000"


def default_engine_threads(config: Any, own_process: bool = True) -> int | None:
    """Torch threads for a served CPU engine: one per usable core in an engine process, one
    per core but one on a thread of the server process (`own_process=False`).

    The engine process shares the cores with the HTTP side, and OpenMP's idle threads spin
    (by default for long enough to span the gap between two steps) on the cores the HTTP
    side needs: with both cores for torch, decode steps went from ~16 ms to ~600 ms.
    Bounding the spin (`ENGINE_GOMP_SPINCOUNT`, set for the engine process unless
    GOMP_SPINCOUNT or OMP_WAIT_POLICY is set) keeps the threads hot inside a step and lets
    them sleep between steps, and then every core can run the step: measured on 2 busy
    cores (SmolLM2, default flags), 20.3 -> 12.6 ms per output token at concurrency 1 and
    138 -> 225 tok/s at concurrency 16 against one thread (see the server README). In the
    server process OpenMP is already running with its default spin, so there a core is left
    to the HTTP side. None (torch's default) on a GPU or when OMP_NUM_THREADS is set.
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


def _engine_main(commands: Connection, outputs: Connection, config: Any,
                 engine_threads: int | None, log_level: int, heartbeat: Any = None,
                 dashboard: tuple[Any, Any] | None = None) -> None:
    """Entry point of the engine process (spawned: nothing is inherited but these args)."""
    # Ctrl-C reaches the whole process group: the API process decides when to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s [engine]: %(message)s")
    try:
        import torch

        if engine_threads is None:
            engine_threads = default_engine_threads(config)
        if engine_threads is not None:
            torch.set_num_threads(engine_threads)
        logger.info("engine process %d: %d torch threads", os.getpid(), torch.get_num_threads())
        from pagemill.runtime import LLMEngine

        engine = LLMEngine(config)
    except BaseException as exc:
        logger.exception("the engine could not be built")
        with contextlib.suppress(OSError):
            outputs.send_bytes(pickle.dumps(("failed", f"{type(exc).__name__}: {exc}"),
                                            protocol=_PROTOCOL))
        return
    info = {"model_path": str(getattr(engine, "model_path", "")),
            "max_model_len": int(engine.max_model_len),
            "num_blocks": getattr(engine, "num_blocks", None),
            "dtype": str(getattr(engine, "dtype", "")),
            "device": str(getattr(engine, "device", "")),
            "pid": os.getpid()}
    tap = None
    if dashboard is not None:
        from .dashboard.tap import SnapshotTap

        tap = SnapshotTap(*dashboard)
    loop = _CoreLoop(engine, commands, outputs, heartbeat, tap)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "on_worker_failure"):
        core.on_worker_failure(functools.partial(_worker_failed, loop))
    loop.send(("ready", info))
    try:
        loop.run()
    except BaseException as exc:
        logger.exception("an engine step failed; the engine process exits")
        loop.send(("dead", _picklable_error(exc), traceback.format_exc()))
        loop.close()
        os._exit(1)
    loop.close()


def _worker_failed(loop: _CoreLoop, error: Exception) -> None:
    """A tensor-parallel worker died while the engine idled: the engine cannot serve again,
    so exit now (as after a failed step) rather than at the next request."""
    logger.critical("%s; the engine process exits", error)
    loop.send(("dead", _picklable_error(error), ""))
    loop.close(5)
    os._exit(1)


# ---------------------------------------------------------------- API process side


class EngineInfo:
    """The API process's view of an engine that runs elsewhere.

    Holds what the endpoints read from `client.engine`: the tokenizer (loaded here too:
    prompts are tokenized in the API process), `encode`, `apply_chat_template`,
    `max_model_len`, `model_config` and `config`, plus a few facts the engine reported.
    """

    def __init__(self, config: Any, info: dict[str, Any]) -> None:
        from pagemill.runtime.chat_template import apply_chat_template_override
        from pagemill.runtime.generation_defaults import load_generation_defaults
        from pagemill.runtime.engine.input_processor import InputProcessor
        from pagemill.runtime.loader import load_tokenizer
        from pagemill.runtime.model_config import ModelConfig
        from pagemill.runtime.model_source import resolve_tokenizer

        self.config = config
        self.model_path = info["model_path"]
        self.max_model_len = int(info["max_model_len"])
        self.num_blocks = info.get("num_blocks")
        self.dtype = info.get("dtype")
        self.device = info.get("device")
        self.pid = info.get("pid")
        tokenizer = getattr(config, "tokenizer", None)
        tokenizer_path = resolve_tokenizer(tokenizer) if tokenizer else self.model_path
        self.tokenizer = load_tokenizer(str(tokenizer_path))
        apply_chat_template_override(self.tokenizer, getattr(config, "chat_template", None))
        self.generation_defaults = load_generation_defaults(
            getattr(config, "generation_config", "auto"), self.model_path)
        self.model_config = ModelConfig.from_pretrained(self.model_path)
        self.input_processor = InputProcessor(self.tokenizer, self.model_config.vocab_size,
                                              self.max_model_len,
                                              self.model_config.eos_token_ids)

    def get_tokenizer(self) -> Any | None:
        return self.tokenizer

    def encode(self, prompt: str) -> list[int]:
        return self.input_processor.encode(prompt)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                            add_generation_prompt: bool = True, *,
                            tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        return self.input_processor.apply_chat_template(messages, add_generation_prompt,
                                                        tools=tools)


@dataclass
class _StatsView:
    """What a `StepObserver` reads, as the engine process sent it."""

    stats: Any
    iteration_stats: Any

    def get_stats(self) -> Any:
        return self.stats


class EngineProcessClient(AsyncEngine):
    """`AsyncEngine` whose engine runs in a child process (see the module docstring).

    Built by `AsyncEngine.launch(config, ...)`; returns once the engine reported ready, and
    raises RuntimeError if it could not be built (the message says why).
    """

    def __init__(self, config: Any = None, *, max_pending: int | None = None,
                 observer: StepObserver | None = None, engine_threads: int | None = None,
                 start_timeout: float | None = None,
                 dashboard: DashboardSettings | None = None,
                 **engine_kwargs: Any) -> None:
        if config is None:
            from pagemill.runtime.config import EngineConfig

            config = EngineConfig.from_kwargs(**engine_kwargs)  # bad options fail here
        elif engine_kwargs:
            raise TypeError("pass either an EngineConfig or keyword arguments, not both")
        if engine_threads is not None and engine_threads < 1:
            raise ValueError(f"engine_threads must be None or >= 1, got {engine_threads}")
        self._init_client(None, max_pending, observer)
        self.config = config
        self._tracked: dict[str, _Tracked] = {}  # request id -> its queue
        self._prompts: dict[str, tuple[Any, Any]] = {}  # reader thread only
        self._adds: dict[str, concurrent.futures.Future[None]] = {}
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._last_iteration: Any = None
        self._dead_event = threading.Event()

        ctx = multiprocessing.get_context("spawn")
        # Written by the engine process after every step, read here without any message or
        # lock: [steps run, time.monotonic() at the end of the last one, at the start of the
        # running one (0: none)]. The watchdog tells a hung engine from a busy one by it.
        self.heartbeat = ctx.RawArray("d", 3)
        # With `dashboard` (a dashboard.DashboardSettings): how many pages watch, written by
        # the dashboard hub here, read by the engine loop after each step (no message).
        # Pictures come back as ("dashboard", picture) and go to `on_dashboard`.
        self.dashboard_watchers: Any = None
        self.on_dashboard: Callable[[dict[str, Any]], None] | None = None
        engine_dashboard = None
        if dashboard is not None:
            self.dashboard_watchers = ctx.RawValue("i", 0)
            engine_dashboard = (dashboard, self.dashboard_watchers)
        cmd_read, cmd_write = ctx.Pipe(duplex=False)
        out_read, out_write = ctx.Pipe(duplex=False)
        self.process = ctx.Process(
            target=_engine_main, name="pagemill-engine-core", daemon=True,
            args=(cmd_read, out_write, config, engine_threads,
                  logging.getLogger().getEffectiveLevel(), self.heartbeat, engine_dashboard))
        with _engine_environment():
            self.process.start()
        # Our copies of the child's ends: closing them lets EOF mean "the other side is gone".
        cmd_read.close()
        out_write.close()
        self._commands_conn = cmd_write
        self._outputs_conn = out_read
        try:
            info = self._wait_ready(start_timeout)
            self.engine = EngineInfo(config, info)
        except BaseException:
            self._kill()
            raise
        self._writes: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="pagemill-engine-writer",
                                        daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="pagemill-engine-reader",
                                        daemon=True)
        self._writer.start()
        self._reader.start()

    def _wait_ready(self, timeout: float | None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 1.0 if deadline is None else min(1.0, max(0.0, deadline - time.monotonic()))
            if self._outputs_conn.poll(wait):
                try:
                    msg = pickle.loads(self._outputs_conn.recv_bytes())
                except EOFError:
                    self.process.join(5)
                    raise RuntimeError("the engine process exited during start-up "
                                       f"(exit code {self.process.exitcode})") from None
                if msg[0] == "ready":
                    return msg[1]
                if msg[0] == "failed":
                    raise RuntimeError(f"the engine could not start: {msg[1]}")
            elif not self.process.is_alive():
                raise RuntimeError("the engine process exited during start-up "
                                   f"(exit code {self.process.exitcode})")
            if deadline is not None and time.monotonic() >= deadline:
                raise RuntimeError(f"the engine did not start within {timeout:.0f}s")

    # ------------------------------------------------------------ transport

    def _send(self, msg: tuple[Any, ...]) -> None:
        self._writes.put(msg)

    def _write_loop(self) -> None:
        """Pickles and writes commands, so the event loop never waits on a full pipe."""
        while True:
            msg = self._writes.get()
            if msg is None:
                return
            try:
                data = pickle.dumps(msg, protocol=_PROTOCOL)
            except Exception as exc:
                self._refuse(msg, TypeError(f"cannot send this to the engine process: {exc}"))
                continue
            try:
                self._commands_conn.send_bytes(data)
            except OSError:  # the engine process is gone: the reader reports it
                self._refuse(msg, EngineDeadError("the engine process is gone"))

    def _refuse(self, msg: tuple[Any, ...], error: BaseException) -> None:
        if msg[0] == "add":
            fut = self._adds.pop(msg[1], None)
            self._tracked.pop(msg[1], None)
        elif msg[0] == "call":
            fut = self._calls.pop(msg[1], None)
        else:
            return
        if fut is not None and fut.set_running_or_notify_cancel():
            fut.set_exception(error)

    def submit(self, fn: Callable[[Any], T]) -> concurrent.futures.Future[T]:
        """Run `fn(engine)` in the engine process between steps; `fn` and its result must
        pickle (a module-level function or a `functools.partial` of one, not a lambda)."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        error = self._stopped_error()
        if error is not None:
            fut.set_exception(error)
            return fut
        call_id = next(self._call_ids)
        self._calls[call_id] = fut
        try:
            blob = pickle.dumps(fn, protocol=_PROTOCOL)
        except Exception as exc:
            self._calls.pop(call_id, None)
            fut.set_exception(TypeError(f"cannot send this to the engine process: {exc}"))
            return fut
        self._send(("call", call_id, blob))
        if self._dead_event.is_set():  # died while we registered: nobody will answer
            self._refuse(("call", call_id), self._stopped_error() or EngineDeadError("dead"))
        return fut

    def _post_add(self, request_id: str, prompt: Any, params: Any, kwargs: dict[str, Any],
                  tracked: _Tracked) -> concurrent.futures.Future[None]:
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._adds[request_id] = done
        self._tracked[request_id] = tracked
        self._send(("add", request_id, prompt, params, kwargs))
        if self._dead_event.is_set():
            self._refuse(("add", request_id), self._stopped_error() or EngineDeadError("dead"))
        return done

    def _post_abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._tracked.pop(rid, None)
        self._send(("abort", request_ids))

    def fail_all(self, error: BaseException) -> None:
        """Abort every request in flight and end its stream with `error` (shutdown)."""
        tracked = {}
        for rid in list(self._tracked):
            t = self._tracked.pop(rid, None)
            if t is not None:
                tracked[rid] = t
        if tracked and not self._dead_event.is_set():
            self._send(("abort", list(tracked)))
        deliver((t, error) for t in tracked.values())

    @property
    def step_started_at(self) -> float | None:
        return self.heartbeat[2] or None

    # ------------------------------------------------------------ reader thread

    def _read_loop(self) -> None:
        conn = self._outputs_conn
        try:
            while True:
                msg = pickle.loads(conn.recv_bytes())
                kind = msg[0]
                if kind == "step":
                    self._on_step(msg[1], msg[2], msg[3], msg[4])
                elif kind == "stats":
                    self._observe(msg[1], None)
                elif kind == "dashboard":
                    callback = self.on_dashboard
                    if callback is not None:
                        try:
                            callback(msg[1])
                        except Exception:
                            logger.exception("the dashboard failed")
                elif kind == "added":
                    _, rid, error = msg
                    fut = self._adds.pop(rid, None)
                    if error is not None:
                        self._tracked.pop(rid, None)
                    if fut is not None and fut.set_running_or_notify_cancel():
                        if error is None:
                            fut.set_result(None)
                        else:
                            fut.set_exception(error)
                elif kind == "result":
                    _, call_id, ok, value = msg
                    fut = self._calls.pop(call_id, None)
                    if fut is not None and fut.set_running_or_notify_cancel():
                        if ok:
                            fut.set_result(value)
                        else:
                            fut.set_exception(value)
                elif kind == "dead":
                    logger.error("the engine process failed: %r\n%s", msg[1], msg[2])
                    self._die(msg[1])
                    return
        except (EOFError, OSError):
            pass
        except BaseException as exc:  # a bug on this side: the stream is lost, say so
            logger.exception("the engine reader failed")
            self._die(exc)
            return
        if self._closed:
            self._die(None)
        else:
            self.process.join(5)
            code = self.process.exitcode
            logger.error("the engine process exited unexpectedly (exit code %s)", code)
            self._die(RuntimeError(f"the engine process exited unexpectedly (exit code {code})"))

    def _on_step(self, rows: list[tuple[Any, ...]], stats: Any, iteration_stats: Any,
                 step_seconds: float) -> None:
        items = []
        for out in _decode(rows, self._prompts):
            rid = out.request_id
            tracked = self._tracked.pop(rid, None) if out.finished else self._tracked.get(rid)
            if tracked is not None:
                items.append((tracked, out))
        deliver(items)
        if iteration_stats is not None:
            self._last_iteration = iteration_stats
        self._observe(stats, step_seconds)

    def _observe(self, stats: Any, step_seconds: float | None) -> None:
        if self.observer is None:
            return
        try:
            self.observer.on_step(_StatsView(stats, self._last_iteration), step_seconds)
        except Exception:
            logger.exception("the step observer failed")

    def _die(self, exc: BaseException | None) -> None:
        """The engine is gone (exc) or was shut down (None): fail everything still waiting."""
        if exc is not None and self.dead_error is None:
            self.dead_error = exc
        self._dead_event.set()
        error = self._stopped_error() or EngineDeadError("the engine was shut down")
        tracked = list(self._tracked.values())
        self._tracked.clear()
        deliver((t, error) for t in tracked)
        for futures in (self._adds, self._calls):
            for key in list(futures):
                fut = futures.pop(key, None)
                if fut is not None and fut.set_running_or_notify_cancel():
                    fut.set_exception(error)

    # ------------------------------------------------------------ shutdown

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine process (in-flight requests fail with EngineDeadError); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._send(("shutdown",))
        self._send(None)  # then the writer stops
        self.process.join(timeout)
        self._kill(close=False)
        self._reader.join(timeout)  # EOF once the process is gone
        self._writer.join(timeout)
        self._die(None)  # whatever is still waiting fails now
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

    @property
    def engine_pid(self) -> int | None:
        return self.process.pid

    @property
    def engine_steps(self) -> int:
        """Steps the engine process has run (shared memory: no message, no lock, no GIL
        of the engine's)."""
        return int(self.heartbeat[0])

    @property
    def last_step_time(self) -> float | None:
        """`time.monotonic()` when the engine's last step ended (None before the first)."""
        return self.heartbeat[1] or None


__all__ = ["EngineInfo", "EngineProcessClient", "default_engine_threads"]

