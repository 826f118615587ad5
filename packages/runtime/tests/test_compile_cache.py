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
    compile_cache_enabled,
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


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.model_runner


def _key(llm: LLM) -> str:
    runner = _runner(llm)
    return compile_cache_key(runner.model, runner.compile_settings())[0]


def _parts(llm: LLM) -> dict:
    runner = _runner(llm)
    return compile_cache_key(runner.model, runner.compile_settings())[1]


def test_on_by_default_and_off_with_0(monkeypatch) -> None:
    monkeypatch.delenv(COMPILE_CACHE_ENV, raising=False)
    assert compile_cache_enabled()
    monkeypatch.setenv(COMPILE_CACHE_ENV, "1")
    assert compile_cache_enabled()
    monkeypatch.setenv(COMPILE_CACHE_ENV, "0")
    assert not compile_cache_enabled()
    monkeypatch.setenv(COMPILE_CACHE_ENV, "off")  # refused, not read as "on"
    with pytest.raises(ValueError, match=COMPILE_CACHE_ENV):
        compile_cache_enabled()


def test_the_test_suite_keeps_out_of_the_users_cache() -> None:
    # The conftests set it as an env var, so engine processes spawned by tests inherit it.
    assert os.environ.get(COMPILE_CACHE_ENV) == "0"


def test_key_changes_with_what_enters_the_graph(tiny_llama) -> None:
    folder, _ = tiny_llama
    base = _key(_eager(folder, dtype="float32", max_num_seqs=4))
    assert _key(_eager(folder, dtype="float32", max_num_seqs=4)) == base  # stable
    assert _key(_eager(folder, dtype="float32", max_num_seqs=5)) != base
    assert _key(_eager(folder, dtype="bfloat16", max_num_seqs=4)) != base
    assert _key(_eager(folder, dtype="float32", max_num_seqs=4, quantization="int8")) != base
    assert _key(_eager(folder, dtype="float32", max_num_seqs=4, kv_cache_dtype="fp8")) != base


def test_key_changes_with_lora_slots(tiny_llama) -> None:
    folder, _ = tiny_llama
    lora = dict(dtype="float32", max_num_seqs=4, enable_lora=True)
    base = _key(_eager(folder, dtype="float32", max_num_seqs=4))
    on = _key(_eager(folder, max_loras=2, max_lora_rank=8, **lora))
    assert on != base  # the add_lora op is in the graph
    assert _key(_eager(folder, max_loras=2, max_lora_rank=8, **lora)) == on
    # The slot stacks are [max_loras, rank, in] tensors on each Linear's LoRA object.
    assert _key(_eager(folder, max_loras=3, max_lora_rank=8, **lora)) != on
    assert _key(_eager(folder, max_loras=2, max_lora_rank=16, **lora)) != on
    # Adapters held on the host only: no tensor of the graph changes.
    assert _key(_eager(folder, max_loras=2, max_lora_rank=8, max_cpu_loras=5, **lora)) == on


def test_key_changes_with_hybrid_kv_groups(tmp_path, build_tiny_model) -> None:
    folder = tmp_path / "gemma2"
    build_tiny_model(
        folder,
        "gemma2",
        num_hidden_layers=4,
        head_dim=16,
        sliding_window=10,
        query_pre_attn_scalar=24,
        tie_word_embeddings=True,
    )
    kw = dict(dtype="float32", kv_cache_memory_bytes=4 << 20, max_model_len=256, block_size=4)
    groups = LLM(str(folder), enforce_eager=True, **kw)
    one_table = LLM(str(folder), enforce_eager=True, sliding_window_free_blocks=False, **kw)
    assert _runner(groups).kv_cache_groups is not None
    assert _runner(one_table).kv_cache_groups is None
    a, b = _parts(groups), _parts(one_table)
    assert a["settings"]["kv_cache_groups"] != b["settings"]["kv_cache_groups"]
    assert _key(groups) != _key(one_table)


def test_key_changes_with_packed_limits_and_graph_sizes(tiny_llama, monkeypatch) -> None:
    folder, _ = tiny_llama
    # Dense copies asked for: `auto` keeps none where bf16 GEMMs are emulated (no switch).
    llm = _eager(folder, dtype="bfloat16", quantization="int4", cpu_dense_weights="always")
    runner = _runner(llm)
    base = _key(llm)
    packed = [m for m in runner.model.modules() if getattr(m, "packed_max_tokens", None)]
    assert packed, "int4 layers with a packed/dense switch"
    counts = runner.graph_token_counts()
    for m in packed:  # a limit measured on another machine (crossover.py)
        m.packed_max_tokens += 8
    assert _key(llm) != base
    assert runner.graph_token_counts() != counts  # one graph per side of each switch
    for m in packed:
        m.packed_max_tokens -= 8
    assert _key(llm) == base
    monkeypatch.setattr(runner, "graph_token_counts", lambda: [1, 2, 3])
    assert _key(llm) != base


