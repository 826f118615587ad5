"""KV-cache options, checked once at construction so a bad engine flag fails at start-up
with a message naming it, not when the pool is first sized or a block is first hashed.

Each field's docstring is the help text of its command-line flag (the server derives its
flags from this dataclass), so it is written for the person typing the flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagemill.blockpool.hashing import HASH_ALGOS

# vLLM's --kv-cache-dtype values: "fp8" is e4m3 (more precision, range +-448).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")


@dataclass(frozen=True)
class CacheConfig:
    """How the paged KV cache is laid out, sized and shared between requests."""

    block_size: int = 16
    """Tokens per KV-cache block (the unit of allocation and of prefix-cache sharing)."""

    enable_prefix_caching: bool = True
    """Reuse the KV blocks of a prompt prefix already computed for an earlier request."""

    prefix_caching_hash_algo: str = field(default="sha256", metadata={"choices": HASH_ALGOS})
    """Block hash for prefix caching: sha256 (collision-safe across tenants) or xxh3_128
    (faster, for single-tenant deployments)."""

    sliding_window_free_blocks: bool = True
    """Give KV blocks that have left the sliding window back to the pool, for models whose
    every layer is windowed (Mistral, Phi-3 with a window): a request then holds about one
    window of KV however long it grows (mixed models such as Gemma 2/3 keep every block)."""

    kv_cache_memory_bytes: int | None = None
    """Fixed KV-cache size in bytes (accepts 512MiB, 4GiB); on CUDA it overrides profiling;
    unset: sized from gpu_memory_utilization on CUDA, a default budget on CPU."""

    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory the engine may use in total (weights, activations and KV
    cache); the KV cache gets what remains after profiling."""

    kv_cache_dtype: str = field(default="auto", metadata={"choices": KV_CACHE_DTYPES})
    """KV cache storage: auto (the model's compute dtype), or fp8 / fp8_e4m3 / fp8_e5m2 /
    int8 (one byte per element, twice the tokens in the same memory; each layer's K and V are
    divided by a per-tensor scale on write and multiplied back on read). int8 stores
    symmetric rounded codes and needs calculate_kv_scales (checkpoint scales are fp8's)."""

    calculate_kv_scales: bool = False
    """With an fp8 or int8 KV cache: set each layer's K and V scales from the first
    prefill's largest magnitudes (vLLM's rule) instead of the checkpoint's k_scale/v_scale
    or 1.0."""

    kv_scales_per_head: bool = False
    """With an fp8 or int8 KV cache: one K and one V scale per KV head instead of per layer
    (calculated per head with calculate_kv_scales; a checkpoint whose scales are per head,
    llm-compressor's attn_head strategy, selects this by itself)."""

    def __post_init__(self) -> None:
        size = self.block_size
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"CacheConfig.block_size must be an int, got {type(size).__name__}")
        if size <= 0:
            raise ValueError(f"CacheConfig.block_size must be positive, got {size}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise TypeError(
                "CacheConfig.enable_prefix_caching must be a bool, got "
                f"{type(self.enable_prefix_caching).__name__}"
            )
        if not isinstance(self.sliding_window_free_blocks, bool):
            raise TypeError(
                "CacheConfig.sliding_window_free_blocks must be a bool, got "
                f"{type(self.sliding_window_free_blocks).__name__}"
            )
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(
                f"CacheConfig.prefix_caching_hash_algo must be one of {HASH_ALGOS}, "
                f"got {self.prefix_caching_hash_algo!r}"
            )
        budget = self.kv_cache_memory_bytes
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, int):
                raise TypeError(
                    "CacheConfig.kv_cache_memory_bytes must be None or an int, got "
                    f"{type(budget).__name__}"
                )
            if budget <= 0:
                raise ValueError(
                    f"CacheConfig.kv_cache_memory_bytes must be a positive number of bytes, "
                    f"got {budget}"
                )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"CacheConfig.kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if not isinstance(self.calculate_kv_scales, bool):
            raise TypeError(
                "CacheConfig.calculate_kv_scales must be a bool, got "
                f"{type(self.calculate_kv_scales).__name__}"
            )
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise ValueError(
                "CacheConfig.calculate_kv_scales needs an fp8 or int8 kv_cache_dtype (the auto "
                "cache stores K/V unscaled in the compute dtype)"
            )
        if not isinstance(self.kv_scales_per_head, bool):
            raise TypeError(
                "CacheConfig.kv_scales_per_head must be a bool, got "
                f"{type(self.kv_scales_per_head).__name__}"
            )
        if self.kv_scales_per_head and self.kv_cache_dtype == "auto":
            raise ValueError(
                "CacheConfig.kv_scales_per_head needs an fp8 or int8 kv_cache_dtype (the auto "
                "cache stores K/V unscaled in the compute dtype)"
            )
        if self.kv_cache_dtype == "int8" and not self.calculate_kv_scales:
            # Checkpoints carry fp8 scales (amax / 448 or so): read as int8 steps they would
            # saturate almost every value, and 1.0 rounds K/V to whole numbers.
            raise ValueError(
                "CacheConfig.kv_cache_dtype='int8' needs calculate_kv_scales=True "
                "(--calculate-kv-scales): int8 scales come from the first prefill"
            )
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, int | float):
            raise TypeError(
                f"CacheConfig.gpu_memory_utilization must be a number, got {type(util).__name__}"
            )
        if not 0 < util <= 1:
            raise ValueError(f"CacheConfig.gpu_memory_utilization must be in (0, 1], got {util}")


def kv_cache_storage_dtype(kv_cache_dtype: str, compute_dtype: str) -> str:
    """The KV storage dtype name (a key of `sizing.DTYPE_BYTES`) for a ``kv_cache_dtype``
    setting: the compute dtype for "auto", else the 8-bit format it names."""
    if kv_cache_dtype == "auto":
        return compute_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return "float8_e4m3fn"
    if kv_cache_dtype == "fp8_e5m2":
        return "float8_e5m2"
    if kv_cache_dtype == "int8":
        return "int8"
    raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
