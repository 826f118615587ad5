"""CacheConfig: defaults, frozen, and every bad value refused with the field's name."""

from __future__ import annotations

import dataclasses

import pytest

from pagemill.blockpool import CacheConfig
from pagemill.blockpool.hashing import HASH_ALGOS


def test_defaults_and_frozen() -> None:
    c = CacheConfig()
    assert (c.block_size, c.enable_prefix_caching, c.prefix_caching_hash_algo) == (
        16,
        True,
        "sha256",
    )
    assert c.kv_cache_memory_bytes is None and c.gpu_memory_utilization == 0.9
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.block_size = 32  # type: ignore[misc]
    assert (
        CacheConfig(
            prefix_caching_hash_algo="xxh3_128",
            kv_cache_memory_bytes=1 << 20,
            gpu_memory_utilization=1,
        ).kv_cache_memory_bytes
        == 1 << 20
    )


def test_hash_algo_choices_are_the_hashers() -> None:
    (f,) = [f for f in dataclasses.fields(CacheConfig) if f.name == "prefix_caching_hash_algo"]
    assert f.metadata["choices"] == HASH_ALGOS


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"block_size": 0}, ValueError, "CacheConfig.block_size must be positive"),
        ({"block_size": True}, TypeError, "CacheConfig.block_size must be an int"),
        ({"block_size": 16.0}, TypeError, "CacheConfig.block_size must be an int"),
        ({"enable_prefix_caching": 1}, TypeError, "CacheConfig.enable_prefix_caching"),
        ({"sliding_window_free_blocks": "no"}, TypeError, "sliding_window_free_blocks"),
        ({"prefix_caching_hash_algo": "md5"}, ValueError, "prefix_caching_hash_algo must be one"),
        ({"kv_cache_memory_bytes": 0}, ValueError, "kv_cache_memory_bytes must be a positive"),
        ({"kv_cache_memory_bytes": 1.5e9}, TypeError, "kv_cache_memory_bytes must be None or"),
        ({"gpu_memory_utilization": 0}, ValueError, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"gpu_memory_utilization": 1.01}, ValueError, "gpu_memory_utilization must be in"),
        ({"gpu_memory_utilization": "0.5"}, TypeError, "gpu_memory_utilization must be a number"),
    ],
)
def test_bad_values(changes: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        CacheConfig(**changes)
