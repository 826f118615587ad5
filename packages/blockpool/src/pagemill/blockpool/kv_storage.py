"""The KV cache memory itself: per-layer K and V arrays of shape
[num_blocks, block_size, num_kv_heads, head_dim].

Arrays are CuPy on a CUDA device and NumPy otherwise, and both export DLPack, so the
runtime wraps them with `torch.from_dlpack` without a copy and without this package ever
importing torch. bfloat16 has no NumPy dtype: it is stored in uint16 containers holding the
raw bf16 bits, and the torch side reinterprets with `.view(torch.bfloat16)`. float8 formats
are likewise stored as uint8 containers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagemill.blockpool.sizing import canonical_dtype

# Element type actually allocated for each logical KV dtype.
_CONTAINER: dict[str, str] = {
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "uint16",
    "float8_e4m3fn": "uint8",
    "float8_e5m2": "uint8",
    "int8": "int8",
    "uint8": "uint8",
}


def _cupy_if_available() -> Any | None:
    """CuPy module when it is installed and sees a CUDA device, else None."""
    try:
        import cupy
    except Exception:  # not installed, or a broken CUDA install: fall back to NumPy
        return None
    try:
        return cupy if cupy.is_available() else None
    except Exception:
        return None


def _parse_device(device: str) -> tuple[str, int]:
    name = str(device).lower()
    if name in ("auto", "cpu", "cuda"):
        return name, 0
    if name.startswith("cuda:") and name[5:].isdigit():
        return "cuda", int(name[5:])
    raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")


class KVStorage:
    """Zero-initialized K and V caches for every layer, on the GPU when there is one."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str = "float16",
        device: str = "auto",
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.dtype = canonical_dtype(dtype)
        self.container_dtype = _CONTAINER[self.dtype]
        kind, index = _parse_device(device)
        xp: Any = np
        if kind in ("auto", "cuda"):
            cupy = _cupy_if_available()
            if cupy is not None:
                xp = cupy
            elif kind == "cuda":
                raise RuntimeError(
                    "device='cuda' needs CuPy and a CUDA device; install "
                    "pagemill-blockpool[cuda12] or [cuda13], or use device='cpu'"
                )
        self.backend: str = "cupy" if xp is not np else "numpy"
        self.device_index: int | None = index if self.backend == "cupy" else None
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.shape: tuple[int, int, int, int] = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_caches: list[Any] = []
        self.v_caches: list[Any] = []
        if self.backend == "cupy":
            with xp.cuda.Device(index):
                self._allocate(xp)
        else:
            self._allocate(xp)
        self.nbytes: int = sum(int(a.nbytes) for a in self.k_caches + self.v_caches)

    def _allocate(self, xp: Any) -> None:
        for _ in range(self.num_layers):
            self.k_caches.append(xp.zeros(self.shape, dtype=self.container_dtype))
            self.v_caches.append(xp.zeros(self.shape, dtype=self.container_dtype))

    def __repr__(self) -> str:
        return (
            f"KVStorage(layers={self.num_layers}, shape={self.shape}, dtype={self.dtype}, "
            f"backend={self.backend}, nbytes={self.nbytes})"
        )
