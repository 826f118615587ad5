"""Where a packed layer hands over to its dense copy, measured on this machine.

A packed CPU kernel reads 2-4x fewer bytes than a dense bf16 GEMM, which wins while a step
streams weights (few rows), and computes slower once a step is compute-bound. Where the
two cross depends on the CPU (AMX or AVX512-BF16, cache sizes, core count), the format and
the layer's shape: a table measured on one machine is wrong on the next. So at the first
start on a machine, every distinct kind of packed layer (format, shape, group size) that
keeps a dense copy is timed both ways on the model's own weights — all the layers of that
kind in turn, so the weights stream from memory as they do in a step — at a few row
counts, packed and dense alternating so a loaded machine slows both alike. The row count
up to which packed wins becomes the layers' `packed_max_tokens`. Results are kept in a
JSON file next to the compile cache, keyed by CPU features, torch version and thread
count, so later starts read them; a file that does not parse is measured again.

Row counts are powers of two: every distinct limit is one more compiled graph (see
`Linear.compiled_branch`), so limits are kept to a few values.

`PAGEMILL_PACKED_LIMITS=table` skips the measurement and uses the fixed table
(`scheme.PACKED_MAX_TOKENS`), as the test suite does to stay deterministic.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch import nn

    from pagemill.runtime.model_executor.layers.linear import Linear

logger = logging.getLogger(__name__)

PACKED_LIMITS_ENV = "PAGEMILL_PACKED_LIMITS"
PACKED_LIMITS_MODES = ("measure", "table")
ROW_COUNTS = (1, 2, 4, 8, 16, 32)
# Bump when what is measured, or how, changes: older results are then measured again.
_FORMAT = 1

# (layers of one kind, rows) -> (packed seconds, dense seconds)
Timer = Callable[[Sequence["Linear"], int], tuple[float, float]]


def packed_limits_mode() -> str:
    mode = os.environ.get(PACKED_LIMITS_ENV, "measure")
    if mode not in PACKED_LIMITS_MODES:
        raise ValueError(f"{PACKED_LIMITS_ENV} must be one of {PACKED_LIMITS_MODES}, got {mode!r}")
    return mode


def layer_kind(layer: Linear) -> str:
    """What the crossover depends on, besides the machine."""
    return (
        f"{layer.weight_format}:{layer.out_features}x{layer.in_features}"
        f":g{layer.group_size}:{str(layer.kernel_dtype).removeprefix('torch.')}"
        f"/{str(layer.dtype).removeprefix('torch.')}"
    )


def machine_key() -> str:
    """The CPU (its feature flags and model name), torch and the thread count."""
    from pagemill.runtime.worker.compilation import _cpu_flags

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        model = next((ln.split(":", 1)[1].strip() for ln in lines if "model name" in ln), "")
    except OSError:
        model = ""
    parts = [
        str(_FORMAT),
        torch.__version__,
        sys.version.split()[0],
        str(torch.get_num_threads()),
        model,
        _cpu_flags(),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def limits_file(root: Path | None = None) -> Path:
    if root is None:
        from pagemill.runtime.worker.compilation import CompileCache

        root = CompileCache.root()
    return root / f"packed-limits-{machine_key()}.json"


def crossover(rows: Sequence[int], packed_s: Sequence[float], dense_s: Sequence[float]) -> int:
    """The largest row count up to which packed was never slower than dense (0: dense
    always wins)."""
    limit = 0
    for n, p, d in zip(rows, packed_s, dense_s):
        if p > d:
            break
        limit = n
    return limit


def time_layers(layers: Sequence[Linear], rows: int, budget_s: float = 0.05) -> tuple[float, float]:
    """Median seconds to run every layer of `layers` packed, then dense, on `rows` rows;
    the two alternate."""
    x = torch.randn(rows, layers[0].in_features, dtype=layers[0].dtype)
    packed: list[float] = []
    dense: list[float] = []

    def once(fn: Callable[[Linear, torch.Tensor], torch.Tensor]) -> float:
        t0 = time.perf_counter()
        for layer in layers:
            fn(layer, x)
        return time.perf_counter() - t0

    from pagemill.runtime.model_executor.layers.linear import Linear

    with torch.inference_mode():
        once(Linear._packed)
        once(Linear._dense)
        deadline = time.perf_counter() + budget_s
        while len(packed) < 3 or (time.perf_counter() < deadline and len(packed) < 15):
            packed.append(once(Linear._packed))
            dense.append(once(Linear._dense))
    return statistics.median(packed), statistics.median(dense)


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("limit"), int) for v in data.values()
        ):
            raise ValueError("not a map of kinds to limits")
        return data
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        logger.warning("packed limits: %s is unreadable (%s); measuring again", path, e)
        return {}


def measure_packed_limits(
    model: nn.Module,
    path: Path | None = None,
    timer: Timer | None = None,
    rows: Sequence[int] = ROW_COUNTS,
) -> dict[str, int] | None:
    """Set `packed_max_tokens` of every packed layer with a dense copy whose scheme leaves it
    to measurement, from `path` (default: `limits_file()`) or by measuring what it lacks;
    returns the limits per kind (None when the table is asked for or nothing is packed)."""
    from pagemill.runtime.model_executor.layers.linear import Linear

    if packed_limits_mode() == "table":
        return None
    groups: dict[str, list[Linear]] = {}
    for m in model.modules():
        if isinstance(m, Linear) and m.has_dense_fallback and m.scheme.measure_packed_limit:
            groups.setdefault(layer_kind(m), []).append(m)
    if not groups:
        return None
    path = limits_file() if path is None else path
    timer = time_layers if timer is None else timer
    known = _read(path)
    todo = [k for k in groups if k not in known]
    if todo:
        start = time.perf_counter()
        for kind in todo:
            layers = groups[kind]
            times = [timer(layers, n) for n in rows]
            limit = crossover(rows, [t[0] for t in times], [t[1] for t in times])
            known[kind] = {
                "limit": limit,
                "rows": list(rows),
                "packed_ms": [round(t[0] * 1e3, 4) for t in times],
                "dense_ms": [round(t[1] * 1e3, 4) for t in times],
            }
        logger.info(
            "packed vs dense: measured %d layer kinds in %.1f s (kept in %s)",
            len(todo),
            time.perf_counter() - start,
            path,
        )
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
            tmp.replace(path)
        except OSError as e:
            logger.warning("packed limits: could not save %s (%s)", path, e)
    limits = {kind: int(known[kind]["limit"]) for kind in groups}
    for kind, layers in groups.items():
        for layer in layers:
            layer.packed_max_tokens = limits[kind]
    logger.info(
        "packed vs dense: %s",
        ", ".join(f"{kind} packed up to {n} rows" for kind, n in sorted(limits.items())),
    )
    return limits
