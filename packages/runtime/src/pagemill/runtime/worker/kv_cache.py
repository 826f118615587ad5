"""The KV pool: how many blocks to give it, and its memory as torch tensors.

The memory itself is a `pagemill.blockpool.KVStorage` (CuPy on CUDA, NumPy on CPU) that
torch views zero-copy through DLPack, so the block pool's bookkeeping and the kernels
share one allocation.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from pagemill.blockpool import CacheConfig, KVStorage, kv_bytes_per_token, num_blocks_for_budget
from pagemill.runtime.model_config import ModelConfig, canonical_dtype

logger = logging.getLogger(__name__)

# CPU default: a byte budget rather than "all free RAM", since host memory is shared with
# everything else on the machine. Capped further by what the configured batch can use.
DEFAULT_CPU_KV_BYTES = 1 << 30


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The storage's name for a torch dtype ("torch.bfloat16" -> "bfloat16")."""
    return canonical_dtype(str(dtype))


def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    return kv_bytes_per_token(
        config.num_hidden_layers, config.num_key_value_heads, config.head_dim, kv_dtype_name(dtype)
    )


def max_useful_blocks(block_size: int, max_num_seqs: int, max_model_len: int) -> int:
    """Blocks needed to hold every sequence at full length: more could never be used."""
    return max_num_seqs * math.ceil(max_model_len / block_size)


def cpu_num_blocks(
    config: ModelConfig,
    dtype: torch.dtype,
    block_size: int,
    budget_bytes: int | None,
    max_num_seqs: int,
    max_model_len: int,
) -> int:
    budget = DEFAULT_CPU_KV_BYTES if budget_bytes is None else budget_bytes
    n = num_blocks_for_budget(budget, block_size, bytes_per_token(config, dtype))
    if budget_bytes is None:
        n = min(n, max_useful_blocks(block_size, max_num_seqs, max_model_len))
    return n


def cuda_num_blocks(
    config: ModelConfig,
    dtype: torch.dtype,
    block_size: int,
    device: torch.device,
    peak_activation_bytes: int,
    gpu_memory_utilization: float,
) -> int:
    """Blocks that fit in utilization x total memory, after what is already used and the peak.

    `peak_activation_bytes` is the profiled extra memory of a max-budget forward on top of
    the weights; everything else already in use on the device (weights, other processes)
    is read from the driver.
    """
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    budget = int(total * gpu_memory_utilization) - used - peak_activation_bytes
    if budget <= 0:
        raise RuntimeError(
            f"no GPU memory left for the KV cache: {used / 2**30:.2f} GiB in use and a "
            f"{peak_activation_bytes / 2**30:.2f} GiB activation peak exceed "
            f"gpu_memory_utilization={gpu_memory_utilization} of {total / 2**30:.2f} GiB; "
            "raise gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return num_blocks_for_budget(budget, block_size, bytes_per_token(config, dtype))


def size_kv_pool(
    runner: Any,
    config: ModelConfig,
    dtype: torch.dtype,
    cache: CacheConfig,
    max_num_seqs: int,
    max_model_len: int,
) -> int:
    """Blocks for the pool: profiled on CUDA, a byte budget on CPU; too small fails here.

    On CUDA with decode graphs on (`runner.use_cuda_graphs`), the graphs' memory is
    measured before the pool is sized and subtracted from its budget; with an explicit
    `kv_cache_memory_bytes` the graphs simply come on top of it.

    A pool that cannot hold one max_model_len request would leave such a request waiting
    forever, so it is refused at start-up with the numbers that would fix it. When blocks
    leave the pool behind the window (`kv_sliding_window`), a request needs only a window's
    worth at a time, so one window plus a block (and the null block) is enough.
    """
    block_size = cache.block_size
    per_token = bytes_per_token(config, dtype)
    if runner.device.type == "cuda" and cache.kv_cache_memory_bytes is None:
        peak = runner.profile_peak_memory()
        # CUDA graphs hold their own pool (and buffers) for the engine's life, beside the
        # eager activation peak: measured by a trial capture, taken out of the budget.
        graph_bytes = runner.measure_cuda_graph_memory() if runner.use_cuda_graphs else 0
        num_blocks = cuda_num_blocks(
            config,
            dtype,
            block_size,
            runner.device,
            peak + graph_bytes,
            cache.gpu_memory_utilization,
        )
        logger.info(
            "profiled activation peak: %.1f MiB; CUDA graphs: %.1f MiB",
            peak / 2**20,
            graph_bytes / 2**20,
        )
    else:
        num_blocks = cpu_num_blocks(
            config, dtype, block_size, cache.kv_cache_memory_bytes, max_num_seqs, max_model_len
        )
    needed = -(-max_model_len // block_size)
    if kv_sliding_window(config, cache, num_blocks) is not None:
        needed = min(needed, num_blocks)
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks ({num_blocks * block_size} tokens, "
            f"{per_token} bytes/token) but one max_model_len={max_model_len} request needs "
            f"{needed} blocks; raise kv_cache_memory_bytes / gpu_memory_utilization or lower "
            "max_model_len"
        )
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %s)",
        num_blocks,
        block_size,
        num_blocks * block_size,
        num_blocks * block_size * per_token / 2**20,
        kv_dtype_name(dtype),
    )
    return num_blocks


