"""How many KV-cache bytes a token costs and how many blocks fit in a budget.

Kept free of torch and NumPy dtype objects so the runtime can size the pool from a
model config before anything is allocated.
"""

from __future__ import annotations

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

# Other spellings users and checkpoints write (vLLM's --dtype values, torch's short names).
DTYPE_ALIASES: dict[str, str] = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def canonical_dtype(dtype: str) -> str:
    """Normalize 'torch.bfloat16', 'bf16', ... to a key of DTYPE_BYTES."""
    name = str(dtype).removeprefix("torch.").lower()
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise ValueError(f"unsupported KV dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}")
    return name


def dtype_bytes(dtype: str | int) -> int:
    """Bytes per element; an int is taken as the element size itself."""
    if isinstance(dtype, bool):
        raise TypeError("dtype must be a dtype name or a positive element size in bytes")
    if isinstance(dtype, int):
        if dtype <= 0:
            raise ValueError(f"element size must be positive, got {dtype}")
        return dtype
    return DTYPE_BYTES[canonical_dtype(dtype)]


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str | int) -> int:
    """K and V for one token across all layers: 2 * layers * kv_heads * head_dim * elem."""
    for name, value in (
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes(dtype)


def num_blocks_for_budget(budget_bytes: int, block_size: int, bytes_per_token: int) -> int:
    """Whole blocks that fit in `budget_bytes` (a partial block is worthless)."""
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be non-negative, got {budget_bytes}")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if bytes_per_token <= 0:
        raise ValueError(f"bytes_per_token must be positive, got {bytes_per_token}")
    return int(budget_bytes) // (block_size * bytes_per_token)
