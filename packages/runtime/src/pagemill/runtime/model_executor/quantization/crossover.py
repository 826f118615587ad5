"""Where a packed layer hands over to its dense copy, measured on this machine.

A packed CPU kernel reads 2-4x fewer bytes than a dense bf16 GEMM, which wins while a step
streams weights (few rows), and computes slower once a step is compute-bound. Where the
two cross depends on the CPU (AMX or AVX512-BF16, cache sizes, core count), the format and
the layer's shape: a table measured on one machine is wrong on the next. So at the first
start on a machine, every distinct kind of packed layer (format, shape, group size) that
keeps a dense copy is timed both ways on the model's own weights — enough layers of that
kind in turn that the weights stream from memory as they do in a step — at a few row
counts, packed and dense alternating, the fastest run of each kept (other jobs only ever
add time). The whole table is timed in `PASSES` passes, one after the other, and each point
keeps its fastest pass: a burst of other work (a neighbour, the server's own processes
starting) spoils a point in one pass, not in all. A time above the time of more rows on the
same path is read as such a burst too (more rows never take less): each path's times are
taken as their running minimum from the largest row count down before the crossover is
read, and the two row counts each limit then stands between are timed once more (until
the limit holds): a burst that spanned both passes at just those points does not decide.
All of it matters because a result is kept for good: one start on a busy machine that saw
dense win at 16 rows would serve every later 16-row step from the dense copies. Results
are kept in a JSON file next to the compile cache, keyed by CPU features, torch version,
thread count and the native kernels' sources, so later starts read them; a file that does
not parse is measured again. If measuring overruns its budget, the machine is too busy for
the timings to mean anything: the table is used, and the next starts try again, up to
`BUSY_ATTEMPTS` busy starts in all; after that the table is kept (delete the file to
measure again). A start that measures after a busy one changes the limits and so the
compiled graphs: that start misses the compile cache once, which a cold engine compiles in
the background while it serves (`EngineConfig.compile_in_background`); a machine left on
the table for good would lose on every step instead.

A layer whose large side is AMX on its packed blocks (`Linear.amx_large_rows`) and that also
holds a dense weight (a tied Q8_0 head shares the bf16 embedding) is timed three ways: packed,
AMX and oneDNN on the dense weight; its group then runs whichever large side sums to less
over the row counts above its crossover (so a machine where oneDNN wins keeps it).

The decision is per group, not per kind: the LM head (outside the compiled forward) on its
own, every other layer per format, summing the kinds' step times. Every distinct limit in
the forward is one more compiled graph (see `Linear.compiled_branch`), so a limit per
shape would cost a compile per shape at every cold start. Row counts are powers of two.

`PAGEMILL_PACKED_LIMITS=table` skips the measurement and uses the fixed table
(`scheme.PACKED_MAX_TOKENS`), as the test suite does to stay deterministic.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
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
# Also measured for layers whose packed path is a GEMM that can beat the dense copy at any
# batch (`gemv_q4` with int8 activations: integer dot products), so a machine where it
# does keeps it for large batches too; PyTorch's int4 and int8 kernels lose long before.
LARGE_ROW_COUNTS = (64, 128, 256)
# Alternating runs per row count, and the dense bytes of a layer kind's sample (past the
# last-level cache of most CPUs).
REPS = 3
SAMPLE_BYTES = 48 << 20
# Passes over the whole table (see the module's docstring), then rounds of timing again
# the two row counts each limit stands between, until it holds (`_confirm`).
PASSES = 2
CONFIRM_ROUNDS = 2
# Past this per pass, the machine is too busy for the timings to mean anything. Generous: a slow
# machine that is not busy at all (two cores without AVX-512, where fp32 dense copies and
# packed kernels both take long at 256 rows) needs several times what a fast one does for
# the same model, and paid once per machine it is small beside a cold start's compile.
BUDGET_S = 20.0
# Busy starts (measuring overran BUDGET_S) before the fixed table is kept for good.
BUSY_ATTEMPTS = 3
# Bump when what is measured, or how, changes: older results are then measured again.
_FORMAT = 3

# (layers of one kind, rows) -> (packed seconds, dense seconds) per layer, and oneDNN seconds
# on the dense weight third where the large side is AMX and a dense weight is there too
# (`time_layers`)
Timer = Callable[[Sequence["Linear"], int], tuple[float, ...]]


def packed_limits_mode() -> str:
    mode = os.environ.get(PACKED_LIMITS_ENV, "measure")
    if mode not in PACKED_LIMITS_MODES:
        raise ValueError(f"{PACKED_LIMITS_ENV} must be one of {PACKED_LIMITS_MODES}, got {mode!r}")
    return mode


def layer_kind(layer: Linear) -> str:
    """What the crossover depends on, besides the machine."""
    kind = (
        f"{layer.weight_format}:{layer.out_features}x{layer.in_features}"
        f":g{layer.group_size}:{str(layer.kernel_dtype).removeprefix('torch.')}"
        f"/{str(layer.dtype).removeprefix('torch.')}"
    )
    kind += f":int8x{layer.int8_act}" if layer.int8_act else ""
    # The large side is AMX on the packed blocks, not a dense copy: another pair to time.
    return kind + (":amx" if layer.amx_large_rows else "")


def row_counts(layer: Linear, rows: Sequence[int], large: Sequence[int]) -> list[int]:
    """The row counts to time `layer`'s kind at: `rows`, and `large` too where the packed
    path is `gemv_q4` (see `LARGE_ROW_COUNTS`)."""
    return [*rows, *(n for n in large if n > max(rows))] if layer.int8_act else list(rows)


def _kernel_sources() -> str:
    """A digest of pagemill's native kernel sources and the switches that pick among their
    paths: a new kernel changes which side wins, so limits timed with the old one must not
    be read back (a cached limit is never re-measured otherwise)."""
    import pagemill.kernels

    digest = hashlib.sha256()
    csrc = Path(pagemill.kernels.__file__).parent / "csrc"
    for src in sorted([*csrc.glob("*.cpp"), *csrc.glob("*.h")]):
        digest.update(src.name.encode())
        digest.update(src.read_bytes())
    for name in ("PAGEMILL_CPU_GEMV_AMX", "PAGEMILL_CPU_AMX_PACKED"):
        digest.update(f"{name}={os.environ.get(name, '')}".encode())
    return digest.hexdigest()


def machine_key() -> str:
    """The CPU (its feature flags and model name), torch, the thread count and the native
    kernels' sources."""
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
        _kernel_sources(),
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


