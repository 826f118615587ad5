"""The compile cache: a warm start loads the compiled forward instead of tracing it.

Each start runs in a fresh subprocess (a warm start in the same process would find dynamo's
in-memory state), with its own cache folder. The key tests are fast (eager engines, no
compile); the starts are `slow` (a tiny model's cold compile is ~20 s on two shared cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagemill.runtime import LLM
from pagemill.runtime.worker.compilation import (
    COMPILE_CACHE_ENV,
    ENFORCE_EAGER_ENV,
    compile_cache_key,
    compile_unavailable_reason,
    model_signature,
)

_START = """
import json, sys
from pagemill.runtime import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", max_num_seqs=int(sys.argv[2]), max_model_len=128,
          kv_cache_memory_bytes=16 * 16 * 512)
runner = llm.llm_engine.engine_core.model_runner
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
outs = llm.generate([[5, 6, 7, 8, 9], [10, 11], [3] * 20], params, use_tqdm=False)
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs],
                  "compiled": runner.compiled, "loaded": runner.compile_cache_loaded,
                  "folder": str(runner.compile_cache.folder)}))
"""


def _start(folder: Path, cache: Path, max_num_seqs: int = 4) -> tuple[dict, str]:
    env = dict(os.environ, PAGEMILL_CACHE_DIR=str(cache), **{COMPILE_CACHE_ENV: "1"})
    env.pop(ENFORCE_EAGER_ENV, None)
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    proc = subprocess.run(
        [sys.executable, "-c", _START, str(folder), str(max_num_seqs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _eager(folder: Path, **kwargs) -> LLM:
    return LLM(
        str(folder),
        enforce_eager=True,
        kv_cache_memory_bytes=16 * 16 * 512,
        max_model_len=128,
        **kwargs,
    )


def _key(llm: LLM) -> str:
    runner = llm.llm_engine.engine_core.model_runner
    return compile_cache_key(runner.model, runner.compile_settings())[0]


def test_key_changes_with_what_enters_the_graph(tiny_llama) -> None:
    folder, _ = tiny_llama
    base = _key(_eager(folder, dtype="float32", max_num_seqs=4))
    assert _key(_eager(folder, dtype="float32", max_num_seqs=4)) == base  # stable
    assert _key(_eager(folder, dtype="float32", max_num_seqs=5)) != base
    assert _key(_eager(folder, dtype="bfloat16", max_num_seqs=4)) != base
    assert _key(_eager(folder, dtype="float32", max_num_seqs=4, quantization="int8")) != base
    assert _key(_eager(folder, dtype="float32", max_num_seqs=4, kv_cache_dtype="fp8")) != base


def test_key_sees_class_wide_switches(tiny_llama, monkeypatch) -> None:
    from pagemill.runtime.model_executor.layers import Linear

    folder, _ = tiny_llama
    llm = _eager(folder, dtype="float32")
    base = _key(llm)
    monkeypatch.setattr(Linear, "compiled_branch", "cond")  # one graph with torch.cond
    assert _key(llm) != base


def test_signature_sees_formats_not_values(tiny_llama) -> None:
    folder, _ = tiny_llama
    llm = _eager(folder, dtype="float32")
    model = llm.llm_engine.engine_core.model_runner.model
    before = json.dumps(model_signature(model))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # other weights of the same shapes: the same graph
    assert json.dumps(model_signature(model)) == before
    model.layers[0].self_attn.o_proj.packed_max_tokens = 12345  # a branch moved: not the same
    assert json.dumps(model_signature(model)) != before


@pytest.mark.slow  # five starts, three cold: ~2-3 min on two quiet shared cores
def test_warm_start_loads_and_matches_cold(tiny_llama, tmp_path) -> None:
    if compile_unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip(compile_unavailable_reason(torch.device("cpu")))
    folder, _ = tiny_llama
    cold, _ = _start(folder, tmp_path)
    assert cold["compiled"] and not cold["loaded"]
    warm, _ = _start(folder, tmp_path)
    assert warm["loaded"] and warm["tokens"] == cold["tokens"]
    assert warm["folder"] == cold["folder"]

    # A corrupt entry (garbage, or cut short as by a full disk or a killed writer) is
    # logged, compiled again and rewritten; never fatal.
    for corrupt in (lambda data: b"not a pickle", lambda data: data[: len(data) // 2]):
        entries = list(Path(cold["folder"], "dynamo").rglob("entry"))
        assert entries
        for entry in entries:
            entry.write_bytes(corrupt(entry.read_bytes()))
        rebuilt, log = _start(folder, tmp_path)
        assert not rebuilt["loaded"] and rebuilt["tokens"] == cold["tokens"]
        assert "failed to load" in log or "broke the compilation" in log
    again, _ = _start(folder, tmp_path)
    assert again["loaded"] and again["tokens"] == cold["tokens"]


@pytest.mark.slow  # two cold starts
def test_changed_key_compiles_again(tiny_llama, tmp_path) -> None:
    if compile_unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip(compile_unavailable_reason(torch.device("cpu")))
    folder, _ = tiny_llama
    first, _ = _start(folder, tmp_path, max_num_seqs=4)
    other, _ = _start(folder, tmp_path, max_num_seqs=3)
    assert not other["loaded"] and other["folder"] != first["folder"]
    assert other["tokens"] == first["tokens"]
