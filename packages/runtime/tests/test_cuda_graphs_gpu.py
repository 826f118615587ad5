"""CUDA graphs for decode on a real GPU: the same greedy tokens as eager (skipped without CUDA).

Batches of 3, 5 and 17 requests land in buckets of 4, 8 and 32, so their decode steps
have padded rows; a small token budget chunks the prompts, so prefill and mixed steps
(eager) interleave with graph-replayed decode steps. fp32 with the tiny model's
well-separated logits: equality tests the graphs, not rounding between GEMM shapes.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from pagemill.runtime import LLM
from pagemill.runtime.config import ModelConfig
from pagemill.runtime.model_executor.loader import load_model
from pagemill.runtime.sampling_params import SamplingParams
from pagemill.runtime.worker.compilation import ENFORCE_EAGER_ENV
from pagemill.runtime.worker.model_runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        reason="needs a CUDA device and compiled (not interpreted) Triton",
    ),
]


@pytest.fixture(scope="module")
def engines(tiny_llama):
    """An eager engine and a graphs engine on the tiny model (two engines for all sizes:
    each start compiles Triton kernels and captures the buckets)."""
    folder, _ = tiny_llama
    built = {}
    with pytest.MonkeyPatch.context() as mp:
        # The root conftest makes eager the default for the suite; these engines choose.
        mp.delenv(ENFORCE_EAGER_ENV, raising=False)
        for eager in (True, False):
            built[eager] = LLM(
                str(folder),
                device="cuda",
                dtype="float32",
                enforce_eager=eager,
                max_num_seqs=32,
                max_num_batched_tokens=64,
                max_model_len=128,
                kv_cache_memory_bytes=64 << 20,
            )
    yield built
    built.clear()
    gc.collect()
    torch.cuda.empty_cache()


def _runner(llm):
    return llm.llm_engine.engine_core.model_runner


def _greedy(llm, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_enforce_eager_builds_no_graphs_and_the_default_does(engines) -> None:
    assert _runner(engines[True]).graphs is None
    graphs = _runner(engines[False]).graphs
    assert graphs is not None and graphs.buckets == [1, 2, 4, 8, 16, 32]
    assert sorted(graphs.graphs) == graphs.buckets


@pytest.mark.parametrize("num_requests", [3, 5, 17])
def test_graphs_and_eager_give_identical_tokens(
    engines, tiny_llama, random_prompts, num_requests
) -> None:
    _, model = tiny_llama
    lengths = [3 + (7 * i) % 40 for i in range(num_requests)]
    prompts = random_prompts(lengths, model.config.vocab_size, seed=num_requests)
    graphs = _runner(engines[False]).graphs
    assert graphs is not None
    replays = graphs.replays
    eager = _greedy(engines[True], prompts)
    assert _greedy(engines[False], prompts) == eager
    assert graphs.replays > replays  # decode steps of num_requests rows replayed a padded bucket


def test_graph_memory_is_measured_and_released(tiny_llama) -> None:
    folder, _ = tiny_llama
    config = ModelConfig.from_pretrained(folder)
    device = torch.device("cuda")
    model = load_model(folder, config, torch.float32, device, max_position=128)
    runner = ModelRunner(model, config, device, torch.float32, 16, 8, 64, 128)
    graph_bytes = runner.measure_cuda_graph_memory()
    assert graph_bytes > 0 and runner.graphs is None  # measured, then released
    runner.init_kv_cache(32)
    seconds = runner.capture_cuda_graphs()
    assert seconds > 0 and runner.graphs is not None
    assert sorted(runner.graphs.graphs) == [1, 2, 4, 8]
