"""Fixtures for the kernel tests."""

from __future__ import annotations

import pytest

from pagemill.kernels._dispatch import interpreting


@pytest.fixture
def interpreter() -> None:
    """Triton-on-CPU tests need TRITON_INTERPRET=1 set before import (the root conftest sets
    it when no GPU is found); on a GPU box test_gpu.py runs the compiled kernels instead."""
    if not interpreting():
        pytest.skip("Triton kernels on CPU tensors need TRITON_INTERPRET=1")
