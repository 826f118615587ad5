"""The KV pool: how many blocks to give it, and its memory as torch tensors.

The memory itself is a `pagemill.blockpool.KVStorage` (CuPy on CUDA, NumPy on CPU) that
torch views zero-copy through DLPack, so the block pool's bookkeeping and the kernels
share one allocation.

A model that mixes full-attention and sliding-window layers gets one block table per KV
cache group (`kv_cache_groups`, `pagemill.blockpool.HybridKVCacheManager`): the pool then
has one K and one V tensor per layer *of a group* rather than per model layer, and layer
i of every group reads and writes tensor i, so a block is a group's worth of layers and
the same bytes hold more of them (see `pagemill.blockpool.kv_cache_groups`).

With ``kv_cache_dtype`` fp8 or int8 the storage holds one byte per element (uint8 containers
viewed as ``torch.float8_e4m3fn``/``float8_e5m2``, or int8 itself), so the same budget sizes
twice the blocks of a 16-bit cache; each layer carries its K and V scales (`LayerKVScales`).
"""

from __future__ import annotations

import logging
import math
import os
import threading
from typing import Any

import torch

from pagemill.blockpool import (
    CacheConfig,
    KVCacheGroupSpec,
    KVStorage,
    group_layers_by_window,
    kv_bytes_per_token,
    num_blocks_for_budget,
)
from pagemill.blockpool.config import kv_cache_storage_dtype
from pagemill.blockpool.kv_cache_groups import group_size, layer_tensor_index
from pagemill.runtime.model_config import ModelConfig, canonical_dtype

logger = logging.getLogger(__name__)

# CPU default: a byte budget rather than "all free RAM", since host memory is shared with
# everything else on the machine. Capped further by what the configured batch can use.
DEFAULT_CPU_KV_BYTES = 1 << 30


def cpu_kv_prefault() -> bool:
    """`PAGEMILL_CPU_KV_PREFAULT` (1, the default, or 0); anything else is refused.

    1 maps the CPU pool's pages in a background thread at start (`KVStorage.prefault`): a
    block's first write would otherwise pay a page fault per page inside a step. 0 leaves
    them to fault in on first use (to compare, or to keep an oversized pool uncommitted)."""
    value = os.environ.get("PAGEMILL_CPU_KV_PREFAULT", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"PAGEMILL_CPU_KV_PREFAULT must be 0 or 1, got {value!r}")
    return value == "1"


def cpu_kv_huge_pages() -> bool:
    """`PAGEMILL_CPU_KV_HUGEPAGES` (1, the default, or 0); anything else is refused.

    1 asks for transparent huge pages on the CPU pool's mappings (`KVStorage(huge_pages=)`):
    the decode kernel's reads of blocks scattered over the pool then cross no 4 KB page
    boundaries (where the hardware prefetchers stop) and miss the TLB far less. Populating
    huge pages costs more at start (in the prefault thread). 0 keeps 4 KB pages."""
    value = os.environ.get("PAGEMILL_CPU_KV_HUGEPAGES", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"PAGEMILL_CPU_KV_HUGEPAGES must be 0 or 1, got {value!r}")
    return value == "1"


# vLLM's calculate_kv_scales rule: scale = amax / constant (K_SCALE_CONSTANT,
# V_SCALE_CONSTANT), leaving headroom under the fp8 maximum for later, larger activations.
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0
# The int8 cache's rule: amax maps to the largest code. int8's steps are uniform, so headroom
# costs resolution everywhere, where fp8's costs only its smallest exponents; a later, larger
# activation saturates instead.
INT8_K_SCALE_CONSTANT = 127.0
INT8_V_SCALE_CONSTANT = 127.0


def kv_dtype_name(dtype: torch.dtype, kv_cache_dtype: str = "auto") -> str:
    """The storage's name for the KV cache of a model computing in ``dtype``
    ("torch.bfloat16" -> "bfloat16"; kv_cache_dtype "fp8" -> "float8_e4m3fn")."""
    return kv_cache_storage_dtype(kv_cache_dtype, canonical_dtype(str(dtype)))


def kv_torch_dtype(dtype: torch.dtype, kv_cache_dtype: str = "auto") -> torch.dtype:
    """The torch dtype the KV views have: ``dtype`` itself, or the 8-bit format."""
    if kv_cache_dtype == "auto":
        return dtype
    return getattr(torch, kv_dtype_name(dtype, kv_cache_dtype))


def bytes_per_token(
    config: ModelConfig,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
    groups: list[KVCacheGroupSpec] | None = None,
) -> int:
    """Bytes of one token of one block: every layer's, or with KV cache groups one
    group's worth of layers (a block then holds one group's KV)."""
    return kv_bytes_per_token(
        config.num_hidden_layers if groups is None else group_size(groups),
        config.num_key_value_heads,
        config.head_dim,
        kv_dtype_name(dtype, kv_cache_dtype),
    )


