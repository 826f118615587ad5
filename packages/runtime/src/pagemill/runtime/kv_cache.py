"""The KV pool: how many blocks to give it, and its memory as torch tensors.

The memory itself is a `pagemill.blockpool.KVStorage` (CuPy on CUDA, NumPy on CPU) that
torch views zero-copy through DLPack, so the block pool's bookkeeping and the kernels
share one allocation.
"""

from __future__ import annotations

import logging
import math

import torch

from pagemill.blockpool import KVStorage, kv_bytes_per_token, num_blocks_for_budget

from .config import ModelConfig

logger = logging.getLogger(__name__)

# CPU default: a byte budget rather than "all free RAM", since host memory is shared with
# everything else on the machine. Capped further by what the configured batch can use.
DEFAULT_CPU_KV_BYTES = 1 << 30

_KV_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def kv_dtype_name(dtype: torch.dtype) -> str:
    return _KV_DTYPE_NAMES[dtype]


def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    return kv_bytes_per_token(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, kv_dtype_name(dtype))


def max_useful_blocks(block_size: int, max_num_seqs: int, max_model_len: int) -> int:
    """Blocks needed to hold every sequence at full length: more could never be used."""
    return max_num_seqs * math.ceil(max_model_len / block_size)


def cpu_num_blocks(
    config: ModelConfig, dtype: torch.dtype, block_size: int, budget_bytes: int | None, max_num_seqs: int, max_model_len: int
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


class KVCache:
    """Per-layer (K, V) torch views of the pool; keeps the backing storage alive."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.storage: KVStorage | None = None
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        if device.type == "cuda":
            try:
                self.storage = KVStorage(
                    config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads,
                    config.head_dim, kv_dtype_name(dtype), device=f"cuda:{device.index or 0}",
                )
            except RuntimeError as e:
                # Without CuPy the pool is allocated by torch directly: same layout, same use.
                logger.warning("KVStorage unavailable on CUDA (%s); allocating the KV cache with torch", e)
        else:
            self.storage = KVStorage(
                config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads,
                config.head_dim, kv_dtype_name(dtype), device="cpu",
            )
        if self.storage is not None:
            self.caches = [
                (_as_torch(k, dtype, device), _as_torch(v, dtype, device))
                for k, v in zip(self.storage.k_caches, self.storage.v_caches)
            ]
        else:
            self.caches = [
                (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
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
