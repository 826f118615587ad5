"""KV-cache events on the wire, as vLLM publishes them (`--kv-events-config`).

Each step's block-pool events (pagemill.blockpool.kv_events) become one `KVEventBatch`,
msgpack-encoded by msgspec and sent on a ZMQ PUB socket as `[topic, seq, payload]` (seq: an
8-byte big-endian counter, contiguous from 0), so that a router written against vLLM's
`vllm.distributed.kv_events` classes (llm-d, Dynamo, our own data-parallel router) decodes
them unchanged. The structs follow vLLM's array-like layout (field order is the wire
format): `EventBatch[ts, events, data_parallel_rank]`, events tagged by class name.

A subscriber that notices a gap in seq asks the ROUTER replay socket for everything from a
given seq (one 8-byte frame); it answers `[seq, payload]` frames from its buffer and ends
with seq -1 and an empty payload.

Block hashes are the pool's own sha256 (or xxh3-128) digests of (parent, token ids, cache
salt): bytes, reproducible across processes and restarts (no Python `hash()`, no seed).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, fields
from itertools import count
from typing import TYPE_CHECKING, Any

import msgspec

from pagemill.blockpool import kv_events as pool_events

if TYPE_CHECKING:
    from pagemill.blockpool import BlockPool, HybridKVCacheManager, KVCacheManager
    from pagemill.runtime.config import EngineConfig
    from pagemill.runtime.engine.protocol import EngineCoreOutputs

logger = logging.getLogger(__name__)

PUBLISHERS = ("null", "zmq")


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Tagged with the class name, as vLLM's are."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def to_wire(
    events: Sequence[pool_events.KVCacheEvent],
) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    out: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for ev in events:
        if isinstance(ev, pool_events.BlockStored):
            out.append(
                BlockStored(
                    ev.block_hashes,
                    ev.parent_block_hash,
                    ev.token_ids,
                    ev.block_size,
                    ev.lora_id,
                    ev.medium,
                )
            )
        elif isinstance(ev, pool_events.BlockRemoved):
            out.append(BlockRemoved(ev.block_hashes, ev.medium))
        else:
            out.append(AllBlocksCleared())
    return out


_LOOPBACK = ("tcp://127.0.0.1:", "tcp://localhost:", "tcp://[::1]:")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config` fields and defaults, except `endpoint`: vLLM binds
    `tcp://*:5557`, every interface; pagemill binds the loopback unless told otherwise."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in PUBLISHERS:
            raise ValueError(
                f"kv_events_config.publisher must be one of {PUBLISHERS}, got {self.publisher!r}"
            )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv_events_config.{name} must be an integer >= 1, got {value!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVEventsConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"kv_events_config has unknown field(s) {unknown}; known: {sorted(known)}"
            )
        return cls(**data)


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """Core `rank` of a data-parallel group publishes on port + rank (vLLM's convention)."""
    if endpoint is None or rank == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{rank}"
    head, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"cannot offset the port of endpoint {endpoint!r} for rank {rank}")
    return f"{head}:{int(port) + rank}"


class EventPublisher:
    """Takes one batch per step; the null publisher drops it."""

    def publish(self, batch: KVEventBatch) -> None:
        return

    def shutdown(self) -> None:
        return


class ZmqEventPublisher(EventPublisher):
    """PUB socket plus optional ROUTER replay socket, served by one thread.

    The step only enqueues: encoding, sending and replay happen on the thread, and zmq
    sockets are used from that thread alone (they are not thread-safe).
    """

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        import zmq

        self._rank = data_parallel_rank
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._ctx: Any = zmq.Context.instance()
        self.endpoint = offset_endpoint(config.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, data_parallel_rank)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        assert self.endpoint is not None
        # vLLM's rule: a wildcard or local address is bound, anything else connected to
        # (a consumer listening there); the loopback counts as local.
        if (
            "*" in self.endpoint
            or "::" in self.endpoint
            or self.endpoint.startswith(("ipc://", "inproc://"))
            or self.endpoint.startswith(_LOOPBACK)
        ):
            self._pub.bind(self.endpoint)
        else:
            self._pub.connect(self.endpoint)
        self._replay: Any = None
        if self.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(self.replay_endpoint)
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-events")
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self._rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            # Never stall the engine for an observer. The batch is lost for every consumer
            # (replay included) and seq stays contiguous, so only this warning tells.
            logger.warning("KV events queue full: dropped one step's events")

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seqs = count()
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:
                    logger.exception("KV events replay failed")
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                if not self._running:
                    break
                continue
            if batch is None:
                break
            seq = next(seqs)
            payload = encoder.encode(batch)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except Exception:
                logger.exception("KV events publish failed")
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("ignored a malformed KV events replay request (%d frames)", len(frames))
            return
        identity, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", self.END_SEQ, b""))

    def shutdown(self) -> None:
        if not self._running:
            return
        self._running = False
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=1.0)
        self._thread.join(timeout=2.0)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


def make_publisher(config: KVEventsConfig | None, data_parallel_rank: int = 0) -> EventPublisher:
    if config is None or config.publisher == "null":
        return EventPublisher()
    return ZmqEventPublisher(config, data_parallel_rank)


def make_batch(
    events: Sequence[pool_events.KVCacheEvent], data_parallel_rank: int | None = None
) -> KVEventBatch:
    return KVEventBatch(time.time(), to_wire(events), data_parallel_rank)


class KVEventsHook:
    """The engine core's end of the events: drains the pool once per step into one batch,
    published (`enable_kv_cache_events`) and/or attached to the step's outputs (for the
    data-parallel front end's prefix routing). Absent (None) when neither is wanted, so a
    core without events does no work for them."""

    def __init__(
        self,
        pool: BlockPool,
        publisher: EventPublisher | None,
        attach: bool,
        rank: int,
    ) -> None:
        self.pool = pool
        self.publisher = publisher
        self.attach = attach
        self.rank = rank

    @classmethod
    def create(
        cls, config: EngineConfig, manager: KVCacheManager | HybridKVCacheManager
    ) -> KVEventsHook | None:
        events = (
            KVEventsConfig.from_dict(config.kv_events_config)
            if config.kv_events_config is not None
            else None
        )
        publish = events is not None and events.enable_kv_cache_events
        attach = config.data_parallel_size > 1 and config.data_parallel_routing == "prefix"
        if not (publish or attach) or not manager.enable_caching:
            return None
        manager.block_pool.enable_kv_cache_events(manager.block_size)
        publisher = make_publisher(events, config.data_parallel_rank) if publish else None
        return cls(manager.block_pool, publisher, attach, config.data_parallel_rank)

    def after_step(self, outputs: EngineCoreOutputs) -> None:
        events = self.pool.take_kv_events()
        if not events:
            return
        batch = make_batch(events, self.rank)
        if self.publisher is not None:
            self.publisher.publish(batch)
        if self.attach:
            outputs.kv_events = batch

    def shutdown(self) -> None:
        if self.publisher is not None:
            self.publisher.shutdown()
