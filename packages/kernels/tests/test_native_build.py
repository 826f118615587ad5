"""The kernels' host builds (`native_build`, `prebuild`): objects shared between libraries,
one compile however many builders ask at once, and a pre-build that builds exactly what the
loaders then load."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pagemill.kernels import native_build

pytestmark = pytest.mark.skipif(native_build.compiler() is None, reason="no C++ compiler")


@pytest.fixture
def counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A compiler that records each call (one line of arguments) before running the real one;
    a fresh cache folder. Returns the record file."""
    log = tmp_path / "calls.log"
    wrapper = tmp_path / "cxx"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {native_build.compiler()} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    monkeypatch.setenv(native_build.CACHE_ENV, str(tmp_path / "cache" / "kernels"))
    log.touch()
    return log


def _calls(log: Path, word: str) -> int:
    return sum(word in line.split() for line in log.read_text().splitlines())


def _sources(tmp_path: Path) -> tuple[Path, Path]:
    src = tmp_path / "src"
    src.mkdir()
    (src / "shared.cpp").write_text('extern "C" int shared_value() { return 7; }\n')
    (src / "front.cpp").write_text(
        'extern "C" int shared_value();\nextern "C" int front() { return shared_value() + 1; }\n'
    )
    return src / "shared.cpp", src / "front.cpp"


def test_a_source_in_two_libraries_compiles_once(tmp_path: Path, counted: Path) -> None:
    shared, front = _sources(tmp_path)
    alone = native_build.build_shared(shared, "a test kernel", "nothing", ["-DX=1"])
    both = native_build.build_shared([front, (shared, ["-DX=1"])], "a test library", "nothing")
    assert alone is not None and both is not None and alone != both
    assert _calls(counted, str(shared)) == 1  # compiled for the first, linked into the second
    assert _calls(counted, str(front)) == 1
    assert ctypes.CDLL(str(alone)).shared_value() == 7
    assert ctypes.CDLL(str(both)).front() == 8
    # Other flags are another object.
    assert native_build.build_shared(shared, "a test kernel", "nothing", ["-DX=2"]) is not None
    assert _calls(counted, str(shared)) == 2


def test_concurrent_builders_compile_and_link_once(tmp_path: Path, counted: Path) -> None:
    shared, front = _sources(tmp_path)
    results: list[Path | None] = []
    start = threading.Barrier(4)

    def build() -> None:
        start.wait()
        results.append(native_build.build_shared([front, shared], "a test library", "nothing"))

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and results[0] is not None
    assert _calls(counted, str(shared)) == 1 and _calls(counted, str(front)) == 1
    assert _calls(counted, "-shared") == 1


