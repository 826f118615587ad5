"""The weight cache: a GGUF's packed weights saved at the first start, loaded at the next.

Each engine here is built in this process (the cache holds tensors, not compiled code);
the warm model must equal the cold one tensor for tensor and generate the same tokens.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagemill.runtime import LLM, SamplingParams
from pagemill.runtime.model_executor.weight_cache import WEIGHT_CACHE_ENV, weight_cache_enabled
from pagemill.runtime.worker.compilation import COMPILE_CACHE_ENV, model_signature

gguf = pytest.importorskip("gguf")


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 9, 2, 7], list(range(3, 40))]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PAGEMILL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(WEIGHT_CACHE_ENV, "1")


def _start(path: Path) -> tuple[torch.nn.Module, list[list[int]]]:
    llm = LLM(str(path), dtype="bfloat16", enforce_eager=True, kv_cache_memory_bytes=1 << 20)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    model = llm.llm_engine.engine_core.model_runner.model
    return model, [o.outputs[0].token_ids for o in outs]


def _entries(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "cache" / "weights").glob("*/model.safetensors"))


def _assert_same_model(a: torch.nn.Module, b: torch.nn.Module) -> None:
    assert model_signature(a) == model_signature(b)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_warm_start_restores_the_packed_model(q4_gguf, tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="pagemill.runtime.model_executor.loader")
    cold, cold_tokens = _start(q4_gguf)
    formats = {m.format for m in cold.modules() if hasattr(m, "int4_planes")}
    assert "int4" in formats  # the cache is about packed rows: the test must pack some
    assert len(_entries(tmp_path)) == 1
    assert "weight cache" not in caplog.text
    warm, warm_tokens = _start(q4_gguf)
    assert "loaded from the weight cache" in caplog.text
    _assert_same_model(cold, warm)
    assert warm_tokens == cold_tokens
    # Tied checkpoint tensors stay one tensor (the dense head and the embedding, ...).
    ptrs = [t.data_ptr() for t in warm.state_dict(keep_vars=True).values()]
    cold_ptrs = [t.data_ptr() for t in cold.state_dict(keep_vars=True).values()]
    assert len(set(ptrs)) == len(set(cold_ptrs))


def test_corrupt_entry_is_rebuilt(q4_gguf, tmp_path, caplog) -> None:
    cold, cold_tokens = _start(q4_gguf)
    (entry,) = _entries(tmp_path)
    entry.write_bytes(b"not safetensors")
    caplog.set_level(logging.WARNING)
    again, tokens = _start(q4_gguf)
    assert "cannot be used" in caplog.text
    assert tokens == cold_tokens
    _assert_same_model(cold, again)
    (rewritten,) = _entries(tmp_path)
    assert rewritten.stat().st_size > 1000  # saved again, whole


def test_a_changed_file_is_another_entry(q4_gguf, tmp_path) -> None:
    _start(q4_gguf)
    st = q4_gguf.stat()
    try:
        os.utime(q4_gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        _start(q4_gguf)
    finally:
        os.utime(q4_gguf, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert len(_entries(tmp_path)) == 2


def test_an_entry_laid_out_for_the_native_gemv_needs_it(q4_gguf, tmp_path, monkeypatch) -> None:
    """int4 rows packed for `gemv_q4` are served only where that kernel is: a start with it
    switched off (or unbuildable) must pack for PyTorch's kernel, not restore the tiles."""
    from pagemill.kernels import gemv_q4_cpu

    if not gemv_q4_cpu.available():
        pytest.skip("the native int4 GEMV is not built here")
    from pagemill.runtime.model_executor.layers import Linear

    monkeypatch.setattr(Linear, "int8_activations", 2)  # whatever the environment says
    cold, _ = _start(q4_gguf)
    assert any(getattr(m, "int8_act", 0) for m in cold.modules())
    monkeypatch.setattr(gemv_q4_cpu, "available", lambda: False)
    again, _ = _start(q4_gguf)
    assert not any(getattr(m, "int8_act", 0) for m in again.modules())
    assert len(_entries(tmp_path)) == 2


def test_old_entries_of_a_file_are_evicted(q4_gguf, tmp_path, monkeypatch) -> None:
    from pagemill.runtime.model_executor import weight_cache

    monkeypatch.setattr(weight_cache, "_KEEP_PER_FILE", 1)
    _start(q4_gguf)
    (first,) = _entries(tmp_path)
    monkeypatch.setattr(weight_cache, "_FORMAT", weight_cache._FORMAT + 1)  # a new key
    _start(q4_gguf)
    (second,) = _entries(tmp_path)
    assert second != first


def test_switch(monkeypatch, q4_gguf, tmp_path) -> None:
    monkeypatch.setenv(WEIGHT_CACHE_ENV, "0")
    assert not weight_cache_enabled()
    _start(q4_gguf)
    assert _entries(tmp_path) == []
    monkeypatch.delenv(WEIGHT_CACHE_ENV)
    monkeypatch.setenv(COMPILE_CACHE_ENV, "0")  # unset: it follows the compile cache
    assert not weight_cache_enabled()
    monkeypatch.setenv(COMPILE_CACHE_ENV, "1")
    assert weight_cache_enabled()
    monkeypatch.setenv(WEIGHT_CACHE_ENV, "off")
    with pytest.raises(ValueError, match=WEIGHT_CACHE_ENV):
        weight_cache_enabled()


_START = """
import json, logging, sys
logging.basicConfig(level=logging.INFO)
from pagemill.runtime import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="bfloat16", max_num_seqs=4, max_model_len=128,
          kv_cache_memory_bytes=16 * 16 * 512)
runner = llm.llm_engine.engine_core.model_runner
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
outs = llm.generate([[5, 6, 7, 8, 9], [10, 11], [3] * 20], params, use_tqdm=False)
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs],
                  "compiled": runner.compiled, "loaded": runner.compile_cache_loaded}))
"""


def _process_start(path: Path, cache: Path, weight_cache: str) -> tuple[dict, str]:
    env = dict(os.environ, PAGEMILL_CACHE_DIR=str(cache), **{COMPILE_CACHE_ENV: "1"})
    env[WEIGHT_CACHE_ENV] = weight_cache
    env.pop("PAGEMILL_ENFORCE_EAGER", None)
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    proc = subprocess.run(
        [sys.executable, "-c", _START, str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,  # a cold compile on a loaded 2-core box
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.slow  # three compiled starts in subprocesses, one cold
def test_warm_start_of_both_caches_matches_cold(q4_gguf, tmp_path) -> None:
    """The whole warm start (compiled graphs and packed weights from the caches) generates
    what the cold one did, and so does a start that packs the file again under the cached
    graph: the restored weights are the ones the graph was compiled for."""
    from pagemill.runtime.worker.compilation import compile_unavailable_reason

    reason = compile_unavailable_reason(torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)
    cache = tmp_path / "proc-cache"
    cold, cold_log = _process_start(q4_gguf, cache, "1")
    assert cold["compiled"] and not cold["loaded"]
    assert "loaded from the weight cache" not in cold_log
    warm, warm_log = _process_start(q4_gguf, cache, "1")
    assert warm["loaded"] and "loaded from the weight cache" in warm_log
    assert warm["tokens"] == cold["tokens"]
    packed, packed_log = _process_start(q4_gguf, cache, "0")
    assert packed["loaded"] and "loaded from the weight cache" not in packed_log
    assert packed["tokens"] == cold["tokens"]
