"""What the block pool tells the outside world about its prefix index, as plain records.

A router that sends each request to the engine already holding its prefix needs to know,
per engine, which block hashes are cached. The pool records one event per change of its
hash index (a run of blocks entering it, hashes leaving it, everything cleared); the engine
drains them once per step and publishes them (the runtime encodes them in vLLM's wire
format). Applying the stream in order to an empty set reproduces the index exactly: a
BlockStored names only hashes that were not in it, a BlockRemoved only hashes that were.

The recording is off by default and then costs one `is None` test per index change.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagemill.blockpool.hashing import BlockHash

MEDIUM_GPU = "GPU"  # vLLM's name for the device pool, whatever the device is


@dataclass(slots=True)
class BlockStored:
    """Blocks that entered the index, in chain order: each hash chains the one before it,
    the first chains `parent_block_hash` (None: the first block of a sequence).
    `token_ids` holds `block_size` ids per block."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU


@dataclass(slots=True)
class BlockRemoved:
    """Hashes that left the index (evicted for reuse, or distrusted after a failed step)."""

    block_hashes: list[BlockHash]
    medium: str | None = MEDIUM_GPU


@dataclass(slots=True)
class AllBlocksCleared:
    """The whole index was dropped (a prefix-cache reset)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
