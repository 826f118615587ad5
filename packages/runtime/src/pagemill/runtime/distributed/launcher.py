"""Rank 0's side of tensor parallelism: start (or join) the other ranks, keep, stop them.

On one machine the engine starts ``tensor_parallel_size - 1`` worker processes itself
(torch.multiprocessing, spawn) and meets them through a `TCPStore` it hosts on a free
port; under torchrun (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set) it starts nobody and
joins the launch's group as rank 0, the other ranks running `pagemill.runtime.distributed
.worker`. Either way rank 0 then broadcasts a `WorkerSpec` and every rank loads its shard.

Never a hang: while waiting for workers to check in, rank 0 polls that they are alive; a
worker that dies later closes its connections, so rank 0's next collective fails at once
(`TensorParallelError`, naming the worker and its exit code); workers die with rank 0
(PR_SET_PDEATHSIG, and their collectives fail too). A watcher thread notices a worker
that dies while the engine is idle (`on_failure`: the server's engine process exits, so
/health turns 503 at once) and sends a keepalive now and then, so that waiting workers
never reach the collective timeout.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from pagemill.runtime.distributed.parallel_state import (
    TensorParallelError,
    TensorParallelGroup,
    collective_timeout,
    init_group,
    torchrun_env,
)
from pagemill.runtime.distributed.worker import CHECK_IN_KEY, KEEPALIVE, STOP, worker_main

logger = logging.getLogger(__name__)

# How long workers may take to start (import torch, connect) before the engine gives up.
START_TIMEOUT_S = 120.0


@contextlib.contextmanager
def _children_allowed() -> Iterator[None]:
    """Let a daemonic process (the server's engine process) start the workers.

    multiprocessing forbids daemonic processes children so that none outlive them; the
    workers are tied to this process by PR_SET_PDEATHSIG and by their connections instead.
    """
    me = multiprocessing.current_process()
    daemon = me.daemon
    if daemon:
        me.daemon = False
    try:
        yield
    finally:
        if daemon:
            me.daemon = True


class TensorParallelWorkers:
    """The other ranks as rank 0 sees them, and the group they share."""

    def __init__(
        self, tp: TensorParallelGroup, processes: list[BaseProcess], threads: int | None = None
    ) -> None:
        self.tp = tp
        self.processes = processes
        self._saved_threads = threads
        self._closed = False
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        # Called (from the watcher thread) when a worker is found dead between steps.
        self.on_failure: Callable[[TensorParallelError], None] | None = None
        tp.describe_peers = self.describe

    # ---- start ------------------------------------------------------------------------------

    @classmethod
    def start(cls, world_size: int, device: torch.device) -> TensorParallelWorkers:
        """Start (or, under torchrun, join) `world_size - 1` workers; returns once all are
        in the group. Raises with the reason when one does not make it."""
        env = torchrun_env()
        if env is not None:
            if env.world_size != world_size:
                raise ValueError(
                    f"tensor_parallel_size={world_size} but torchrun started "
                    f"WORLD_SIZE={env.world_size} processes"
                )
            if env.rank != 0:
                raise RuntimeError(
                    "under torchrun the engine runs on rank 0; run the other "
                    "ranks as `python -m pagemill.runtime.distributed.worker`"
                )
            if device.type == "cuda":
                device = torch.device("cuda", env.local_rank)
            logger.info("tensor parallel: joining a torchrun launch of %d ranks", world_size)
            return cls(init_group(0, world_size, device), [])
        saved = None
        threads = None
        if device.type == "cpu":
            # The ranks share this machine's cores; oversubscribing them stalls every step.
            saved = torch.get_num_threads()
            threads = max(1, saved // world_size)
            torch.set_num_threads(threads)
            logger.info(
                "tensor parallel on CPU: %d rank(s) x %d torch thread(s)", world_size, threads
            )
        timeout = collective_timeout()
        store = dist.TCPStore(
            "127.0.0.1", 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        ctx = torch_mp.get_context("spawn")
        processes: list[BaseProcess] = []
        try:
            with _children_allowed():
                first_gpu = device.index or 0  # rank r on the r-th GPU from rank 0's
                for rank in range(1, world_size):
                    wdevice = f"cuda:{first_gpu + rank}" if device.type == "cuda" else "cpu"
                    p = ctx.Process(
                        target=worker_main,
                        name=f"pagemill-tp-worker-{rank}",
                        args=(
                            rank,
                            world_size,
                            store.port,
                            wdevice,
                            threads,
                            logging.getLogger().getEffectiveLevel(),
                        ),
                        daemon=True,
                    )
                    p.start()
                    processes.append(p)
            _wait_check_in(store, processes)
            tp = init_group(0, world_size, device, store=store)
        except BaseException:
            _kill(processes)
            if saved is not None:
                torch.set_num_threads(saved)
            raise
        logger.info(
            "tensor parallel: %d ranks over %s (workers %s)",
            world_size,
            dist.get_backend(tp.group),
            ", ".join(str(p.pid) for p in processes),
        )
        return cls(tp, processes, saved)

    # ---- while serving ------------------------------------------------------------------------

    def describe(self) -> str | None:
        """The first dead worker as a line for an error message, None when all live."""
        for rank, p in enumerate(self.processes, start=1):
            if not p.is_alive():
                return (
                    f"tensor-parallel worker rank {rank} (pid {p.pid}) "
                    f"exited with code {p.exitcode}"
                )
        return None

    def start_watching(self, keepalive: float | None = None) -> None:
        """Watch the workers between steps, and keep idle ones (blocked on the next step)
        short of the collective timeout with a keepalive every `keepalive` idle seconds."""
        if keepalive is None:
            keepalive = min(60.0, collective_timeout().total_seconds() / 4)
        self._watcher = threading.Thread(
            target=self._watch_loop, args=(keepalive,), name="pagemill-tp-watcher", daemon=True
        )
        self._watcher.start()

    def _watch_loop(self, keepalive: float) -> None:
        tp = self.tp
        while not self._stop.wait(0.5):
            if tp.failed:
                return
            dead = self.describe()
            if dead is not None:
                tp.failed = True
                error = TensorParallelError(f"tensor parallelism failed: {dead}")
                logger.error("%s", error)
                if self.on_failure is not None:
                    self.on_failure(error)
                return
            if time.monotonic() - tp.last_collective < keepalive:
                continue
            if not tp.lock.acquire(blocking=False):
                continue  # a step is running: that is traffic enough
            try:
                tp.broadcast_object(KEEPALIVE)
            except Exception as exc:
                tp.failed = True
                logger.error("tensor parallel keepalive failed: %s", tp.failure(exc))
                return
            finally:
                tp.lock.release()

    # ---- stop ---------------------------------------------------------------------------------

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the workers (politely when the group still works) and leave the group."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout)
        tp = self.tp
        if not tp.failed and tp.lock.acquire(timeout=timeout):
            try:
                tp.broadcast_object(STOP)
            except Exception as exc:
                logger.warning("could not tell the tensor-parallel workers to stop: %s", exc)
            finally:
                tp.lock.release()
        deadline = time.monotonic() + timeout
        for p in self.processes:
            p.join(max(0.1, deadline - time.monotonic()))
        _kill(self.processes)
        tp.destroy()
        if self._saved_threads is not None:
            torch.set_num_threads(self._saved_threads)


def _wait_check_in(store: dist.TCPStore, processes: list[BaseProcess]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    for rank, p in enumerate(processes, start=1):
        while not store.check([CHECK_IN_KEY.format(rank=rank)]):
            if not p.is_alive():
                raise RuntimeError(
                    f"tensor-parallel worker rank {rank} exited with code "
                    f"{p.exitcode} during start-up (see its log above)"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"tensor-parallel worker rank {rank} did not start within "
                    f"{START_TIMEOUT_S:.0f} s"
                )
            time.sleep(0.02)


def _kill(processes: list[BaseProcess]) -> None:
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)
