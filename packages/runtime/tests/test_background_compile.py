"""A cold start (no compile-cache entry) serves eagerly at once while the forward compiles on
a background thread, and switches to the compiled forward between steps.

The fast tests hold or break the compile (`compile_forward` replaced in the model runner),
so what they check does not depend on how long a compile takes: the engine is ready and
serving while the compile is held, the warm-up writes only its own blocks, a compile that
raises leaves the engine eager. The real compile runs in a subprocess (a fresh dynamo) and
is `slow`: requests in flight across the switch give transformers' greedy tokens, and the
next start loads what the background compile saved.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from pagemill.blockpool import KVStorage
from pagemill.runtime import LLM, SamplingParams
from pagemill.runtime.engine.core import COMPILE_BACKGROUND_ENV
from pagemill.runtime.worker import model_runner as model_runner_module
from pagemill.runtime.worker.compilation import (
    COMPILE_CACHE_ENV,
    ENFORCE_EAGER_ENV,
    compile_unavailable_reason,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# 16 blocks of 16 tokens for the tiny model; max_model_len 128 needs 8 of them.
ENGINE = dict(
    dtype="float32", max_num_seqs=4, max_model_len=128, kv_cache_memory_bytes=16 * 16 * 512
)


@pytest.fixture(autouse=True)
def _needs_compile() -> None:
    reason = compile_unavailable_reason(torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)


def _cold_env(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    """The compile cache on, in an empty folder of its own, and the background compile on."""
    monkeypatch.setenv(COMPILE_CACHE_ENV, "1")
    monkeypatch.setenv("PAGEMILL_CACHE_DIR", str(cache))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
    monkeypatch.delenv(COMPILE_BACKGROUND_ENV, raising=False)
    monkeypatch.delenv(ENFORCE_EAGER_ENV, raising=False)


def _kv(llm: LLM) -> list[torch.Tensor]:
    runner = llm.llm_engine.engine_core.model_runner
    assert runner.kv_cache is not None
    return [t.clone() for pair in runner.kv_cache.caches for t in pair]


@pytest.mark.slow  # no real compile, but three engine phases and HF's greedy: ~2 min loaded
def test_ready_and_serving_while_the_compile_runs_and_live_blocks_kept(
    tiny_llama, tmp_path, monkeypatch, hf_greedy, random_prompts
) -> None:
    folder, model = tiny_llama
    _cold_env(monkeypatch, tmp_path)
    release, entered = threading.Event(), threading.Event()

    def held_compile(m: torch.nn.Module, freezing: bool = True, regional: Any = None) -> Any:
        entered.set()
        assert release.wait(120)
        return m.forward  # the warm-up then runs the eager forward: it still writes KV

    monkeypatch.setattr(model_runner_module, "compile_forward", held_compile)
    llm = LLM(str(folder), **ENGINE)
    core = llm.llm_engine.engine_core
    runner = core.model_runner
    job = runner.background
    assert job is not None and entered.wait(60)
    # A graph per prefill-like step size, and per decode-only size with the C++ decode op.
    total = len(runner.graph_token_counts()) + len(runner.decode_graph_token_counts())
    assert job.total == total and core.get_stats().compile_graphs_pending == total
    # The warm-up's blocks are the pool's last, kept from the scheduler.
    assert runner.kv_cache is not None
    assert runner.kv_cache.num_blocks == core.num_blocks + runner.warm_up_blocks()

    vocab = model.config.vocab_size
    prompts = random_prompts([5, 17, 40], vocab, seed=3)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, 12) for p in prompts]
    assert not runner.compiled and job.pending == total  # served while the compile was held

    # Finished requests leave their blocks' KV in the pool (prefix cache): the warm-up
    # must not touch them, and must write its own.
    live = core.num_blocks
    before = _kv(llm)
    release.set()
    assert core.wait_for_compile(120)
    after = _kv(llm)
    for b, a in zip(before, after):
        assert torch.equal(b[:live], a[:live])
    assert any(not torch.equal(b[live:], a[live:]) for b, a in zip(before, after))
    assert core.get_stats().compile_graphs_pending == 0

    more = random_prompts([9, 3], vocab, seed=4) + prompts[:1]  # the last one hits the cache
    outs = llm.generate(more, GREEDY, use_tqdm=False)
    assert runner.compiled  # switched at the first step after the compile
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, 12) for p in more]


def test_a_failed_background_compile_leaves_the_engine_eager(
    tiny_llama, tmp_path, monkeypatch, hf_greedy, random_prompts, caplog
) -> None:
    folder, model = tiny_llama
    _cold_env(monkeypatch, tmp_path)

    def broken_compile(m: torch.nn.Module, freezing: bool = True, regional: Any = None) -> Any:
        raise RuntimeError("inductor fell over")

    monkeypatch.setattr(model_runner_module, "compile_forward", broken_compile)
    with caplog.at_level(logging.WARNING):
        llm = LLM(str(folder), **ENGINE)
        core = llm.llm_engine.engine_core
        assert not core.wait_for_compile(60)  # ended, and failed
    failures = [r for r in caplog.records if "background compile failed" in r.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info is not None
    prompts = random_prompts([6, 20], model.config.vocab_size, seed=5)
    for _ in range(2):  # every step after the failure too
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, 12) for p in prompts]
    runner = core.model_runner
    assert not runner.compiled and runner._forward == runner.model.forward
    assert core.get_stats().compile_graphs_pending == 0
    # Nothing was saved: the next start is cold again.
    assert runner.compile_cache is not None
    assert not (runner.compile_cache.folder / "dynamo").exists()


def test_blocking_when_switched_off(tiny_llama, tmp_path, monkeypatch) -> None:
    folder, _ = tiny_llama
    _cold_env(monkeypatch, tmp_path)
    calls: list[str] = []

    def no_compile(m: torch.nn.Module, freezing: bool = True, regional: Any = None) -> Any:
        calls.append(threading.current_thread().name)
        return m.forward

    monkeypatch.setattr(model_runner_module, "compile_forward", no_compile)
    llm = LLM(str(folder), compile_in_background=False, **ENGINE)
    runner = llm.llm_engine.engine_core.model_runner
    assert runner.background is None and runner.compiled
    monkeypatch.setenv(COMPILE_BACKGROUND_ENV, "0")
    monkeypatch.setenv("PAGEMILL_CACHE_DIR", str(tmp_path / "other"))
    runner = LLM(str(folder), **ENGINE).llm_engine.engine_core.model_runner
    assert runner.background is None and runner.compiled
    assert calls == [threading.main_thread().name] * 2  # compiled before ready, here


@pytest.mark.parametrize("background", [False, True])
def test_the_warm_up_writes_only_blocks_kept_off_huge_pages(
    tiny_llama, tmp_path, monkeypatch, background: bool
) -> None:
    """The warm-up's blocks are put on 4 KB pages before it writes them (a huge page's first
    touch cost a warm start ~1 s in a small VM), and it writes no other block: before ready
    (from block 0) and in the background (the pool's last blocks)."""
    folder, _ = tiny_llama
    _cold_env(monkeypatch, tmp_path)
    if not background:
        monkeypatch.setenv(COMPILE_BACKGROUND_ENV, "0")
    calls: list[tuple[int, int, bool]] = []
    keep = KVStorage.keep_small_pages

    def spy(self: KVStorage, first_block: int, num_blocks: int) -> bool:
        untouched = all(
            not a[first_block : first_block + num_blocks].any()
            for a in self.k_caches + self.v_caches
        )
        calls.append((first_block, num_blocks, untouched))
        return keep(self, first_block, num_blocks)

    monkeypatch.setattr(KVStorage, "keep_small_pages", spy)
    monkeypatch.setattr(
        model_runner_module,
        "compile_forward",
        lambda m, freezing=True, regional=None: m.forward,
    )
    llm = LLM(str(folder), **ENGINE)
    core = llm.llm_engine.engine_core
    runner = core.model_runner
    assert (runner.background is not None) == background
    if background:
        assert core.wait_for_compile(120)
    first = core.num_blocks if background else 0
    count = runner.warm_up_blocks()
    assert calls == [(first, count, True)]
    written = {b for t in _kv(llm) for b in range(t.shape[0]) if bool(t[b].ne(0).any())}
    assert written and written <= set(range(first, first + count))


_START = """
import json, sys
from pagemill.runtime import LLM, SamplingParams
from pagemill.runtime.sampling_params import RequestOutputKind
llm = LLM(sys.argv[1], dtype="float32", max_num_seqs=4, max_model_len=128,
          kv_cache_memory_bytes=16 * 16 * 512)
engine = llm.llm_engine
core = engine.engine_core
runner = core.model_runner
prompts = json.loads(sys.argv[2])
params = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[3]), ignore_eos=True,
                        output_kind=RequestOutputKind.FINAL_ONLY)
for i, p in enumerate(prompts):
    engine.add_request(str(i), p, params)
tokens, compiled_steps = {}, 0
def step():
    global compiled_steps
    for out in engine.step():
        if out.finished:
            tokens[out.request_id] = list(out.outputs[0].token_ids)
    compiled_steps += runner.compiled
for _ in range(3):
    step()
pending = core.get_stats().compile_graphs_pending
core.wait_for_compile(900)  # the requests wait mid-generation: the switch comes between steps
while engine.has_unfinished_requests():
    step()
print(json.dumps({"background": runner.background is not None, "pending_early": pending,
                  "compiled": runner.compiled, "loaded": runner.compile_cache_loaded,
                  "compiled_steps": compiled_steps,
                  "tokens": [tokens[str(i)] for i in range(len(prompts))]}))
"""


def _start(folder: Path, cache: Path, prompts: list[list[int]], max_tokens: int) -> dict:
    env = dict(os.environ, PAGEMILL_CACHE_DIR=str(cache), **{COMPILE_CACHE_ENV: "1"})
    for name in (ENFORCE_EAGER_ENV, COMPILE_BACKGROUND_ENV, "TORCHINDUCTOR_CACHE_DIR"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-c", _START, str(folder), json.dumps(prompts), str(max_tokens)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a cold compile in the background, then a warm start: ~1-2 min loaded
def test_switch_mid_request_keeps_greedy_tokens_and_fills_the_cache(
    tiny_llama, tmp_path, hf_greedy, random_prompts
) -> None:
    folder, model = tiny_llama
    prompts = random_prompts([4, 11, 23], model.config.vocab_size, seed=6)
    expected = [hf_greedy(model, p, 16) for p in prompts]
    cold = _start(folder, tmp_path, prompts, 16)
    assert cold["background"] and cold["pending_early"] > 0  # 3 steps served eagerly
    assert cold["compiled"] and not cold["loaded"]
    assert 0 < cold["compiled_steps"] < 16  # the requests finished on the compiled forward
    assert cold["tokens"] == expected
    warm = _start(folder, tmp_path, prompts, 16)  # the entry the background compile saved
    assert not warm["background"] and warm["compiled"] and warm["loaded"]
    assert warm["tokens"] == expected


def test_shutdown_stops_a_running_background_compile(tiny_llama, tmp_path, monkeypatch) -> None:
    """A compile still running at shutdown (or at exit: the same `cancel`, from atexit) is
    stopped between graphs and its thread joined: a daemon thread left inside torch's C++
    when Python finalizes aborts the process (exit status 134)."""
    folder, _ = tiny_llama
    _cold_env(monkeypatch, tmp_path)
    release, entered = threading.Event(), threading.Event()

    def held_compile(m: torch.nn.Module, freezing: bool = True, regional: Any = None) -> Any:
        entered.set()
        assert release.wait(120)
        return m.forward

    monkeypatch.setattr(model_runner_module, "compile_forward", held_compile)
    llm = LLM(str(folder), **ENGINE)
    core = llm.llm_engine.engine_core
    job = core.model_runner.background
    assert job is not None and entered.wait(60)
    assert job in model_runner_module._RUNNING_COMPILES
    timer = threading.Timer(0.5, release.set)  # the graph in progress ends after shutdown asks
    timer.start()
    core.shutdown()
    assert job.cancelled and job.thread is not None and not job.thread.is_alive()
    assert job.forward is None and not job.failed and job.done == 0  # no graph after the ask
    model_runner_module._cancel_background_compiles()  # at exit: nothing left to wait for
