"""The CPU KV pool's pages are mapped at start (in the background), not by the first steps
that reach each block; `PAGEMILL_CPU_KV_PREFAULT` switches it. The pool asks for transparent
huge pages unless `PAGEMILL_CPU_KV_HUGEPAGES` is 0."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagemill.blockpool.host_memory import thp_policy
from pagemill.runtime.worker.kv_cache import KVCache

CONFIG = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2, head_dim=32)


def test_cpu_pool_is_prefaulted_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEMILL_CPU_KV_PREFAULT", raising=False)
    pool = KVCache(CONFIG, 64, 16, torch.bfloat16, torch.device("cpu"))
    assert pool.storage is not None
    pool.storage.wait_prefaulted()
    assert pool.storage.prefaulted
    # The torch views are the prefaulted arrays themselves (no copy was made).
    k = pool.caches[0][0]
    assert k.data_ptr() == pool.storage.k_caches[0].ctypes.data
    assert not k.any()


def test_prefault_can_wait_for_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    # The engine allocates the pool before loading its graphs and maps it once ready.
    monkeypatch.delenv("PAGEMILL_CPU_KV_PREFAULT", raising=False)
    pool = KVCache(CONFIG, 64, 16, torch.bfloat16, torch.device("cpu"), prefault=False)
    assert pool.storage is not None
    pool.storage.wait_prefaulted()
    assert not pool.storage.prefaulted
    pool.start_prefault()
    pool.storage.wait_prefaulted()
    assert pool.storage.prefaulted
    thread = pool.storage._prefault_thread
    pool.start_prefault()  # once only
    assert pool.storage._prefault_thread is thread


def test_deferred_prefault_still_checks_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEMILL_CPU_KV_PREFAULT", "yes")
    with pytest.raises(ValueError, match="PAGEMILL_CPU_KV_PREFAULT must be 0 or 1"):
        KVCache(CONFIG, 64, 16, torch.bfloat16, torch.device("cpu"), prefault=False)


def test_prefault_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEMILL_CPU_KV_PREFAULT", "0")
    pool = KVCache(CONFIG, 64, 16, torch.bfloat16, torch.device("cpu"))
    assert pool.storage is not None and not pool.storage.prefaulted
    pool.start_prefault()
    assert not pool.storage.prefaulted and pool.storage._prefault_thread is None


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_prefault_switch_refuses_other_values(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("PAGEMILL_CPU_KV_PREFAULT", value)
    with pytest.raises(ValueError, match="PAGEMILL_CPU_KV_PREFAULT must be 0 or 1"):
        KVCache(CONFIG, 64, 16, torch.bfloat16, torch.device("cpu"))


@pytest.mark.skipif(
    thp_policy() in (None, "never"), reason="no transparent huge pages on this kernel"
)
def test_cpu_pool_asks_for_huge_pages_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEMILL_CPU_KV_HUGEPAGES", raising=False)
    pool = KVCache(CONFIG, 64, 16, torch.bfloat16, torch.device("cpu"))
    assert pool.storage is not None and pool.storage.huge_pages


def test_huge_pages_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEMILL_CPU_KV_HUGEPAGES", "0")
    pool = KVCache(CONFIG, 64, 16, torch.bfloat16, torch.device("cpu"))
    assert pool.storage is not None and not pool.storage.huge_pages


@pytest.mark.parametrize("value", ["yes", "2", "true", "madvise"])
def test_huge_pages_switch_refuses_other_values(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("PAGEMILL_CPU_KV_HUGEPAGES", value)
    with pytest.raises(ValueError, match="PAGEMILL_CPU_KV_HUGEPAGES must be 0 or 1"):
        KVCache(CONFIG, 64, 16, torch.bfloat16, torch.device("cpu"))


def test_the_engine_maps_its_pool_only_while_idle(tiny_llama) -> None:
    """The engine's pool is mapped behind its `idle` flag: set from ready until a request
    arrives, clear for every step, set again once no request is left."""
    from pagemill.runtime import LLM, SamplingParams

    folder, _ = tiny_llama
    llm = LLM(
        str(folder),
        dtype="float32",
        max_model_len=128,
        kv_cache_memory_bytes=4 << 20,
        enforce_eager=True,
    )
    core = llm.llm_engine.engine_core
    assert core.idle.is_set()
    seen: list[bool] = []
    step = core._step

    def spy():
        seen.append(core.idle.is_set())
        return step()

    core._step = spy
    outs = llm.generate(["hello world"] * 2, SamplingParams(max_tokens=4), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    assert seen and not any(seen)
    assert core.idle.is_set()
    assert core.model_runner.kv_cache is not None
    storage = core.model_runner.kv_cache.storage
    assert storage is not None
    storage.wait_prefaulted()  # finishes: the engine is idle
    assert storage.prefaulted
