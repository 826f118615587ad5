"""Building the CPU kernels' C++ sources on the host: once per machine, in parallel, shared.

A first start on a machine compiles every kernel library the engine loads, and the
libraries of C++ torch operators parse torch's headers (seconds each). Built one after
another on the engine's path, with each kernel source compiled again for every library
that holds it, that was most of a cold start. Here a source becomes an object file cached
under its own key (its bytes, the quoted includes it names, the compiler, the CPU's
features, its flags), so a kernel compiled for its ctypes library is linked as it is into
the torch-operator library; the objects of one library compile side by side; and a file
lock per output makes a second builder (another thread, or another process such as a
start's background pre-build) wait for the first instead of compiling the same thing.

Nothing here imports torch (a torch-operator library's caller passes torch's flags).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: builders in one process still share `_thread_locks`
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

# Set to 0 to keep the torch paths (e.g. to compare the two).
ENV = "PAGEMILL_NATIVE_CPU_KERNELS"
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-std=c++17")
# A translation unit: a source alone (the library's flags) or with flags of its own.
Unit = Path | tuple[Path, Sequence[str]]
_TIMEOUT_S = 300
_INCLUDE = re.compile(rb'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


# Where the builds are kept, when not in the cache folder's kernels/ (builds depend on the
# machine and the sources, not on what else a cache folder holds: several folders can share).
CACHE_ENV = "PAGEMILL_KERNEL_CACHE_DIR"


def cache_dir() -> Path:
    """`$PAGEMILL_KERNEL_CACHE_DIR`, else `$PAGEMILL_CACHE_DIR/kernels`, else the user cache
    folder's `pagemill/kernels`."""
    own = os.environ.get(CACHE_ENV)
    if own:
        return Path(own)
    root = os.environ.get("PAGEMILL_CACHE_DIR")
    if root:
        return Path(root) / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg or Path.home() / ".cache") / "pagemill" / "kernels"


def compiler() -> str | None:
    return (
        shutil.which(os.environ.get("CXX") or "g++")
        or shutil.which("c++")
        or shutil.which("clang++")
    )


def cpu_signature() -> str:
    """What -march=native depends on: a library built for one CPU may not run on another."""
    try:
        flags = next(
            (
                line
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith(("flags", "Features"))
            ),
            "",
        )
    except OSError:
        flags = ""
    return f"{platform.machine()}|{flags}"


def _source_bytes(source: Path) -> bytes:
    """The source and every file it includes with quotes, transitively, found beside the
    file that names it (an include that is not there is the compiler's to report)."""
    seen: dict[Path, bytes] = {}
    todo = [source]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        data = path.read_bytes()
        seen[path] = data
        for name in _INCLUDE.findall(data):
            included = path.parent / name.decode()
            if included.is_file():
                todo.append(included.resolve())
    return b"".join(p.name.encode() + b"\0" + seen[p] for p in sorted(seen))


# Concurrent compiler processes this process runs: one per core (a second builder process
# has its own; the output locks keep the two from compiling the same object).
_jobs = threading.BoundedSemaphore(os.cpu_count() or 1)
_thread_locks: dict[Path, threading.Lock] = {}
_thread_locks_guard = threading.Lock()


@contextlib.contextmanager
def _exclusive(target: Path) -> Iterator[None]:
    """Held while `target` is built: by this thread against the others (a lock per path)
    and, through `flock` on a lock file beside it, against other processes."""
    with _thread_locks_guard:
        lock = _thread_locks.setdefault(target, threading.Lock())
    with lock:
        if fcntl is None:
            yield
            return
        with open(target.with_name(f".{target.name}.lock"), "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


def _produce(target: Path, command: Sequence[str]) -> Path:
    """Run `command` (its output named by the placeholder "{out}") unless `target` exists;
    the output goes to a temporary file renamed into place, so a reader never loads half a
    file."""
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(target):
        if target.is_file():  # another builder finished it while this one waited
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            with _jobs:
                subprocess.run(
                    [str(out) if a == "{out}" else a for a in command],
                    check=True,
                    capture_output=True,
                    text=True,
                    timeout=_TIMEOUT_S,
                )
            os.replace(out, target)
    return target


def _object(cxx: str, source: Path, flags: Sequence[str]) -> Path:
    key = hashlib.sha256(
        _source_bytes(source) + cxx.encode() + cpu_signature().encode() + " ".join(flags).encode()
    ).hexdigest()[:16]
    target = cache_dir() / "objects" / f"{source.stem}-{key}.o"
    return _produce(target, [cxx, "-c", str(source), *flags, "-o", "{out}"])


def build_shared(
    sources: Path | Sequence[Unit],
    what: str,
    fallback: str,
    extra_flags: Sequence[str] = (),
    link_flags: Sequence[str] = (),
) -> Path | None:
    """`sources` built for this CPU into one shared library; its path, or None (logged,
    naming `what` and the `fallback` that serves instead) when `PAGEMILL_NATIVE_CPU_KERNELS=0`,
    without a compiler, or when the build fails.

    Each unit compiles with `COMPILE_FLAGS`, `extra_flags` and its own flags (a later
    `-std` wins) into a cached object; `link_flags` (libraries, search paths) apply to the
    link alone. The library is named after its objects and the link flags, so a change to
    any source, header, flag or the CPU builds a new one beside the old."""
    if not enabled():
        return None
    cxx = compiler()
    if cxx is None:
        logger.warning("no C++ compiler found for %s: %s", what, fallback)
        return None
    units = [sources] if isinstance(sources, Path) else list(sources)
    pairs = [(u, ()) if isinstance(u, Path) else (Path(u[0]), tuple(u[1])) for u in units]
    try:
        with ThreadPoolExecutor(len(pairs)) as pool:
            objects = list(
                pool.map(lambda p: _object(cxx, p[0], [*COMPILE_FLAGS, *extra_flags, *p[1]]), pairs)
            )
        key = hashlib.sha256(
            "\0".join([cxx, *(o.name for o in objects), *link_flags]).encode()
        ).hexdigest()[:16]
        target = cache_dir() / f"{pairs[0][0].stem}-{key}.so"
        # Libraries (-l) after the objects: they resolve what the objects need.
        return _produce(
            target, [cxx, *map(str, objects), "-shared", "-fopenmp", *link_flags, "-o", "{out}"]
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        logger.warning("building %s failed (%s); %s", what, detail.strip()[-500:], fallback)
        return None
