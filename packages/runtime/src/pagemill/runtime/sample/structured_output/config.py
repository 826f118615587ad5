"""Engine options for structured output (torch-free: the CLI reads it for its flags)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StructuredOutputsConfig:
    structured_outputs_compile_timeout: float = 10.0
    """Seconds of CPU a grammar may take to compile (CPU, so that a compile waiting for a
    core on a loaded machine is not stopped for it); past it the compile is stopped and its
    request fails with finish_reason "error" (a grammar that passed the request limits can
    still be this costly)."""

    structured_outputs_compile_workers: int = 2
    """Grammar compiles that may run at once, each in its own killable process: a slow
    grammar holds up at most one of them."""

    structured_outputs_cache_bytes: int = 64 * 2**20
    """Memory the engine's compiled-grammar cache may hold, e.g. 64MiB (each compile
    worker's own xgrammar cache gets a quarter of it); least recently used grammars go
    first."""

    def __post_init__(self) -> None:
        t = self.structured_outputs_compile_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0 < t < math.inf):
            raise ValueError(
                f"structured_outputs_compile_timeout must be a number of seconds > 0, got {t!r}"
            )
        w = self.structured_outputs_compile_workers
        if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= 64:
            raise ValueError(f"structured_outputs_compile_workers must be in 1..64, got {w!r}")
        b = self.structured_outputs_cache_bytes
        if isinstance(b, bool) or not isinstance(b, int) or b < 2**20:
            raise ValueError(f"structured_outputs_cache_bytes must be >= 1 MiB, got {b!r}")
