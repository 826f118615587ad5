"""Grammar compiles in worker processes that a deadline can kill.

Why processes: xgrammar releases the GIL while it compiles (a compile on a thread does not
stall the engine or the event loop), but nothing can stop a compile once it started: a
runaway grammar would burn a core and hold its thread for minutes, and with one worker
thread every later grammar waited behind it. A process can be killed. Each of
`num_workers` slots owns one process and takes jobs first in, first out. Workers are forked
by a small "zygote" process (one per engine process, started with `python -m` so it never
re-imports the caller's `__main__`, as multiprocessing's spawn and forkserver would) that
imported xgrammar once: a replacement starts in milliseconds rather than the seconds an
import of xgrammar (and so torch) takes. A compile that uses more than `timeout` seconds of
CPU, or that nobody waits for any more, is ended by killing its process, which the slot then
replaces. The compiled grammar comes back serialized (xgrammar's JSON, small for a small
schema) and is rebuilt here against the same `TokenizerInfo`.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import multiprocessing.connection
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pagemill.runtime.sample.structured_output.params import GrammarKey

logger = logging.getLogger(__name__)

# How long a worker may take to start (the first one starts the forkserver: an import of
# xgrammar, and so of torch) before its slot gives up.
START_TIMEOUT_S = 120.0
_POLL_S = 0.02
# The wall-clock backstop behind the CPU-time deadline (see `_past_deadline`).
_WALL_FACTOR = 6.0
_WALL_MIN_EXTRA_S = 50.0
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


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
    if base == "json" or base == "json_object":
        # json_object: "an object", as a schema (xgrammar's built-in grammar takes any JSON
        # value). Free whitespace is capped beside the grammar (`whitespace.WhitespaceCap`):
        # xgrammar's own cap multiplies the compiled grammar's size by the cap.
        schema = text if base == "json" else '{"type": "object"}'
        return compiler.compile_json_schema(schema, any_whitespace=not compact)
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


def _serve(conn: Any) -> None:
    """A worker: the tokenizer table, then one compile per message, until EOF."""
    import xgrammar as xgr

    from pagemill.runtime.sample.structured_output.params import _short

    info_json, cache_limit_bytes = conn.recv()
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


def _zygote_main(fd: int) -> None:
    """Import xgrammar once, then fork one worker per socket received on `fd`.

    No PR_SET_PDEATHSIG here: it fires when the *thread* that started this process ends,
    and a short-lived thread starts it. The zygote ends instead when its socket reaches
    EOF (the engine process closed it, or died); its workers die with it (they are its
    children, forked from its only thread)."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped automatically
    sock = socket.socket(fileno=fd)
    import xgrammar  # noqa: F401  (the costly import, inherited by every worker)

    sock.sendall(b"R")
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 16, 1)
        except OSError:
            return
        if not msg:
            return
        for child_fd in fds:
            pid = os.fork()
            if pid == 0:
                try:
                    sock.close()
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    _die_with_parent()
                    _serve(multiprocessing.connection.Connection(child_fd))
                finally:
                    os._exit(0)
            os.close(child_fd)


class _Zygote:
    """The process that forks workers (one per engine process, started on first use)."""

    _lock = threading.Lock()
    _instance: _Zygote | None = None

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.sock = ours
        ours.settimeout(START_TIMEOUT_S)
        try:
            if ours.recv(1) != b"R":
                raise RuntimeError("the grammar zygote did not start")
        except BaseException:
            self.process.kill()
            raise
        ours.settimeout(None)

    @classmethod
    def fork(cls) -> Any:
        """A new worker's end of its pipe."""
        with cls._lock:
            z = cls._instance
            if z is None or z.process.poll() is not None:
                z = cls._instance = _Zygote()
            ours, theirs = multiprocessing.Pipe(duplex=True)
            try:
                socket.send_fds(z.sock, [b"F"], [theirs.fileno()])
            except OSError:
                cls._instance = None
                raise
            finally:
                theirs.close()
            return ours


