"""Fixtures for the kernel tests."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from pagemill.kernels import AttentionPlan, plan_attention
from pagemill.kernels._dispatch import interpreting
from pagemill.kernels.attention_triton import plan_triton


@pytest.fixture
def interpreter() -> None:
    """Triton-on-CPU tests need TRITON_INTERPRET=1 set before import (the root conftest sets
    it when no GPU is found); on a GPU box test_gpu.py runs the compiled kernels instead."""
    if not interpreting():
        pytest.skip("Triton kernels on CPU tensors need TRITON_INTERPRET=1")


@pytest.fixture
def tiled_triton_plan() -> Callable[..., AttentionPlan]:
    """A Triton plan whose launch uses explicit tile sizes / context splits, so small test
    shapes still cover many tiles, tiles straddling pages and split contexts."""

    def make(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        **tiles: int,
    ) -> AttentionPlan:
        plan = plan_attention(
            query_start_loc,
            seq_lens,
            block_tables,
            k_cache_shape=tuple(k_cache.shape),
            num_heads=q.shape[1],
            dtype=q.dtype,
            backend="triton",
        )
        impl = plan_triton(
            plan.num_tokens,
            plan.num_seqs,
            block_tables.shape[1],
            plan.k_cache_shape,
            q.shape[1],
            q.dtype,
            q.device,
            **tiles,
        )
        return dataclasses.replace(plan, impl=impl)

    return make
