"""pagemill.blockpool: paged KV-cache memory.

Block pool with an O(1) intrusive free queue and ref counts, chained prefix-cache hashing,
a per-request KV cache manager, CuPy/NumPy KV storage exported through DLPack, sizing
helpers, and host memory on huge pages (for the KV pool and for other arrays read end to
end every step, such as packed weights). Depends on NumPy (and xxhash) only; never imports torch.
"""

from pagemill.blockpool.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from pagemill.blockpool.config import CacheConfig
from pagemill.blockpool.hashing import (
    BlockHash,
    get_hash_fn,
    hash_block_chain,
    hash_block_tokens,
)
from pagemill.blockpool.host_memory import huge_page_bytes, huge_page_zeros
from pagemill.blockpool.kv_cache_coordinator import HybridKVCacheManager, KVCacheBlocks
from pagemill.blockpool.kv_cache_groups import KVCacheGroupSpec, group_layers_by_window
from pagemill.blockpool.kv_cache_manager import CacheRequest, KVCacheManager, PrefixCacheStats
from pagemill.blockpool.kv_storage import KVStorage
from pagemill.blockpool.sizing import DTYPE_BYTES, kv_bytes_per_token, num_blocks_for_budget

__version__ = "0.4.0"

__all__ = [
    "DTYPE_BYTES",
    "BlockHash",
    "BlockPool",
    "CacheConfig",
    "CacheRequest",
    "FreeBlockQueue",
    "HybridKVCacheManager",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "KVStorage",
    "PrefixCacheStats",
    "get_hash_fn",
    "group_layers_by_window",
    "hash_block_chain",
    "hash_block_tokens",
    "huge_page_bytes",
    "huge_page_zeros",
    "kv_bytes_per_token",
    "num_blocks_for_budget",
]
