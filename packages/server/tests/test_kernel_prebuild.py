"""`pagemill serve` starts the kernels' first build early (`kernel_prebuild.start`) only where
it may be needed: a CPU engine, native kernels on, no stamp for this installation."""

from __future__ import annotations

import fcntl
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from pagemill.server import kernel_prebuild


class _Started:
    def __init__(self, args: list[str], **kwargs: Any) -> None:
        self.args = args


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[_Started]:
    calls: list[_Started] = []

    def popen(args: list[str], **kwargs: Any) -> _Started:
        calls.append(_Started(args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.delenv("PAGEMILL_NATIVE_CPU_KERNELS", raising=False)
    monkeypatch.delenv("PAGEMILL_KERNEL_CACHE_DIR", raising=False)
    if kernel_prebuild._stamp(Path("/nonexistent")) is None:
        pytest.skip("no compiler or no torch here: nothing would be built")
    return calls


def test_a_first_cpu_start_builds_in_the_background(tmp_path: Path, started) -> None:
    proc = kernel_prebuild.start("cpu", tmp_path)
    assert proc is started[0]
    args = started[0].args
    assert args[1:3] == ["-m", "pagemill.kernels.prebuild"] and args[3] == "--stamp"
    stamp = Path(args[4])
    assert stamp.parent == tmp_path / "kernels" and stamp.name.startswith("prebuilt-")
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.touch()  # what the build process does once every library is built
    assert kernel_prebuild.start("cpu", tmp_path) is None and len(started) == 1


def test_not_started_for_a_gpu_or_with_native_kernels_off(
    tmp_path: Path, started, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert kernel_prebuild.start("cuda", tmp_path) is None
    assert kernel_prebuild.start("cuda:1", tmp_path) is None
    monkeypatch.setenv("PAGEMILL_NATIVE_CPU_KERNELS", "0")
    assert kernel_prebuild.start("cpu", tmp_path) is None
    assert started == []


def test_the_stamp_follows_the_kernel_sources(
    tmp_path: Path, started, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = kernel_prebuild._kernels_dir()
    assert real is not None
    copy = tmp_path / "kernels"
    shutil.copytree(real, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(kernel_prebuild, "_kernels_dir", lambda: copy)
    first = kernel_prebuild._stamp(tmp_path)
    assert first == kernel_prebuild._stamp(tmp_path)
    source = copy / "csrc" / "sampler_cpu.cpp"
    source.write_text(source.read_text() + "\n// changed\n")
    assert kernel_prebuild._stamp(tmp_path) not in (None, first)


def test_one_build_process_at_a_time(tmp_path: Path, started) -> None:
    """The build process holds a lock for its life (a descriptor it inherits): a start
    meanwhile, before its stamp is written, starts no second one."""
    stamp = kernel_prebuild._stamp(tmp_path)
    assert stamp is not None
    stamp.parent.mkdir(parents=True, exist_ok=True)
    with open(stamp.parent / kernel_prebuild._LOCK, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert kernel_prebuild.start("cpu", tmp_path) is None and started == []
    assert kernel_prebuild.start("cpu", tmp_path) is not None  # released: it starts


def test_the_builds_folder_follows_its_own_setting(
    tmp_path: Path, started, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEMILL_KERNEL_CACHE_DIR", str(tmp_path / "builds"))
    assert kernel_prebuild.start("cpu", tmp_path) is not None
    assert Path(started[0].args[4]).parent == tmp_path / "builds"
