"""Build the CPU kernel libraries an engine loads before it asks for them, side by side.

On a machine's first start the engine would otherwise build each library at the moment it
first needs it, one at a time, with the model's loading waiting on every build. `prebuild`
starts all of them on a background thread (their compilers run in parallel, one per core)
while the engine goes on; a library the engine reaches before its build ends waits on that
build's lock rather than compiling it again. On a machine where they are built, it only
hashes the sources. `python -m pagemill.kernels.prebuild` does the same in a process of its
own (what `pagemill serve` starts before it prepares the model, so that the builds overlap
that work too) and, when every build succeeded, touches the `--stamp` file it was given.

The LoRA kernel is not among them: an engine without adapters never loads it.
"""

from __future__ import annotations

import argparse
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pagemill.kernels import (
    attention_cpu,
    cpu_native,
    gemv_q4_cpu,
    gemv_q8_cpu,
    native_build,
    sampler_cpu,
)

logger = logging.getLogger(__name__)


def builds() -> list[tuple[str, Callable[[], Path | None]]]:
    """(name, build) of each library, the longest first: the torch operators' unit parses
    torch's headers, and the ctypes libraries link the objects it compiles beside it."""
    return [
        ("torch operators", cpu_native.build_torch_ops),
        ("decode attention", cpu_native.build),
        ("int4 GEMV", gemv_q4_cpu.build),
        ("Q8_0 GEMV", gemv_q8_cpu.build),
        ("sampler", sampler_cpu.build),
        ("prefill attention", attention_cpu.build_prefill),
    ]


def build_all() -> dict[str, Path | None]:
    """Every library of `builds()`, built concurrently; name -> its path (None: not built,
    and the build said why)."""
    todo = builds()
    with ThreadPoolExecutor(len(todo), thread_name_prefix="pagemill-prebuild") as pool:
        paths = list(pool.map(lambda item: item[1](), todo))
    return {name: path for (name, _), path in zip(todo, paths, strict=True)}


def prebuild() -> threading.Thread | None:
    """`build_all` on a daemon thread, started; None where no library would be built
    (`PAGEMILL_NATIVE_CPU_KERNELS=0`, or no compiler: each loader says so itself)."""
    if not native_build.enabled() or native_build.compiler() is None:
        return None

    def run() -> None:
        try:
            build_all()
        except Exception:  # a loader builds its own library again and reports it
            logger.debug("kernel pre-build failed", exc_info=True)

    thread = threading.Thread(target=run, name="pagemill-prebuild", daemon=True)
    thread.start()
    return thread


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagemill.kernels.prebuild")
    parser.add_argument("--stamp", type=Path, help="file touched when every library is built")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    paths = build_all()
    if args.stamp is not None and all(p is not None for p in paths.values()):
        args.stamp.parent.mkdir(parents=True, exist_ok=True)
        args.stamp.touch()
    return 0 if all(p is not None for p in paths.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