def test_a_build_in_another_process_is_waited_for(tmp_path: Path, counted: Path) -> None:
    """While another process holds a library's build lock, a builder waits for it and takes
    the library that process leaves instead of compiling its own."""
    shared, _ = _sources(tmp_path)
    done = native_build.build_shared(shared, "a test kernel", "nothing")
    assert done is not None
    data = done.read_bytes()
    done.unlink()  # as if never built: the other process is building it now
    lock = done.with_name(f".{done.name}.lock")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time\n"
            "f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX)\n"
            "print('held', flush=True); time.sleep(1.0)\n"
            "open(sys.argv[2], 'wb').write(open(sys.argv[3], 'rb').read())\n",
            str(lock),
            str(done),
            str(tmp_path / "copy.so"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    (tmp_path / "copy.so").write_bytes(data)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        links = _calls(counted, "-shared")
        assert native_build.build_shared(shared, "a test kernel", "nothing") == done
        assert _calls(counted, "-shared") == links  # it waited, then found the library
    finally:
        holder.wait(timeout=30)
    assert ctypes.CDLL(str(done)).shared_value() == 7


def test_the_key_follows_quoted_includes_transitively(tmp_path: Path, counted: Path) -> None:
    src = tmp_path / "src"
    (src / "inc").mkdir(parents=True)
    (src / "inc" / "deep.h").write_text("inline int deep() { return 1; }\n")
    (src / "part.cpp").write_text('#include "inc/deep.h"\nint part() { return deep(); }\n')
    (src / "unit.cpp").write_text('#include "part.cpp"\nextern "C" int k() { return part(); }\n')
    first = native_build.build_shared(src / "unit.cpp", "a test kernel", "nothing")
    (src / "inc" / "deep.h").write_text("inline int deep() { return 2; }\n")
    second = native_build.build_shared(src / "unit.cpp", "a test kernel", "nothing")
    assert first is not None and second is not None and first != second
    assert ctypes.CDLL(str(first)).k() == 1 and ctypes.CDLL(str(second)).k() == 2


def test_a_failed_build_is_reported_and_leaves_nothing(
    tmp_path: Path, counted: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad = tmp_path / "bad.cpp"
    bad.write_text("this is not C++\n")
    assert native_build.build_shared(bad, "a broken kernel", "the fallback") is None
    assert "building a broken kernel failed" in caplog.text and "the fallback" in caplog.text
    assert not [p for p in native_build.cache_dir().rglob("*") if p.suffix in (".o", ".so")]


def test_switched_off_builds_nothing(
    tmp_path: Path, counted: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared, _ = _sources(tmp_path)
    monkeypatch.setenv(native_build.ENV, "0")
    assert native_build.build_shared(shared, "a test kernel", "nothing") is None
    assert _calls(counted, str(shared)) == 0


def test_prebuild_builds_what_the_loaders_load() -> None:
    """Each library the pre-build makes is the file its loader loads (the same sources and
    flags), so a pre-built machine's engine compiles nothing; built already here, it costs
    a hash of the sources."""
    import torch

    from pagemill.kernels import (
        attention_cpu,
        cpu_native,
        gemv_q4_cpu,
        gemv_q8_cpu,
        prebuild,
        sampler_cpu,
    )

    paths = prebuild.build_all()
    assert set(paths) == {name for name, _ in prebuild.builds()}
    assert all(p is not None for p in paths.values()), paths
    loaded = {
        "decode attention": cpu_native.load(),
        "int4 GEMV": gemv_q4_cpu.load(),
        "Q8_0 GEMV": gemv_q8_cpu.load(),
        "sampler": sampler_cpu.load(),
        "prefill attention": attention_cpu._prefill_lib(),
    }
    for name, lib in loaded.items():
        assert lib is not None and Path(lib._name) == paths[name], name
    assert cpu_native.load_gemv_ops() and cpu_native.load_attention_ops()
    loaded_ops = cpu_native._torch_ops_loaded
    assert loaded_ops is not None and loaded_ops.name == paths["torch operators"].name
    assert str(loaded_ops) in torch.ops.loaded_libraries


def test_the_operators_load_once_whatever_folder_is_asked_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both operator loaders share one library, loaded once per process: a second copy (the
    same build found in another cache folder) would define the operators again, which
    aborts the process."""
    from pagemill.kernels import cpu_native

    if not cpu_native.load_gemv_ops():
        pytest.skip("the torch operators cannot be built here")
    first = cpu_native._torch_ops_loaded
    monkeypatch.setenv(native_build.CACHE_ENV, str(tmp_path / "elsewhere"))
    assert cpu_native._load_torch_ops("nothing") and cpu_native._torch_ops_loaded == first
    assert not (tmp_path / "elsewhere").exists()  # not even built there


def test_the_build_process_touches_its_stamp_only_when_all_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagemill.kernels import prebuild

    stamp = tmp_path / "stamps" / "prebuilt-x"
    assert prebuild.main(["--stamp", str(stamp)]) == 0 and stamp.is_file()
    stamp.unlink()
    builds = prebuild.builds()
    monkeypatch.setattr(prebuild, "builds", lambda: [*builds, ("broken", lambda: None)])
    assert prebuild.main(["--stamp", str(stamp)]) == 1 and not stamp.exists()


def test_the_builds_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(native_build.CACHE_ENV, raising=False)
    monkeypatch.setenv("PAGEMILL_CACHE_DIR", str(tmp_path / "c"))
    assert native_build.cache_dir() == tmp_path / "c" / "kernels"
    monkeypatch.setenv(native_build.CACHE_ENV, str(tmp_path / "k"))
    assert native_build.cache_dir() == tmp_path / "k"  # its own folder wins
    monkeypatch.delenv(native_build.CACHE_ENV)
    monkeypatch.delenv("PAGEMILL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert native_build.cache_dir() == tmp_path / "x" / "pagemill" / "kernels"
