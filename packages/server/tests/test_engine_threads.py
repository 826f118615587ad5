"""How many torch threads a served CPU engine gets, and the OpenMP spin its process starts with."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from pagemill.runtime.engine import core_client as engine_process
from pagemill.runtime.engine.core_client import (
    ENGINE_GOMP_SPINCOUNT,
    _engine_environment,
    default_engine_threads,
)

CPU = SimpleNamespace(resolve_device=lambda: "cpu")
CUDA = SimpleNamespace(resolve_device=lambda: "cuda")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("OMP_NUM_THREADS", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(
        engine_process.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False
    )
    return monkeypatch


def test_every_core_in_an_engine_process_one_left_in_the_server(clean_env) -> None:
    assert default_engine_threads(CPU) == 4
    assert default_engine_threads(CPU, own_process=False) == 3
    assert default_engine_threads(CUDA) is None
    clean_env.setenv("OMP_NUM_THREADS", "2")
    assert default_engine_threads(CPU) is None  # the user's choice stands


def test_the_engine_process_starts_with_a_bounded_spin(clean_env) -> None:
    with _engine_environment():
        assert os.environ["GOMP_SPINCOUNT"] == ENGINE_GOMP_SPINCOUNT
    assert "GOMP_SPINCOUNT" not in os.environ  # the server process is left as it was


@pytest.mark.parametrize("name", ["GOMP_SPINCOUNT", "OMP_WAIT_POLICY"])
def test_a_users_openmp_setting_is_kept(clean_env, name: str) -> None:
    clean_env.setenv(name, "PASSIVE" if name == "OMP_WAIT_POLICY" else "123")
    with _engine_environment():
        assert os.environ.get("GOMP_SPINCOUNT") == (None if name == "OMP_WAIT_POLICY" else "123")