class KVCache:
    """Per-layer (K, V) torch views of the pool; keeps the backing storage alive."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.storage: KVStorage | None = None
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        if device.type == "cuda":
            try:
                self.storage = KVStorage(
                    config.num_hidden_layers,
                    num_blocks,
                    block_size,
                    config.num_key_value_heads,
                    config.head_dim,
                    kv_dtype_name(dtype),
                    device=f"cuda:{device.index or 0}",
                )
            except RuntimeError as e:
                # Without CuPy the pool is allocated by torch directly: same layout, same use.
                logger.warning(
                    "KVStorage unavailable on CUDA (%s); allocating the KV cache with torch", e
                )
        else:
            self.storage = KVStorage(
                config.num_hidden_layers,
                num_blocks,
                block_size,
                config.num_key_value_heads,
                config.head_dim,
                kv_dtype_name(dtype),
                device="cpu",
            )
        if self.storage is not None:
            self.caches = [
                (_as_torch(k, dtype, device), _as_torch(v, dtype, device))
                for k, v in zip(self.storage.k_caches, self.storage.v_caches)
            ]
        else:
            self.caches = [
                (
                    torch.zeros(shape, dtype=dtype, device=device),
                    torch.zeros(shape, dtype=dtype, device=device),
                )
                for _ in range(config.num_hidden_layers)
            ]
        self.nbytes = sum(k.nbytes + v.nbytes for k, v in self.caches)


def _as_torch(array: object, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.from_dlpack(array)
    if dtype == torch.bfloat16:
        t = t.view(torch.bfloat16)  # stored as uint16 bit containers (NumPy has no bf16)
    if t.dtype != dtype:
        raise RuntimeError(f"KV storage holds {t.dtype}, the model computes in {dtype}")
    if t.device.type != device.type:
        raise RuntimeError(f"KV storage lives on {t.device}, the model on {device}")
    return t


def shared_window(config: ModelConfig) -> int:
    """The sliding window every layer shares, or 0 (no window, or some layers global)."""
    windows = {config.layer_window(i) for i in range(config.num_hidden_layers)}
    return windows.pop() if len(windows) == 1 else 0


def kv_sliding_window(config: ModelConfig, cache: CacheConfig, num_blocks: int) -> int | None:
    """The window the KV cache manager may give blocks back behind, or None to keep all.

    Only when every layer attends through the same window: a full-attention layer (Gemma
    2/3's global layers) reads every block of the context, so nothing may leave the pool
    for it. A pool smaller than one window plus a block keeps every block too (said once).
    """
    window = shared_window(config)
    if not cache.sliding_window_free_blocks or window <= 0:
        return None
    usable = num_blocks - 1  # the null block is nobody's
    if usable * cache.block_size < window + cache.block_size - 1:
        logger.warning(
            "KV pool of %d blocks cannot hold a sliding window of %d tokens plus a block: "
            "every block of a request is kept",
            num_blocks,
            window,
        )
        return None
    return window