class LayerKVScales:
    """One layer's K and V scales (fp32, read by the kernels on every call; updated in place
    so compiled graphs and CUDA graphs see new values): 0-dim, or [num_kv_heads] after
    `per_head` (which must come before the model is compiled or captured). ``pending``: set
    them from the next forward's K/V amax (``--calculate-kv-scales``)."""

    def __init__(self, device: torch.device, kv_dtype: torch.dtype | None = None) -> None:
        self.k_scale = torch.ones((), dtype=torch.float32, device=device)
        self.v_scale = torch.ones((), dtype=torch.float32, device=device)
        self.pending = False
        int8 = kv_dtype == torch.int8
        self.constants = (
            (INT8_K_SCALE_CONSTANT, INT8_V_SCALE_CONSTANT)
            if int8
            else (K_SCALE_CONSTANT, V_SCALE_CONSTANT)
        )

    def per_head(self, num_kv_heads: int) -> None:
        """One scale per KV head from now on (each head keeps the layer's current value)."""
        self.k_scale = self.k_scale.expand(num_kv_heads).contiguous()
        self.v_scale = self.v_scale.expand(num_kv_heads).contiguous()

    def calculate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Scales from this forward's K and V ([tokens, kv_heads, head_dim]): amax over the
        whole tensor, or over each head's rows when the scales are per head."""
        for scale, x, const in (
            (self.k_scale, k, self.constants[0]),
            (self.v_scale, v, self.constants[1]),
        ):
            x = x.detach()
            if not x.numel():
                amax = torch.zeros(scale.shape, dtype=torch.float32, device=scale.device)
            elif scale.dim() == 1:
                amax = x.abs().amax(dim=(0, 2)).float()
            else:
                amax = x.abs().amax().float()
            # An all-zero tensor (or head) says nothing about the range: keep 1.0 then.
            scale.copy_(torch.where(amax > 0, amax / const, torch.ones_like(amax)))
        self.pending = False


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
    kv_cache_dtype: str = "auto",
    groups: list[KVCacheGroupSpec] | None = None,
    draft_bytes_per_token: int = 0,
) -> int:
    """`draft_bytes_per_token`: a draft model's or EAGLE head's own pool, which has as many
    blocks as this one; the budget covers both."""
    budget = DEFAULT_CPU_KV_BYTES if budget_bytes is None else budget_bytes
    per_token = bytes_per_token(config, dtype, kv_cache_dtype, groups) + draft_bytes_per_token
    n = num_blocks_for_budget(budget, block_size, per_token)
    if budget_bytes is None:
        useful = max_useful_blocks(block_size, max_num_seqs, max_model_len)
        n = min(n, useful * (1 if groups is None else len(groups)) + 1)
    return n


