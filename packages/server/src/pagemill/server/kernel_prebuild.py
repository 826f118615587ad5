"""`pagemill serve` starts the CPU kernels' first build before it prepares the model.

On a machine's first start the C++ kernel libraries take tens of seconds of compiling, and
the front end's own work before the engine process exists (verifying and extracting the
default model, spawning the engine, importing torch there) leaves a core idle. A build
process started first (`python -m pagemill.kernels.prebuild`) fills it; the engine's
loaders later find the libraries built, or wait on the build in progress instead of
starting their own.

Whether to start it must cost nothing on every other start: this module imports neither
torch nor the kernels package (whose import is torch's). The build process touches a
stamp named by what the builds depend on (the kernels package's files, compiler, CPU,
torch's version, the interpreter) once all of them succeeded; a start that finds the stamp
starts nothing, and nor does one while a build process runs (it holds a lock for its life).
The stamp only decides whether to start early: the loaders check each library's own key
whatever it says. A build process outlives a server that stops first (a bad model name,
say): it finishes, and the next start uses what it built.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

_ENV = "PAGEMILL_NATIVE_CPU_KERNELS"
_CACHE_ENV = "PAGEMILL_KERNEL_CACHE_DIR"  # as `pagemill.kernels.native_build.cache_dir`
# Held (`flock`) by the build process for its life, through a descriptor it inherits: a
# start meanwhile, the stamp not yet written, starts no second one.
_LOCK = ".prebuild.lock"
# The build processes this process started: held so that they are not reported as leaked;
# one that outlives a server that stopped early finishes, and the next start uses its work.
_started: list[subprocess.Popen[bytes]] = []


def _kernels_dir() -> Path | None:
    spec = importlib.util.find_spec("pagemill.kernels")  # found, not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def kernel_dir(cache: Path) -> Path:
    """Where the builds are kept for cache folder `cache` (`native_build.cache_dir`)."""
    own = os.environ.get(_CACHE_ENV)
    return Path(own) if own else cache / "kernels"


def _stamp(cache: Path) -> Path | None:
    """The stamp file for this machine and installation; None when the kernels package or a
    compiler is missing (the engine then says so itself)."""
    kernels = _kernels_dir()
    cxx = shutil.which(os.environ.get("CXX") or "g++") or shutil.which("c++")
    cxx = cxx or shutil.which("clang++")
    if kernels is None or cxx is None:
        return None
    digest = hashlib.sha256()
    for path in sorted([*kernels.glob("*.py"), *(kernels / "csrc").glob("*")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    try:
        cpu = next(
            (
                line
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith(("flags", "Features"))
            ),
            "",
        )
    except OSError:
        cpu = ""
    for part in (cxx, platform.machine(), cpu, torch_version, sys.executable):
        digest.update(b"\0" + part.encode())
    return kernel_dir(cache) / f"prebuilt-{digest.hexdigest()[:16]}"


def start(device: str, cache: Path) -> subprocess.Popen[bytes] | None:
    """The build process, started in the background where the kernels may be missing and
    the engine runs on the CPU (`device` "cpu", or "auto" on a machine without an NVIDIA
    driver); else None. Its output is dropped: a build that fails here fails again, and is
    reported, in the engine that loads it."""
    if os.environ.get(_ENV, "1") == "0":
        return None
    if device != "cpu" and (device != "auto" or Path("/proc/driver/nvidia").exists()):
        return None
    try:
        stamp = _stamp(cache)
    except OSError:
        return None
    if stamp is None or stamp.is_file():
        return None
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        lock = open(stamp.parent / _LOCK, "a")  # noqa: SIM115 (handed to the child below)
    except OSError:
        return None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a build process is running (another start's)
            return None
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagemill.kernels.prebuild", "--stamp", str(stamp)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(lock.fileno(),),  # the lock lives as long as the child
        )
    _started.append(proc)
    return proc
