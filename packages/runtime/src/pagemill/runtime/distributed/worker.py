"""The other ranks' side of tensor parallelism: load a shard, then run rank 0's steps.

A worker owns no scheduler, no block pool, no sampler and no request state: each step it
receives rank 0's `StepBatch` (token ids, positions, KV slots, block tables), runs its
shard of the model over it — taking part in every all-reduce — and sends its slice of the
logits to rank 0. Its KV cache holds its KV heads for the same block ids as rank 0's pool.

Started by rank 0 (`worker_main`, through torch.multiprocessing) or by torchrun on other
nodes (``python -m pagemill.runtime.distributed.worker``). Anything that goes wrong ends
the process with a non-zero status: rank 0's next collective then fails, so the engine
stops cleanly instead of waiting for a rank that will never answer.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pagemill.runtime.distributed.parallel_state import (
    TensorParallelGroup,
    collective_timeout,
    init_group,
    torchrun_env,
)

logger = logging.getLogger(__name__)

CHECK_IN_KEY = "pagemill/tp-worker/{rank}"
# Commands rank 0 broadcasts besides a step's `StepBatch`.
STOP = ("stop",)
KEEPALIVE = ("keepalive",)
PROFILE = ("profile",)
# The engine is ready: map the KV pool's pages now (in the background), as rank 0 does.
PREFAULT = ("prefault",)


@dataclass(frozen=True)
class WorkerSpec:
    """What a rank needs to build its shard: the same model, limits and dtype as rank 0."""

    model_path: str
    model_config: Any  # ModelConfig (the whole model's)
    dtype: torch.dtype
    max_model_len: int
    load_format: str
    seed: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    pooling_only: bool = False  # a checkpoint without an LM head is accepted (embeddings)


@dataclass(frozen=True)
class InitKVCache:
    num_blocks: int


def serve(tp: TensorParallelGroup) -> None:
    """Receive the spec, build the shard, run steps until rank 0 says stop."""
    from pagemill.runtime.distributed.sharding import ShardLayout
    from pagemill.runtime.model_executor.loader import load_model
    from pagemill.runtime.worker.model_runner import ModelRunner, StepBatch

    spec: WorkerSpec = tp.broadcast_object()
    torch.manual_seed(spec.seed)
    layout = ShardLayout.create(spec.model_config, tp.world_size, tp.rank)
    model = load_model(
        Path(spec.model_path),
        spec.model_config,
        spec.dtype,
        tp.device,
        spec.max_model_len,
        spec.load_format,
        spec.seed,
        tp=tp,
        pooling_only=spec.pooling_only,
    )
    runner = ModelRunner(
        model,
        layout.local_config(spec.model_config),
        tp.device,
        spec.dtype,
        spec.block_size,
        spec.max_num_seqs,
        spec.max_num_batched_tokens,
        spec.max_model_len,
        tp=tp,
        vocab_size=spec.model_config.vocab_size,
    )
    logger.info("tensor-parallel rank %d/%d ready on %s", tp.rank, tp.world_size, tp.device)
    while True:
        msg = tp.broadcast_object()
        if isinstance(msg, StepBatch):
            runner.execute_batch(msg)
        elif isinstance(msg, InitKVCache):
            runner.init_kv_cache(msg.num_blocks, prefault=False)  # on PREFAULT
        elif msg == PREFAULT:
            if runner.kv_cache is not None:
                runner.kv_cache.start_prefault()
        elif msg == PROFILE:
            runner.profile_peak_memory()  # in lockstep with rank 0's (same dummy step)
        elif msg == STOP:
            return
        elif msg != KEEPALIVE:
            raise RuntimeError(f"unknown tensor-parallel command {msg!r}")


def _die_with_parent() -> None:
    """Have the kernel kill this process when its parent (rank 0) goes, however it goes."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _run(tp: TensorParallelGroup) -> int:
    try:
        serve(tp)
    except BaseException:
        logger.exception("tensor-parallel rank %d failed; exiting", tp.rank)
        sys.stderr.flush()
        os._exit(1)  # not a clean teardown: the group is mid-collective
    tp.destroy()
    return 0


def worker_main(
    rank: int, world_size: int, store_port: int, device: str, threads: int | None, log_level: int
) -> None:
    """Entry point of a worker that rank 0 started on this machine."""
    parent = os.getppid()
    _die_with_parent()
    if os.getppid() != parent:  # the parent went before the death signal was armed
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    logging.basicConfig(
        level=log_level, format=f"%(levelname)s %(name)s [tp rank {rank}]: %(message)s"
    )
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        store = dist.TCPStore(
            "127.0.0.1", store_port, world_size, is_master=False, timeout=collective_timeout()
        )
        store.set(CHECK_IN_KEY.format(rank=rank), "1")
        tp = init_group(rank, world_size, torch.device(device), store=store)
    except BaseException:
        logger.exception("tensor-parallel rank %d could not join the group", rank)
        os._exit(1)
    sys.exit(_run(tp))


def main(argv: list[str] | None = None) -> int:
    """A worker rank under torchrun: ``torchrun ... -m pagemill.runtime.distributed.worker``."""
    parser = argparse.ArgumentParser(
        prog="python -m pagemill.runtime.distributed.worker",
        description="A tensor-parallel worker rank of a pagemill engine launched by torchrun; "
        "rank 0 runs `pagemill serve ... --tensor-parallel-size N` (or LLM(...)).",
    )
    parser.add_argument(
        "--device",
        default="auto",
        help="auto (cuda:LOCAL_RANK when there "
        "is a GPU), cpu or cuda:N; must match rank 0's kind of device",
    )
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    env = torchrun_env()
    if env is None:
        parser.error(
            "not started by torchrun: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT must be set"
        )
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(levelname)s %(name)s [tp rank {env.rank}]: %(message)s",
    )
    if args.device == "auto":
        device = (
            torch.device("cuda", env.local_rank)
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    else:
        device = torch.device(args.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", env.local_rank)
    return _run(init_group(env.rank, env.world_size, device))


if __name__ == "__main__":
    sys.exit(main())