def cuda_num_blocks(
    config: ModelConfig,
    dtype: torch.dtype,
    block_size: int,
    device: torch.device,
    peak_activation_bytes: int,
    gpu_memory_utilization: float,
    kv_cache_dtype: str = "auto",
    groups: list[KVCacheGroupSpec] | None = None,
    draft_bytes_per_token: int = 0,
) -> int:
    """Blocks that fit in utilization x total memory, after what is already used and the peak.

    `peak_activation_bytes` is the profiled extra memory of a max-budget forward on top of
    the weights (and of anything loaded later, such as a draft's weights); everything else
    already in use on the device (weights, other processes) is read from the driver. A
    draft's pool (`draft_bytes_per_token`, as many blocks) comes out of the same budget.
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
    return num_blocks_for_budget(
        budget,
        block_size,
        bytes_per_token(config, dtype, kv_cache_dtype, groups) + draft_bytes_per_token,
    )


def blocks_for_one_request(
    groups: list[KVCacheGroupSpec], block_size: int, max_model_len: int
) -> int:
    """Blocks one max_model_len request needs with per-group tables (the null block
    included): every block in full groups, a window's worth plus one in windowed ones."""
    blocks = -(-max_model_len // block_size)
    needed = 1
    for g in groups:
        w = g.sliding_window
        needed += blocks if w is None else min(blocks, -(-(w - 1) // block_size) + 1)
    return needed


def size_kv_pool(
    runner: Any,
    config: ModelConfig,
    dtype: torch.dtype,
    cache: CacheConfig,
    max_num_seqs: int,
    max_model_len: int,
    groups: list[KVCacheGroupSpec] | None = None,
    draft_bytes_per_token: int = 0,
    draft_weight_bytes: int = 0,
) -> int:
    """Blocks for the pool: profiled on CUDA, a byte budget on CPU; too small fails here.

    Speculative decoding with a draft model or an EAGLE head gives it a pool of its own
    with as many blocks (`draft_bytes_per_token` per token); both pools share the budget,
    and on CUDA the draft's weights, loaded after sizing, are held back from it too.

    On CUDA with decode graphs on (`runner.use_cuda_graphs`), the graphs' memory is
    measured before the pool is sized and subtracted from its budget; with an explicit
    `kv_cache_memory_bytes` the graphs simply come on top of it.

    A pool that cannot hold one max_model_len request would leave such a request waiting
    forever, so it is refused at start-up with the numbers that would fix it. When blocks
    leave the pool behind the window (`kv_sliding_window`), a request needs only a window's
    worth at a time, so one window plus a block (and the null block) is enough. With KV
    cache groups (`groups`) a block holds one group's layers, and one request needs
    `blocks_for_one_request`.
    """
    block_size = cache.block_size
    kv_dtype = cache.kv_cache_dtype
    per_token = bytes_per_token(config, dtype, kv_dtype, groups)
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
            peak + graph_bytes + draft_weight_bytes,
            cache.gpu_memory_utilization,
            kv_dtype,
            groups,
            draft_bytes_per_token,
        )
        logger.info(
            "profiled activation peak: %.1f MiB; CUDA graphs: %.1f MiB",
            peak / 2**20,
            graph_bytes / 2**20,
        )
    else:
        num_blocks = cpu_num_blocks(
            config,
            dtype,
            block_size,
            cache.kv_cache_memory_bytes,
            max_num_seqs,
            max_model_len,
            kv_dtype,
            groups,
            draft_bytes_per_token,
        )
    needed = -(-max_model_len // block_size)
    if groups is not None:
        needed = blocks_for_one_request(groups, block_size, max_model_len)
    elif kv_sliding_window(config, cache, num_blocks) is not None:
        needed = min(needed, num_blocks)
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks ({num_blocks * block_size} tokens, "
            f"{per_token + draft_bytes_per_token} bytes/token) but one "
            f"max_model_len={max_model_len} request needs "
            f"{needed} blocks; raise kv_cache_memory_bytes / gpu_memory_utilization or lower "
            "max_model_len"
        )
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %s)%s",
        num_blocks,
        block_size,
        num_blocks * block_size,
        num_blocks * block_size * per_token / 2**20,
        kv_dtype_name(dtype, kv_dtype),
        f"; the draft's pool: {num_blocks * block_size * draft_bytes_per_token / 2**20:.1f} MiB"
        if draft_bytes_per_token
        else "",
    )
    return num_blocks


class KVCache:
    """Per-layer (K, V) torch views of the pool and their scales; keeps the backing storage
    alive. ``dtype`` is the model's compute dtype, ``kv_cache_dtype`` the setting. With KV
    cache ``groups`` the pool has one tensor pair per layer of a group, and
    ``caches[layer]`` is the pair that layer's place in its group names (shared)."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_cache_dtype: str = "auto",
        groups: list[KVCacheGroupSpec] | None = None,
        prefault: bool = True,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        compute_dtype = dtype
        dtype = kv_torch_dtype(compute_dtype, kv_cache_dtype)
        self.dtype = dtype
        self.storage: KVStorage | None = None
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        num_layers = config.num_hidden_layers
        num_tensors = num_layers if groups is None else group_size(groups)
        if device.type == "cuda":
            try:
                self.storage = KVStorage(
                    num_tensors,
                    num_blocks,
                    block_size,
                    config.num_key_value_heads,
                    config.head_dim,
                    kv_dtype_name(compute_dtype, kv_cache_dtype),
                    device=f"cuda:{device.index or 0}",
                )
            except RuntimeError as e:
                # Without CuPy the pool is allocated by torch directly: same layout, same use.
                logger.warning(
                    "KVStorage unavailable on CUDA (%s); allocating the KV cache with torch", e
                )
        else:
            self.storage = KVStorage(
                num_tensors,
                num_blocks,
                block_size,
                config.num_key_value_heads,
                config.head_dim,
                kv_dtype_name(compute_dtype, kv_cache_dtype),
                device="cpu",
                huge_pages=cpu_kv_huge_pages(),
            )
        # Read (and checked) now even when the prefault starts later.
        self._prefault_pending = (
            self.storage is not None and self.storage.backend == "numpy" and cpu_kv_prefault()
        )
        if prefault:
            self.start_prefault()
        # The CPU pool's one mapping as one tensor, every layer's K and V a view of it: a
        # compiled graph then reads them all through one input (`bind_kv_caches`).
        self.pool: torch.Tensor | None = None
        if self.storage is not None and self.storage.mapping is not None:
            mapping = self.storage.mapping
            pool = _as_torch(mapping.view(self.storage.container_dtype), dtype, device)
            self.pool = pool

            def view(array: Any) -> torch.Tensor:
                start = (array.ctypes.data - mapping.ctypes.data) // pool.element_size()
                return pool[start : start + array.size].view(array.shape)

            tensors = [
                (view(k), view(v)) for k, v in zip(self.storage.k_caches, self.storage.v_caches)
            ]
        elif self.storage is not None:
            tensors = [
                (_as_torch(k, dtype, device), _as_torch(v, dtype, device))
                for k, v in zip(self.storage.k_caches, self.storage.v_caches)
            ]
        else:
            tensors = [
                (
                    torch.zeros(shape, dtype=dtype, device=device),
                    torch.zeros(shape, dtype=dtype, device=device),
                )
                for _ in range(num_tensors)
            ]
        self.nbytes = sum(k.nbytes + v.nbytes for k, v in tensors)
        if groups is None:
            self.caches = tensors
        else:
            self.caches = [tensors[i] for i in layer_tensor_index(groups, num_layers)]
        self.scales = [LayerKVScales(device, dtype) for _ in range(config.num_hidden_layers)]

    def start_prefault(self, gate: threading.Event | None = None) -> None:
        """Map a CPU pool's pages in a background thread (`KVStorage.prefault`), once;
        with `gate`, only while it is set (the engine's idle flag).

        The engine calls this when it is ready rather than at allocation: populating
        transparent huge pages costs far more than 4 KB pages (zeroing, compaction) and,
        run beside a warm start's graph loading, delayed the start, while the first
        requests need only the few blocks they fault in themselves."""
        if self._prefault_pending and self.storage is not None:
            self._prefault_pending = False
            self.storage.prefault(background=True, gate=gate)

    @property
    def scales_pending(self) -> bool:
        return any(s.pending for s in self.scales)

    def calculate_scales_on_next_forward(self) -> None:
        """``--calculate-kv-scales``: the next forward (run eagerly) sets every layer's."""
        for s in self.scales:
            s.pending = True

    def use_per_head_scales(self, num_kv_heads: int) -> None:
        """One K and one V scale per KV head in every layer (before compiling or capturing:
        the graphs read the scale tensors they were made with)."""
        for s in self.scales:
            s.per_head(num_kv_heads)

    def load_scales(
        self,
        k_scales: list[float | list[float] | None],
        v_scales: list[float | list[float] | None],
    ) -> None:
        """Per-layer scales from a checkpoint: one value, or one per KV head (None: keep
        1.0). One value fills every head of a per-head layer; per-head values need
        `use_per_head_scales` first."""
        for i, (s, k, v) in enumerate(zip(self.scales, k_scales, v_scales)):
            for scale, value in ((s.k_scale, k), (s.v_scale, v)):
                if value is None:
                    continue
                if isinstance(value, list):
                    if scale.shape != (len(value),):
                        raise ValueError(
                            f"layer {i}: {len(value)} per-head KV cache scales for scales "
                            f"of shape {tuple(scale.shape)}"
                        )
                    scale.copy_(torch.tensor(value, dtype=torch.float32))
                else:
                    scale.fill_(float(value))


def _as_torch(array: object, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.from_dlpack(array)
    if dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        t = t.view(dtype)  # stored as uint16 / uint8 bit containers (NumPy has neither)
    if t.dtype != dtype:
        raise RuntimeError(f"KV storage holds {t.dtype}, the model computes in {dtype}")
    if t.device.type != device.type:
        raise RuntimeError(f"KV storage lives on {t.device}, the model on {device}")
    return t


def shared_window(config: ModelConfig) -> int:
    """The sliding window every layer shares, or 0 (no window, or some layers global)."""
    windows = {config.layer_window(i) for i in range(config.num_hidden_layers)}
    return windows.pop() if len(windows) == 1 else 0


def kv_cache_groups(config: ModelConfig, cache: CacheConfig) -> list[KVCacheGroupSpec] | None:
    """Per-group block tables for a model whose layers attend through different windows
    (full attention mixed with sliding windows: Gemma 2/3), or None for one table.

    Off with ``sliding_window_free_blocks=False`` (every block kept, one table), and for
    models whose layers all share one window (`kv_sliding_window` serves those).
    """
    windows = [config.layer_window(i) for i in range(config.num_hidden_layers)]
    if not cache.sliding_window_free_blocks or len(set(windows)) < 2:
        return None
    return group_layers_by_window(windows)


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
