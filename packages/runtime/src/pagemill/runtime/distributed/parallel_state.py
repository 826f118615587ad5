"""The tensor-parallel group an engine holds: which rank this is, and its collectives.

One `TensorParallelGroup` object is created per rank and handed explicitly to whatever
needs it (the model's row-parallel layers and vocab-parallel embedding, the model runner,
the worker loop); nothing is looked up from a global. The process group itself is
torch.distributed's default group, since torchrun launches rely on it; a process holds
one tensor-parallel engine at a time.

Two process groups may serve one engine: the compute group (NCCL on CUDA, gloo on CPU)
for all-reduce and the logits gather, and a gloo group for the step's batch, which is a
pickled host object (`broadcast_object_list` over NCCL would copy it through the GPU).
On CPU both are the same group.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pagemill.runtime.engine.fault_isolation import EngineFaultError

logger = logging.getLogger(__name__)

# Seconds a collective may wait for a peer before gloo/NCCL give up (a peer that *dies*
# is noticed at once: its connections close). Idle ranks are kept under it by keepalives.
TIMEOUT_ENV = "PAGEMILL_TP_TIMEOUT"
DEFAULT_TIMEOUT_S = 1800.0


def collective_timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))


def default_backend(device: torch.device) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass(frozen=True)
class TorchrunEnv:
    """This process's place in a torchrun (or any env:// launch)."""

    rank: int
    world_size: int
    local_rank: int


def torchrun_env(environ: dict[str, str] | None = None) -> TorchrunEnv | None:
    """The launch this process is part of, or None when it was not started by torchrun."""
    env = os.environ if environ is None else environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    return TorchrunEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)))


@dataclass(eq=False)
class TensorParallelGroup:
    """This rank's view of the group; rank 0 (the driver) schedules, the others follow."""

    rank: int
    world_size: int
    device: torch.device
    group: Any  # the compute ProcessGroup
    object_group: Any  # gloo ProcessGroup for pickled objects (== group on CPU)
    # Set on the driver by whoever started the other ranks: a line on their state
    # ("worker rank 1 (pid 42) exited with code 1"), or None when all are alive.
    describe_peers: Callable[[], str | None] | None = None
    # Serializes the driver's collectives (a step, a keepalive) across threads.
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_collective: float = field(default_factory=time.monotonic)
    # A collective failed: the ranks are out of step and the group must not be used again.
    failed: bool = False

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    # ---- collectives -----------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks in place (the row-parallel layers' partial sums)."""
        dist.all_reduce(x, group=self.group)
        return x

    def broadcast_object(self, obj: Any = None) -> Any:
        """The driver's `obj` on every rank (pickled; the others pass nothing)."""
        box = [obj if self.is_driver else None]
        dist.broadcast_object_list(box, src=0, group=self.object_group)
        self.last_collective = time.monotonic()
        return box[0]

    def gather_to_driver(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Every rank's `x` concatenated along `dim` on the driver (None elsewhere)."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_driver else None
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the group for a sequence of collectives that must not interleave."""
        with self.lock:
            try:
                yield
            finally:
                self.last_collective = time.monotonic()

    def failure(self, exc: BaseException) -> TensorParallelError:
        """The error a failed collective becomes: fatal, naming a dead peer if there is one."""
        self.failed = True
        peers = None
        if self.describe_peers is not None:
            # A worker that crashed may still be exiting when its connection closes.
            deadline = time.monotonic() + 2.0
            while peers is None and time.monotonic() < deadline:
                peers = self.describe_peers()
                if peers is None:
                    time.sleep(0.05)
        detail = f"{peers}; " if peers else ""
        return TensorParallelError(
            f"tensor parallelism failed: {detail}{type(exc).__name__}: {exc}"
        )

    def destroy(self) -> None:
        """Leave the process group (idempotent)."""
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


class TensorParallelError(EngineFaultError):
    """A rank died, raised or stopped answering: the engine cannot go on (never retried)."""


def init_group(
    rank: int, world_size: int, device: torch.device, *, store: Any | None = None
) -> TensorParallelGroup:
    """Join the default process group (from `store`, else env:// as torchrun sets it)."""
    if dist.is_initialized():
        raise RuntimeError(
            "a torch.distributed process group already exists in this process; "
            "one process holds one tensor-parallel engine at a time"
        )
    backend = default_backend(device)
    kwargs: dict[str, Any] = {"store": store} if store is not None else {"init_method": "env://"}
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=collective_timeout(), **kwargs
    )
    group = dist.group.WORLD
    object_group = group if backend == "gloo" else dist.new_group(backend="gloo")
    return TensorParallelGroup(rank, world_size, device, group, object_group)