def sample_layers(layers: Sequence[Linear], max_bytes: int = SAMPLE_BYTES) -> list[Linear]:
    """Enough of `layers` that their dense weights outgrow the CPU's caches (a step
    streams them), few enough that a big model's timing stays short."""
    one = layers[0].in_features * layers[0].out_features * layers[0].dtype.itemsize
    return list(layers[: max(1, min(len(layers), -(-max_bytes // one)))])


def has_onednn_choice(layer: Linear) -> bool:
    """Whether `layer`'s large side is AMX on its packed blocks while a dense weight is there
    too (a tied head's embedding): oneDNN on that weight is then timed as well."""
    return layer.amx_large_rows and layer.weight is not None


def time_layers(layers: Sequence[Linear], rows: int) -> tuple[float, ...]:
    """Seconds per layer to run `layers` packed and dense on `rows` rows (and on oneDNN
    third where `has_onednn_choice`): the fastest of a few alternating runs (other jobs on
    the machine only ever add time)."""
    from pagemill.runtime.model_executor.layers.linear import Linear

    x = torch.randn(rows, layers[0].in_features, dtype=layers[0].dtype)
    paths: list[Callable[[Linear, torch.Tensor], torch.Tensor]] = [Linear._packed, Linear._dense]
    if has_onednn_choice(layers[0]):
        paths.append(Linear._onednn)
    times: list[list[float]] = [[] for _ in paths]

    def once(fn: Callable[[Linear, torch.Tensor], torch.Tensor]) -> float:
        t0 = time.perf_counter()
        for layer in layers:
            fn(layer, x)
        return (time.perf_counter() - t0) / len(layers)

    with torch.inference_mode():
        for fn in paths:
            once(fn)
        for _ in range(REPS):
            for fn, kept in zip(paths, times):
                kept.append(once(fn))
    return tuple(min(kept) for kept in times)


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not all(
            isinstance(v, dict)
            and isinstance(v.get("rows"), list)
            and (
                v.get("busy") is True
                or (isinstance(v.get("packed_ms"), list) and isinstance(v.get("dense_ms"), list))
            )
            for v in data.values()
        ):
            raise ValueError("not a map of layer kinds to timings")
        return data
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        logger.warning("packed limits: %s is unreadable (%s); measuring again", path, e)
        return {}


def _busy_starts(entry: dict[str, Any]) -> int:
    """Busy starts behind a kind's entry (files from before the count held one)."""
    if entry.get("busy") is not True:
        return 0
    count = entry.get("busy_starts", 1)
    return count if isinstance(count, int) else 1


def _retry_busy(entry: dict[str, Any]) -> bool:
    return 0 < _busy_starts(entry) < BUSY_ATTEMPTS


def _group(name: str, layer: Linear) -> str:
    """Layers that share one limit: the LM head (outside the compiled forward) on its own,
    the rest per format: every distinct limit in the forward is another compiled graph."""
    return "lm_head" if name.split(".")[-1] == "logits_proj" else layer.weight_format


def measure_packed_limits(
    model: nn.Module,
    path: Path | None = None,
    timer: Timer | None = None,
    rows: Sequence[int] = ROW_COUNTS,
    budget_s: float = BUDGET_S,
    large_rows: Sequence[int] = LARGE_ROW_COUNTS,
) -> dict[str, int] | None:
    """Set `packed_max_tokens` of every packed layer with a dense copy whose scheme leaves it
    to measurement, from `path` (default: `limits_file()`) or by measuring the layer kinds
    it lacks; returns the limit per group (LM head, or format: see `_group`), or None when
    the table is asked for or nothing is packed.

    Measuring stops at `budget_s` per pass: a machine that slow is too busy for timings to mean
    anything, so this start's kinds (and their groups) keep the table's limit, and that is
    saved as the answer: measuring at a later start would change the compiled graphs.
    """
    from pagemill.runtime.model_executor.layers.linear import Linear

    if packed_limits_mode() == "table":
        return None
    timer = time_layers if timer is None else timer
    kinds: dict[str, list[Linear]] = {}
    groups: dict[str, set[str]] = {}
    for name, m in model.named_modules():
        if isinstance(m, Linear) and m.has_dense_fallback and m.scheme.measure_packed_limit:
            kind = layer_kind(m)
            kinds.setdefault(kind, []).append(m)
            groups.setdefault(_group(name, m), set()).add(kind)
    if not kinds:
        return None
    path = limits_file() if path is None else path
    known = _read(path)
    kind_rows = {k: row_counts(members[0], rows, large_rows) for k, members in kinds.items()}
    todo = [
        k
        for k in kinds
        if k not in known or known[k]["rows"] != kind_rows[k] or _retry_busy(known[k])
    ]
    fresh: dict[str, Any] = {}
    if todo:
        start = time.perf_counter()
        total_budget = budget_s * PASSES
        best: dict[str, list[tuple[float, ...]]] = {}
        for _ in range(PASSES):
            for kind in todo:
                if time.perf_counter() - start > total_budget:
                    break
                sample = sample_layers(kinds[kind])
                times = [timer(sample, n) for n in kind_rows[kind]]
                kept = best.get(kind)
                best[kind] = (
                    times
                    if kept is None
                    else [tuple(map(min, a, b)) for a, b in zip(kept, times, strict=True)]
                )
        for kind, times in best.items():
            fresh[kind] = {
                "rows": kind_rows[kind],
                "packed_ms": [t[0] * 1e3 for t in times],
                "dense_ms": [t[1] * 1e3 for t in times],
            }
            if all(len(t) > 2 for t in times):
                fresh[kind]["onednn_ms"] = [t[2] * 1e3 for t in times]
        elapsed = time.perf_counter() - start
        if elapsed > total_budget:
            fresh = {
                kind: {
                    "rows": kind_rows[kind],
                    "busy": True,
                    "busy_starts": _busy_starts(known.get(kind, {})) + 1,
                }
                for kind in todo
            }
            logger.warning(
                "packed vs dense: measuring took %.1f s (budget %.1f s): the machine is too "
                "busy for timings to mean anything; using the fixed table (busy start %d of "
                "%d before it is kept; delete %s to measure again)",
                elapsed,
                total_budget,
                max(v["busy_starts"] for v in fresh.values()),
                BUSY_ATTEMPTS,
                path,
            )
        known.update(fresh)
        if elapsed <= total_budget:
            measured = {g: members for g, members in groups.items() if members <= set(fresh)}
            _confirm(known, kinds, measured, timer, start + total_budget)
            logger.info(
                "packed vs dense: measured %d layer kinds in %.1f s (kept in %s)",
                len(fresh),
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
    limits: dict[str, int] = {}
    large_side: dict[str, str] = {}
    for group, members in sorted(groups.items()):
        if any(known[k].get("busy") for k in members):
            continue  # keeps the table's limit
        limits[group], use_onednn, choice = _decide(known, kinds, members)
        for k in members:
            for layer in kinds[k]:
                layer.packed_max_tokens = limits[group]
                if use_onednn and k in choice:
                    layer.amx_large_rows = False  # the dense weight through oneDNN instead
        if choice:
            large_side[group] = "oneDNN on the dense weight" if use_onednn else "AMX"
    if limits:
        logger.info(
            "packed vs dense: %s",
            ", ".join(
                f"{g} packed up to {n} rows"
                + (f", then {large_side[g]}" if g in large_side else "")
                for g, n in limits.items()
            ),
        )
    return limits


def _decide(
    known: dict[str, Any], kinds: dict[str, list[Linear]], members: set[str]
) -> tuple[int, bool, list[str]]:
    """A group's limit from its kinds' timings: (limit, whether the large side is oneDNN on
    the dense weight, the kinds that had that choice)."""
    # The group's step time at each row count all its kinds were timed at: per-layer
    # times times the layer counts.
    shared = _shared_rows(known, members)
    counts = {k: len(kinds[k]) for k in members}
    packed = _summed(known, counts, len(shared), "packed_ms")
    dense = _summed(known, counts, len(shared), "dense_ms")
    choice = [k for k in members if "onednn_ms" in known[k] and has_onednn_choice(kinds[k][0])]
    # Kinds without the choice add their one large side to both sums.
    onednn = _summed(known, counts, len(shared), "onednn_ms") if choice else dense
    use_onednn = bool(choice) and _onednn_wins(shared, packed, dense, onednn)
    return crossover(shared, packed, onednn if use_onednn else dense), use_onednn, choice


def _shared_rows(known: dict[str, Any], members: set[str]) -> list[int]:
    """The row counts every kind of the group was timed at (the shortest list: the others
    extend it)."""
    shared = min((known[k]["rows"] for k in members), key=len)
    return list(shared)


def _confirm(
    known: dict[str, Any],
    kinds: dict[str, list[Linear]],
    groups: dict[str, set[str]],
    timer: Timer,
    deadline: float,
) -> None:
    """Time each freshly measured group's kinds once more at the two row counts its limit
    stands between (the limit and the next), keeping the faster of each, until the limit
    holds (`CONFIRM_ROUNDS` at most): a burst that spanned both passes at just those row
    counts moves the limit, one elsewhere does not."""
    for members in groups.values():
        for _ in range(CONFIRM_ROUNDS):
            if time.perf_counter() > deadline:
                return
            limit = _decide(known, kinds, members)[0]
            shared = _shared_rows(known, members)
            above = [n for n in shared if n > limit]
            decisive = ([limit] if limit else []) + above[:1]
            for kind in sorted(members):
                entry = known[kind]
                sample = sample_layers(kinds[kind])
                for n in decisive:
                    i = entry["rows"].index(n)
                    for key, t in zip(("packed_ms", "dense_ms", "onednn_ms"), timer(sample, n)):
                        if key in entry:
                            entry[key][i] = min(entry[key][i], t * 1e3)
            if _decide(known, kinds, members)[0] == limit:
                break


def _summed(known: dict[str, Any], counts: dict[str, int], n: int, key: str) -> list[float]:
    """Per-layer times `key` (else "dense_ms"), each kind's as its `running_min`, times the
    layer counts, summed over kinds, at the first `n` row counts."""
    series = {k: running_min(known[k].get(key, known[k]["dense_ms"])) for k in counts}
    return [sum(series[k][i] * c for k, c in counts.items()) for i in range(n)]


def running_min(times: Sequence[float]) -> list[float]:
    """`times` (one path, row counts ascending) with each entry lowered to the least of it
    and every later one: more rows never take less, so a time above a later one was
    something else's (see the module's docstring)."""
    out = list(times)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


def _onednn_wins(
    rows: Sequence[int], packed: Sequence[float], amx: Sequence[float], onednn: Sequence[float]
) -> bool:
    """Whether oneDNN on the dense weight takes less than AMX in all over the row counts
    the large side serves (those above the crossover against the faster of the two)."""
    best = [min(a, o) for a, o in zip(amx, onednn)]
    limit = crossover(rows, packed, best)
    above = [i for i, n in enumerate(rows) if n > limit]
    return bool(above) and sum(onednn[i] for i in above) < sum(amx[i] for i in above)
