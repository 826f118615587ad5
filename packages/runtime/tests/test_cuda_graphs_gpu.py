"""CUDA graphs for decode on a real GPU: the same greedy tokens as eager (skipped without CUDA).

Batches of 3, 5 and 17 requests land in buckets of 4, 8 and 32, so every graph step has
padded rows; small token budgets chunk the prompts, so prefill and mixed steps (eager)
interleave with graph-replayed decode steps. fp32 with the tiny model's well-separated
logits: equality tests the graphs, not rounding between GEMM shapes.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from pagemill.runtime import LLM
from pagemill.runtime.compilation import ENFORCE_EAGER_ENV
from pagemill.runtime.config import ModelConfig
from pagemill.runtime.loader import load_model
from pagemill.runtime.model_runner import ModelRunner
from pagemill.runtime.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        reason="needs a CUDA device and compiled (not interpreted) Triton",
    ),
]


def _generate(folder, prompts, *, enforce_eager: bool, monkeypatch) -> tuple[list[list[int]], int]:
    """Greedy tokens per prompt, and how many steps replayed a graph."""
    # The root conftest makes eager the default for the suite; this engine chooses itself.
    monkeypatch.delenv(ENFORCE_EAGER_ENV, raising=False)
    llm = LLM(str(folder), device="cuda", dtype="float32", enforce_eager=enforce_eager,
              max_num_seqs=32, max_num_batched_tokens=64, max_model_len=128,
              kv_cache_memory_bytes=64 << 20)
    runner = llm.llm_engine.engine_core.model_runner
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    graphs = runner.graphs
    if enforce_eager:
        assert graphs is None
    else:
        assert graphs is not None and graphs.buckets == [1, 2, 4, 8, 16, 32]
    replays = 0 if graphs is None else graphs.replays
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    del llm, runner, graphs
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, replays


@pytest.mark.parametrize("num_requests", [3, 5, 17])
def test_graphs_and_eager_give_identical_tokens(tiny_llama, random_prompts, monkeypatch,
                                                num_requests) -> None:
    folder, model = tiny_llama
    lengths = [3 + (7 * i) % 40 for i in range(num_requests)]
    prompts = random_prompts(lengths, model.config.vocab_size, seed=num_requests)
    eager, none = _generate(folder, prompts, enforce_eager=True, monkeypatch=monkeypatch)
    graphs, replays = _generate(folder, prompts, enforce_eager=False, monkeypatch=monkeypatch)
    assert none == 0 and replays > 0
    assert graphs == eager


def test_graph_memory_is_measured_and_released(tiny_llama) -> None:
    folder, _ = tiny_llama
    config = ModelConfig.from_pretrained(folder)
    device = torch.device("cuda")
    model = load_model(folder, config, torch.float32, device, max_position=128)
    runner = ModelRunner(model, config, device, torch.float32, 16, 8, 64, 128)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    graph_bytes = runner.measure_cuda_graph_memory()
    assert graph_bytes > 0
    assert runner.graphs is None
    assert torch.cuda.memory_allocated() <= before  # the trial graphs are gone
    runner.init_kv_cache(32)
    seconds = runner.capture_cuda_graphs()
    assert seconds > 0 and runner.graphs is not None
    assert sorted(runner.graphs.graphs) == [1, 2, 4, 8]
