"""Prefix-cache block hashes.

A block's hash chains its parent's hash, its token ids and its extra keys, so two blocks
hash equal only when the whole token prefix up to and including them (and the extra keys,
e.g. a tenant's cache salt) is equal. The byte serialization is length-prefixed and
type-tagged so that no two different inputs serialize to the same bytes; equality of the
digests then rests on the hash function alone. sha256 is the default because a collision
across tenants would leak one tenant's KV into another's answer; xxh3-128 is the fast option
for single-tenant deployments.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagemill.blockpool.kv_cache_manager import CacheRequest

BlockHash = bytes
HashFn = Callable[[bytes], bytes]

HASH_ALGOS: tuple[str, ...] = ("sha256", "xxh3_128")

_NO_PARENT = b"\x00"
_HAS_PARENT = b"\x01"


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def get_hash_fn(name: str = "sha256") -> HashFn:
    """Return the digest function for `name` ("sha256" or "xxh3_128")."""
    if name == "sha256":
        return _sha256
    if name == "xxh3_128":
        try:
            import xxhash
        except ImportError as exc:  # pragma: no cover - xxhash is a declared dependency
            raise ImportError("hash algorithm 'xxh3_128' needs the 'xxhash' package") from exc
        return xxhash.xxh3_128_digest
    raise ValueError(f"unknown hash algorithm {name!r}; expected one of {HASH_ALGOS}")


def _serialize_extra(key: object, out: list[bytes]) -> None:
    # Type tag + length prefix: ("ab",) and ("a", "b") or 1 and "1" must never collide.
    if key is None:
        out.append(b"N")
    elif isinstance(key, bool):
        out.append(b"T" if key else b"F")
    elif isinstance(key, int):
        raw = str(key).encode()
        out.append(b"i" + struct.pack("<I", len(raw)) + raw)
    elif isinstance(key, str):
        raw = key.encode("utf-8")
        out.append(b"s" + struct.pack("<I", len(raw)) + raw)
    elif isinstance(key, bytes | bytearray):
        out.append(b"b" + struct.pack("<I", len(key)) + bytes(key))
    elif isinstance(key, tuple):
        out.append(b"t" + struct.pack("<I", len(key)))
        for item in key:
            _serialize_extra(item, out)
    else:
        raise TypeError(
            f"extra key of type {type(key).__name__} cannot be hashed deterministically; "
            "use str, int, bytes, bool, None or tuples of them"
        )


def serialize_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple[object, ...] = ()
) -> bytes:
    """Deterministic, unambiguous bytes for (parent, token ids, extra keys)."""
    parts: list[bytes] = []
    if parent is None:
        parts.append(_NO_PARENT)
    else:
        parts.append(_HAS_PARENT + struct.pack("<I", len(parent)) + parent)
    n = len(token_ids)
    try:
        parts.append(struct.pack(f"<I{n}q", n, *token_ids))
    except struct.error as exc:
        raise ValueError(f"token ids must be 64-bit integers: {exc}") from exc
    parts.append(struct.pack("<I", len(extra_keys)))
    for key in extra_keys:
        _serialize_extra(key, parts)
    return b"".join(parts)


def hash_block_tokens(
    hash_fn: HashFn,
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[object, ...] = (),
) -> BlockHash:
    """Hash one block: H(parent hash, token ids, extra keys)."""
    return hash_fn(serialize_block(parent, token_ids, extra_keys))


def hash_block_chain(
    hash_fn: HashFn,
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple[object, ...] = (),
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids` (a trailing partial block gets none).

    `extra_keys` go into every block, so each hash stands on its own for isolation
    rather than relying on the chain alone.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(
            hash_fn, parent, token_ids[start : start + block_size], extra_keys
        )
        hashes.append(parent)
    return hashes


class BlockHasher:
    """The per-request hasher a KVCacheManager hands out: `hasher(request)` returns the hashes
    of the request's full blocks that `request.block_hashes` does not hold yet, chained on
    its last entry, with `request.cache_salt` in every block's extra keys.

    Only new blocks are hashed, and `block_size` is public so that a caller appending one
    token at a time can skip the call unless the token may have filled a block.
    `request.block_hashes` must describe a prefix of `request.all_token_ids`; the caller
    extends it with the result (the hasher never mutates the request).
    """

    __slots__ = ("block_size", "hash_fn")

    def __init__(self, hash_fn: HashFn, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.hash_fn = hash_fn
        self.block_size = block_size

    def __call__(self, request: CacheRequest) -> list[BlockHash]:
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        num_hashed = len(hashes)
        num_full = len(tokens) // bs
        if num_full <= num_hashed:
            return []
        salt = request.cache_salt
        extra: tuple[object, ...] = () if salt is None else (salt,)
        # A LoRA adapter's KV is its own: its id (an int, never equal to a str salt) keys
        # every block (vLLM keys by adapter too). Requests without the attribute: none.
        lora = getattr(request, "lora_int_id", 0)
        if lora:
            extra += (lora,)
        return hash_block_chain(
            self.hash_fn,
            tokens[num_hashed * bs : num_full * bs],
            bs,
            extra,
            hashes[-1] if hashes else None,
        )
