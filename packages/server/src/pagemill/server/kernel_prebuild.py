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
starts nothing. The stamp only decides whether to start early: the loaders check each
library's own key whatever it says.
"""

from __future__ import annotations

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


def _kernels_dir() -> Path | None:
    spec = importlib.util.find_spec("pagemill.kernels")  # found, not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


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
    return cache / "kernels" / f"prebuilt-{digest.hexdigest()[:16]}"


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
    return subprocess.Popen(
        [sys.executable, "-m", "pagemill.kernels.prebuild", "--stamp", str(stamp)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
