"""Grammar compiles in worker processes that a deadline can kill.

Why processes: xgrammar releases the GIL while it compiles (a compile on a thread does not
stall the engine or the event loop), but nothing can stop a compile once it started: a
runaway grammar would burn a core and hold its thread for minutes, and with one worker
thread every later grammar waited behind it. A process can be killed. Each of
`num_workers` slots owns one process (forked from a forkserver that has xgrammar imported,
so a replacement starts in milliseconds rather than the 5 s an import of torch takes) and
takes jobs first in, first out; a compile that runs past `timeout` seconds, or that nobody
waits for any more, is ended by killing its process, which the slot then replaces. The
compiled grammar comes back serialized (xgrammar's JSON: about 50 KB and 1 ms for a small
schema) and is rebuilt here against the same `TokenizerInfo`.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .params import GrammarKey

logger = logging.getLogger(__name__)

# How long a worker may take to start (the first one starts the forkserver: an import of
# xgrammar, and so of torch) before its slot gives up.
START_TIMEOUT_S = 120.0
_POLL_S = 0.02


class GrammarCompileError(ValueError):
    """The grammar cannot be compiled (xgrammar's reason, shortened)."""


class GrammarCompileTimeout(GrammarCompileError):
    """The compile ran past its deadline and was stopped."""


class GrammarCompileCancelled(Exception):
    """Nobody waited for the compile any more."""


@dataclass(eq=False)
class CompileJob:
    key: GrammarKey
    future: cf.Future[Any] = field(default_factory=cf.Future)
    abandoned: threading.Event = field(default_factory=threading.Event)

    def abandon(self) -> None:
        """Nobody needs the result: drop the job, or stop its compile."""
        self.abandoned.set()
        self.future.cancel()


def compile_key(compiler: Any, key: GrammarKey) -> Any:
    """One `GrammarKey` through an `xgr.GrammarCompiler`."""
    kind, text = key
    base, _, style = kind.partition(":")
    compact = style == "compact"
    if base == "json":
        return compiler.compile_json_schema(text, any_whitespace=not compact)
    if base == "json_object":
        if compact:
            # Any object, compact: a schema for "an object" with no free whitespace.
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        return compiler.compile_builtin_json_grammar()
    if base == "regex":
        return compiler.compile_regex(text)
    if base == "grammar":
        return compiler.compile_grammar(text)
    raise ValueError(f"unknown structured output kind {kind!r}")


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _worker_main(conn: Any, info_json: str, cache_limit_bytes: int) -> None:
    _die_with_parent()
    import xgrammar as xgr

    from .params import _short

    info = xgr.TokenizerInfo.deserialize_json(info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=cache_limit_bytes)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            key = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send(("ok", compile_key(compiler, key).serialize_json()))
        except Exception as exc:
            conn.send(("error", _short(exc)))


@contextlib.contextmanager
def _children_allowed() -> Iterator[None]:
    """A daemonic process (the server's engine process) may start these workers: they die
    with it (PR_SET_PDEATHSIG) and are killed by `shutdown`."""
    me = multiprocessing.current_process()
    daemon = me.daemon
    if daemon:
        me.daemon = False
    try:
        yield
    finally:
        if daemon:
            me.daemon = True


_FORKSERVER_LOCK = threading.Lock()


def _context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    with _FORKSERVER_LOCK:
        # Only takes effect if the forkserver is not running yet; harmless otherwise.
        ctx.set_forkserver_preload(["xgrammar", "pagemill.runtime.structured_output.worker"])
    return ctx


class _Worker:
    def __init__(self, info_json: str, cache_limit_bytes: int) -> None:
        ctx = _context()
        self.conn, child = ctx.Pipe(duplex=True)
        with _FORKSERVER_LOCK, _children_allowed():
            self.process = ctx.Process(target=_worker_main, name="pagemill-grammar-worker",
                                       args=(child, info_json, cache_limit_bytes), daemon=True)
            self.process.start()
        child.close()
        if not self.conn.poll(START_TIMEOUT_S):
            self.kill()
            raise RuntimeError("the grammar worker did not start")
        self.conn.recv()

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self.process.kill()
            self.process.join(5)
        with contextlib.suppress(Exception):
            self.conn.close()


class CompileWorkers:
    """`num_workers` compile slots, each a killable process; `submit` returns at once."""

    def __init__(self, tokenizer_info: Any, *, num_workers: int, timeout: float,
                 cache_limit_bytes: int) -> None:
        self.info = tokenizer_info
        self.timeout = timeout
        self._info_json = tokenizer_info.serialize_json()
        self._cache_limit = cache_limit_bytes
        self._jobs: queue.Queue[CompileJob | None] = queue.Queue()
        self._closed = False
        self.num_killed = 0
        self._slots = [threading.Thread(target=self._slot, name=f"pagemill-grammar-{i}",
                                        daemon=True) for i in range(num_workers)]
        self._workers: list[_Worker | None] = [None] * num_workers
        for i, t in enumerate(self._slots):
            t._pagemill_index = i  # type: ignore[attr-defined]
            t.start()

    def submit(self, key: GrammarKey) -> CompileJob:
        job = CompileJob(key)
        if self._closed:
            job.future.set_exception(RuntimeError("the grammar compiler is shut down"))
        else:
            self._jobs.put(job)
        return job

    def shutdown(self) -> None:
        self._closed = True
        for _ in self._slots:
            self._jobs.put(None)
        for w in self._workers:
            if w is not None:
                w.kill()

    # ---- one slot --------------------------------------------------------------------------

    def _slot(self) -> None:
        index = threading.current_thread()._pagemill_index  # type: ignore[attr-defined]
        worker: _Worker | None = None
        while not self._closed:
            if worker is None:
                try:
                    worker = _Worker(self._info_json, self._cache_limit)
                except Exception as exc:
                    logger.error("grammar worker failed to start: %s", exc)
                    worker = None
                self._workers[index] = worker
            job = self._jobs.get()
            if job is None or self._closed:
                break
            if job.abandoned.is_set() or not job.future.set_running_or_notify_cancel():
                continue
            if worker is None:
                job.future.set_exception(RuntimeError("no grammar worker could be started"))
                continue
            worker, outcome = self._run(worker, job)
            if isinstance(outcome, BaseException):
                job.future.set_exception(outcome)
            else:
                job.future.set_result(outcome)
        if worker is not None:
            worker.kill()

    def _run(self, worker: _Worker, job: CompileJob) -> tuple[_Worker | None, Any]:
        """Compile on `worker`; returns the worker (None once killed) and the outcome."""
        import xgrammar as xgr

        start = time.monotonic()
        try:
            worker.conn.send(job.key)
            while True:
                if worker.conn.poll(_POLL_S):
                    status, payload = worker.conn.recv()
                    break
                if job.abandoned.is_set():
                    worker.kill()
                    self.num_killed += 1
                    return None, GrammarCompileCancelled()
                if time.monotonic() - start > self.timeout:
                    worker.kill()
                    self.num_killed += 1
                    return None, GrammarCompileTimeout(
                        f"the grammar did not compile within {self.timeout:g} s "
                        "(--structured-outputs-compile-timeout); simplify it")
        except (EOFError, OSError) as exc:
            worker.kill()
            return None, RuntimeError(f"the grammar worker died: {exc!r}")
        if status != "ok":
            return worker, GrammarCompileError(f"the grammar cannot be compiled: {payload}")
        try:
            return worker, xgr.CompiledGrammar.deserialize_json(payload, self.info)
        except Exception as exc:
            return worker, RuntimeError(f"the compiled grammar could not be read back: {exc}")