class _Worker:
    def __init__(self, info_json: str, cache_limit_bytes: int) -> None:
        self.conn = _Zygote.fork()
        self.pid: int | None = None
        # `kill` runs on the slot's thread and on `CompileWorkers.shutdown`'s, maybe at once:
        # two unguarded closes of one Connection could both reach os.close, and the second
        # would close whatever pipe took the fd number in between (another worker's: its
        # next send fails with EBADF).
        self._kill_lock = threading.Lock()
        self._killed = False
        self.conn.send((info_json, cache_limit_bytes))
        if not self.conn.poll(START_TIMEOUT_S):
            self.conn.close()
            raise RuntimeError("the grammar worker did not start")
        _, self.pid = self.conn.recv()

    def cpu_seconds(self) -> float | None:
        """CPU time (user + system) the worker has used, or None where /proc cannot say."""
        if self.pid is None:
            return None
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            return None
        # The command name (field 2) may hold spaces: count fields after its closing ')'.
        fields = stat[stat.rfind(b")") + 2 :].split()
        try:
            return (int(fields[11]) + int(fields[12])) / _CLK_TCK
        except (IndexError, ValueError):
            return None

    def kill(self) -> None:
        """Kill the process and close its pipe, once, whichever thread asks first."""
        with self._kill_lock:
            if self._killed:
                return
            self._killed = True
            if self.pid is not None:
                with contextlib.suppress(OSError):
                    os.kill(self.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                self.conn.close()


class _WorkerDied(Exception):
    """A worker's pipe failed (the process died, or its end was lost): not the grammar's
    fault until a fresh worker fails on it too."""


class CompileWorkers:
    """`num_workers` compile slots, each a killable process; `submit` returns at once."""

    def __init__(
        self, tokenizer_info: Any, *, num_workers: int, timeout: float, cache_limit_bytes: int
    ) -> None:
        self.info = tokenizer_info
        self.timeout = timeout
        self._info_json = tokenizer_info.serialize_json()
        self._cache_limit = cache_limit_bytes
        self._jobs: queue.Queue[CompileJob | None] = queue.Queue()
        self._closed = False
        self.num_killed = 0
        self._slots = [
            threading.Thread(target=self._slot, name=f"pagemill-grammar-{i}", daemon=True)
            for i in range(num_workers)
        ]
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
                worker = self._start_worker(index)
            job = self._jobs.get()
            if job is None or self._closed:
                break
            if job.abandoned.is_set() or not job.future.set_running_or_notify_cancel():
                continue
            if worker is None:  # try once more now that someone waits
                worker = self._start_worker(index)
                if worker is None:
                    job.future.set_exception(RuntimeError("no grammar worker could be started"))
                    continue
            worker, outcome = self._run(worker, job)
            if isinstance(outcome, _WorkerDied):
                # Lost between jobs or in this one (killed from outside, its pipe gone): a
                # fresh worker gets one more try, so a worker's death alone fails no request;
                # a grammar that kills every worker it meets fails on the second.
                logger.warning("grammar worker lost (%s); compiling on a fresh one", outcome)
                worker = self._start_worker(index)
                if worker is not None:
                    worker, outcome = self._run(worker, job)
                if isinstance(outcome, _WorkerDied):
                    outcome = RuntimeError(f"the grammar worker died: {outcome}")
            if isinstance(outcome, BaseException):
                job.future.set_exception(outcome)
            else:
                job.future.set_result(outcome)
        if worker is not None:
            worker.kill()

    def _start_worker(self, index: int) -> _Worker | None:
        """A fresh worker for slot `index` (recorded for `shutdown`), or None (logged)."""
        try:
            worker: _Worker | None = _Worker(self._info_json, self._cache_limit)
        except Exception as exc:
            logger.error("grammar worker failed to start: %s", exc)
            worker = None
        self._workers[index] = worker
        return worker

    def _past_deadline(self, worker: _Worker, start: float, cpu_start: float | None) -> bool:
        """Whether the compile has used up its time.

        The deadline counts the worker's CPU time, not the clock: it is there to stop a
        runaway grammar, which burns CPU, and a compile that merely waits for a core on a
        loaded machine (an engine step and other compiles on the same cores) has done
        nothing wrong. A generous wall-clock limit stays behind it for a worker that makes
        no progress at all, and for systems without /proc."""
        wall = time.monotonic() - start
        if cpu_start is None:
            return wall > self.timeout
        if wall > max(_WALL_FACTOR * self.timeout, self.timeout + _WALL_MIN_EXTRA_S):
            return True
        cpu = worker.cpu_seconds()
        return cpu is not None and cpu - cpu_start > self.timeout

    def _run(self, worker: _Worker, job: CompileJob) -> tuple[_Worker | None, Any]:
        """Compile on `worker`; returns the worker (None once killed) and the outcome."""
        import xgrammar as xgr

        start = time.monotonic()
        cpu_start = worker.cpu_seconds()
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
                if self._past_deadline(worker, start, cpu_start):
                    worker.kill()
                    self.num_killed += 1
                    return None, GrammarCompileTimeout(
                        f"the grammar did not compile within {self.timeout:g} s "
                        "(--structured-outputs-compile-timeout); simplify it"
                    )
        except (EOFError, OSError) as exc:
            worker.kill()
            return None, _WorkerDied(repr(exc))
        if status != "ok":
            return worker, GrammarCompileError(f"the grammar cannot be compiled: {payload}")
        try:
            return worker, xgr.CompiledGrammar.deserialize_json(payload, self.info)
        except Exception as exc:
            return worker, RuntimeError(f"the compiled grammar could not be read back: {exc}")


if __name__ == "__main__":
    _zygote_main(int(sys.argv[1]))
