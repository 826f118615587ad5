"""KV-cache events on the wire: a subscriber written against vLLM's message classes.

The classes below are declared here from vLLM's `vllm/distributed/kv_events.py` (the
array-like, class-name-tagged layout), independently of pagemill's, so the test fails if
our encoding drifts from theirs.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import msgspec
import pytest
import zmq

from pagemill.blockpool import hash_block_chain
from pagemill.blockpool.hashing import get_hash_fn
from pagemill.runtime.engine.llm_engine import LLMEngine
from pagemill.runtime.sampling_params import SamplingParams


# ---- vLLM's classes, as a consumer would declare them -----------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)
BLOCK = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _engine(folder, events: dict[str, Any] | None, num_blocks_bytes: int = 1 << 16) -> LLMEngine:
    return LLMEngine(
        model=str(folder),
        dtype="float32",
        max_model_len=64,
        block_size=BLOCK,
        kv_cache_memory_bytes=num_blocks_bytes,
        max_num_batched_tokens=128,
        kv_events_config=events,
    )


def _run(engine: LLMEngine, prompts: list[list[int]]) -> None:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, SamplingParams(max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()


def _recv_all(sub: zmq.Socket, want_seq: int, timeout: float = 5.0) -> list[tuple[int, Any]]:
    got: list[tuple[int, Any]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv"
            got.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
            if got[-1][0] >= want_seq:
                break
    return got


def test_subscriber_rebuilds_the_cache_index_and_replays(tiny_llama) -> None:
    folder, _ = tiny_llama
    port, replay_port = _free_port(), _free_port()
    engine = _engine(
        folder,
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{port}",
            "replay_endpoint": f"tcp://*:{replay_port}",
            "topic": "kv",
        },
    )
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.3)  # PUB drops what it sends before the subscription arrives
    try:
        pool = engine.engine_core.kv_cache_manager.block_pool
        shared = list(range(10, 30))
        prompts = [[*shared, 1, 2, 3], [*shared, 4, 5, 6, 7, 8], list(range(40, 49))]
        _run(engine, prompts)
        # Enough distinct prompts to evict some of the earlier blocks.
        _run(engine, [list(range(100 + 20 * k, 117 + 20 * k)) for k in range(pool.num_blocks // 4)])

        deadline = time.monotonic() + 5
        batches: list[tuple[int, KVEventBatch]] = []
        index: set[bytes] = set()
        saw = {BlockStored: 0, BlockRemoved: 0}
        hash_fn = get_hash_fn("sha256")
        while time.monotonic() < deadline:
            batches += _recv_all(sub, 1 << 62, timeout=0.5)
            index.clear()
            for _, batch in batches:
                assert batch.data_parallel_rank == 0
                for ev in batch.events:
                    if isinstance(ev, BlockStored):
                        saw[BlockStored] += 1
                        assert ev.block_size == BLOCK and ev.medium == "GPU"
                        # Reproducible: the consumer re-derives the hashes from the tokens.
                        assert ev.block_hashes == hash_block_chain(
                            hash_fn, ev.token_ids, BLOCK, (), ev.parent_block_hash
                        )
                        index.update(ev.block_hashes)  # type: ignore[arg-type]
                    elif isinstance(ev, BlockRemoved):
                        saw[BlockRemoved] += 1
                        index.difference_update(ev.block_hashes)  # type: ignore[arg-type]
                    else:
                        index.clear()
            if index == set(pool.cached_block_hash_to_block):
                break
        assert saw[BlockStored] and saw[BlockRemoved]
        seqs = [s for s, _ in batches]
        assert seqs == list(range(len(seqs)))  # contiguous from 0
        assert index == set(pool.cached_block_hash_to_block)

        # A reset clears the consumer's index too (published with the next step).
        assert engine.engine_core.kv_cache_manager.reset_prefix_cache()
        _run(engine, [[1, 2, 3]])
        last = _recv_all(sub, len(seqs))
        assert any(isinstance(e, AllBlocksCleared) for _, b in last for e in b.events)

        # Replay: everything from seq 1 on, then the end marker (seq -1, empty payload).
        req = ctx.socket(zmq.DEALER)
        req.connect(f"tcp://127.0.0.1:{replay_port}")
        req.send_multipart((b"", (1).to_bytes(8, "big")))
        replayed = []
        while True:
            assert req.poll(5000)
            _, seq, payload = req.recv_multipart()
            n = int.from_bytes(seq, "big", signed=True)
            if n == -1:
                assert payload == b""
                break
            replayed.append((n, DECODER.decode(payload)))
        req.close(linger=0)
        numbers = [n for n, _ in replayed]
        assert numbers == list(range(1, numbers[-1] + 1))
        assert numbers[-1] >= last[-1][0]
        received = dict(batches + last)
        for n, batch in replayed:
            if n in received:
                assert batch.events == received[n].events
    finally:
        sub.close(linger=0)
        engine.shutdown()


def test_events_off_or_null_publisher_record_nothing(tiny_llama) -> None:
    folder, _ = tiny_llama
    for events in (None, {"enable_kv_cache_events": False, "publisher": "zmq"}):
        engine = _engine(folder, events)
        try:
            assert engine.engine_core._kv_events is None
            assert engine.engine_core.kv_cache_manager.block_pool.kv_events is None
        finally:
            engine.shutdown()
    engine = _engine(folder, {"enable_kv_cache_events": True, "publisher": "null"})
    try:
        _run(engine, [list(range(10, 30))])
        hook = engine.engine_core._kv_events
        assert hook is not None and type(hook.publisher).__name__ == "EventPublisher"
        assert engine.engine_core.kv_cache_manager.block_pool.kv_events == []  # drained
    finally:
        engine.shutdown()


def test_bad_kv_events_config_is_refused(tiny_llama) -> None:
    folder, _ = tiny_llama
    with pytest.raises(ValueError, match="publisher"):
        _engine(folder, {"enable_kv_cache_events": True, "publisher": "kafka"})
    with pytest.raises(ValueError, match="unknown field"):
        _engine(folder, {"enable_kv_cache_events": True, "endpiont": "tcp://*:1"})


def test_default_endpoint_is_the_loopback_and_bound() -> None:
    """Servers bind to 127.0.0.1 unless told otherwise: vLLM's default binds every
    interface (tcp://*), pagemill's the loopback; a loopback endpoint is bound, so a
    subscriber connects to it."""
    from pagemill.runtime.engine.kv_events import KVEventBatch as OurBatch
    from pagemill.runtime.engine.kv_events import KVEventsConfig, ZmqEventPublisher

    assert KVEventsConfig().endpoint == "tcp://127.0.0.1:5557"
    port = _free_port()
    publisher = ZmqEventPublisher(KVEventsConfig(True, "zmq", endpoint=f"tcp://127.0.0.1:{port}"))
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port}")
        deadline = time.monotonic() + 5
        got = None
        while got is None and time.monotonic() < deadline:  # a slow joiner misses the first
            publisher.publish(OurBatch(time.time(), []))
            if sub.poll(100):
                got = sub.recv_multipart()
        assert got is not None and len(got) == 3
        assert DECODER.decode(got[2]).events == []
    finally:
        sub.close(linger=0)
        publisher.shutdown()