def test_key_changes_with_tensor_parallel_size(tiny_llama, monkeypatch) -> None:
    # A tensor-parallel rank runs eagerly today; its size is in the key for when it does not
    # (its shard's shapes are in the model's signature already).
    from types import SimpleNamespace

    folder, _ = tiny_llama
    llm = _eager(folder, dtype="float32")
    base = _key(llm)
    monkeypatch.setattr(_runner(llm), "tp", SimpleNamespace(world_size=2, rank=0))
    assert _key(llm) != base


def test_key_changes_with_the_wrapper_and_float_settings(tiny_llama, monkeypatch) -> None:
    # A graph with a C++ wrapper, or with floats traced as inputs, is another graph: a start
    # with other settings must not load it.
    from pagemill.runtime.worker import compilation

    folder, _ = tiny_llama
    llm = _eager(folder, dtype="float32")
    monkeypatch.delenv(compilation.CPP_WRAPPER_ENV, raising=False)
    base = _key(llm)
    monkeypatch.setenv(compilation.CPP_WRAPPER_ENV, "1")  # the default
    assert _key(llm) == base
    keys = {base}
    for mode in ("0", "single"):
        monkeypatch.setenv(compilation.CPP_WRAPPER_ENV, mode)
        keys.add(_key(llm))
    monkeypatch.delenv(compilation.CPP_WRAPPER_ENV)
    monkeypatch.setattr(compilation, "CPP_WRAPPER_BUILD_SEPARATE", False)
    keys.add(_key(llm))
    monkeypatch.setattr(compilation, "CPP_WRAPPER_BUILD_SEPARATE", True)
    monkeypatch.setattr(compilation, "SPECIALIZE_FLOATS", False)
    keys.add(_key(llm))
    assert len(keys) == 5


def test_key_ignores_what_stays_out_of_the_graph(tiny_llama) -> None:
    folder, _ = tiny_llama
    base = _key(_eager(folder, dtype="float32", max_num_seqs=4))
    for other in (
        dict(seed=7),
        dict(enable_prefix_caching=False),
        # A verify step is a multi-token step through the same dynamic-shape graph (the
        # logits rows are picked outside it) and the draft proposer runs eagerly.
        dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
        dict(speculative_config={"method": "ngram", "num_speculative_tokens": 5}),
    ):
        assert _key(_eager(folder, dtype="float32", max_num_seqs=4, **other)) == base, other


def test_key_sees_class_wide_switches(tiny_llama, monkeypatch) -> None:
    from pagemill.runtime.model_executor.layers import Linear

    folder, _ = tiny_llama
    llm = _eager(folder, dtype="float32")
    base = _key(llm)
    monkeypatch.setattr(Linear, "compiled_branch", "cond")  # one graph with torch.cond
    assert _key(llm) != base
    monkeypatch.undo()
    assert _key(llm) == base
    monkeypatch.setattr(Linear, "opaque_packed", not Linear.opaque_packed)
    assert _key(llm) != base


def test_key_sees_moe_class_switches(tmp_path, build_tiny_model, monkeypatch) -> None:
    from pagemill.runtime.model_executor.layers.fused_moe import FusedMoE

    folder = tmp_path / "moe"
    build_tiny_model(folder, "qwen3_moe")
    llm = _eager(folder, dtype="float32")
    base = _key(llm)
    monkeypatch.setattr(FusedMoE, "pack_gguf_experts", not FusedMoE.pack_gguf_experts)
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


_SAMPLER = """
import json, torch
from pathlib import Path
from pagemill.runtime.sample import row_kernels
from pagemill.runtime.sample.sampler import Sampler
from pagemill.runtime.worker.compilation import compile_cached
sampler = Sampler(seed=0)
_, loaded = compile_cached("sampler row kernels", {"vocab": 64}, [Path(row_kernels.__file__)],
                           lambda: sampler.compile(64, "cpu", (torch.float32,)))
print(json.dumps({"loaded": loaded, "compiled": sampler.compiled}))
"""


@pytest.mark.slow  # two small compiles in subprocesses
def test_sampler_kernels_load_from_the_cache(tmp_path) -> None:
    if compile_unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip(compile_unavailable_reason(torch.device("cpu")))
    env = dict(os.environ, PAGEMILL_CACHE_DIR=str(tmp_path), **{COMPILE_CACHE_ENV: "1"})
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    env["PAGEMILL_NATIVE_CPU_KERNELS"] = "0"  # the graphs serve where the native code cannot

    def start() -> dict:
        proc = subprocess.run(
            [sys.executable, "-c", _SAMPLER], env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    assert start() == {"loaded": False, "compiled": True}
    assert start() == {"loaded": True, "compiled": True}
