"""CUDA graphs stay out of the CPU path: no engine on CPU builds them, and the runner's
eager decode step is the plain prepare-then-forward it always was. What a graph records,
a bucket's step over its padded buffers, runs here eagerly (no CUDA, no mocks) with the
Triton attention kernel under the interpreter."""

from __future__ import annotations

import pytest
import torch

from pagemill.kernels._dispatch import interpreting, triton_available
from pagemill.runtime import LLM
from pagemill.runtime.config import ModelConfig
from pagemill.runtime.model_executor.loader import load_model
from pagemill.runtime.sampling_params import SamplingParams
from pagemill.runtime.worker.cuda_graphs import BucketInputs, DecodeGraphs
from pagemill.runtime.worker.model_runner import ModelRunner
from pagemill.scheduler import Request, ScheduledRequest, SchedulerOutput


def test_cpu_engine_never_builds_graphs(tiny_llama) -> None:
    folder, _ = tiny_llama
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=4 << 20, enforce_eager=False)
    runner = llm.llm_engine.engine_core.model_runner
    out = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=0.0, max_tokens=3))
    assert all(len(o.outputs[0].token_ids) == 3 for o in out)
    assert runner.graphs is None and not runner.use_cuda_graphs


def test_decode_graphs_refuse_a_cpu_device() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs([1, 2], 4, torch.device("cpu"))


def _steps(
    prompts: list[list[int]], next_ids: list[int]
) -> tuple[SchedulerOutput, SchedulerOutput]:
    """A prefill step of every prompt, then one decode step of one token each."""
    prefill, decode, next_block = [], [], 0
    for i, (p, tok) in enumerate(zip(prompts, next_ids)):
        record = Request(f"r{i}", p, sampling_params=SamplingParams(temperature=0.0))
        blocks = list(range(next_block, next_block + 2))
        next_block += 2
        prefill.append(
            ScheduledRequest(record.request_id, p, 0, len(p), blocks, True, True, record)
        )
        decode.append(
            ScheduledRequest(record.request_id, [tok], len(p), 1, [], True, False, record)
        )
    return (SchedulerOutput(prefill, sum(map(len, prompts))), SchedulerOutput(decode, len(prompts)))


def _runner(folder) -> ModelRunner:
    config = ModelConfig.from_pretrained(folder)
    model = load_model(folder, config, torch.float32, torch.device("cpu"), max_position=128)
    runner = ModelRunner(model, config, torch.device("cpu"), torch.float32, 16, 4, 128, 32)
    runner.init_kv_cache(16)
    return runner


def test_eager_decode_step_is_prepare_then_forward(tiny_llama, random_prompts) -> None:
    """`execute_model` on a decode batch (graphs off) gives exactly the logits of the path it
    had before graphs: `prepare()`, the model's forward, `compute_logits`."""
    folder, model = tiny_llama
    prompts = random_prompts([5, 11, 3], model.config.vocab_size, seed=7)
    prefill, decode = _steps(prompts, [4, 9, 2])
    with torch.inference_mode():
        a = _runner(folder)
        a.execute_model(prefill)
        got = a.execute_model(decode)
        assert a.graphs is None
        b = _runner(folder)
        b.execute_model(prefill)
        step = b.prepare(decode)
        assert step is not None and step.sample_indices is None
        want = b.model.compute_logits(b.model(step.input_ids, step.positions, step.attn))
    assert got.req_ids == ["r0", "r1", "r2"]
    assert torch.equal(got.logits, want)


@pytest.mark.skipif(
    not (interpreting() and triton_available()),
    reason="needs the Triton interpreter (TRITON_INTERPRET=1, set by the root "
    "conftest when there is no GPU)",
)
def test_bucket_step_matches_the_eager_decode(tiny_llama, random_prompts) -> None:
    """Three decodes padded to a bucket of 4 with full-width tables (the graph's inputs and
    its once-made Triton plan) give the eager step's logits on the real rows."""
    folder, model = tiny_llama
    prompts = random_prompts([5, 11, 3], model.config.vocab_size, seed=7)
    prefill, decode = _steps(prompts, [4, 9, 2])
    runner = _runner(folder)
    assert runner.kv_cache is not None
    with torch.inference_mode():
        runner.execute_model(prefill)
        step = runner.prepare(decode)
        assert step is not None and step.batch is not None
        batch = step.batch
        inputs = BucketInputs.create(
            4,
            runner.max_blocks_per_seq,
            runner.device,
            tuple(runner.kv_cache.caches[0][0].shape),
            runner.model_config.num_attention_heads,
            runner.dtype,
            backend="triton",
        )
        inputs.load(
            batch.input_ids.numpy(),
            batch.positions,
            batch.slots,
            batch.seq_lens,
            batch.block_tables,
        )
        padded, hidden, no_aux = inputs.step(runner.model.forward, runner.model.compute_logits)
        eager_hidden = runner.model(step.input_ids, step.positions, step.attn)
        eager = runner.model.compute_logits(eager_hidden)
        # EAGLE-3's features: the forward's second output, recorded with the logits.
        runner.model.set_aux_hidden_state_layers((1, 0))
        _, _, aux = inputs.step(runner.model.forward, runner.model.compute_logits)
        _, eager_aux = runner.model(step.input_ids, step.positions, step.attn)
    assert padded.shape == (4, model.config.vocab_size)
    torch.testing.assert_close(padded[:3], eager, rtol=1e-4, atol=1e-4)
    assert torch.equal(padded[:3].argmax(-1), eager.argmax(-1))
    assert torch.isfinite(padded[3]).all()
    torch.testing.assert_close(hidden[:3], eager_hidden, rtol=1e-4, atol=1e-4)
    assert no_aux is None and aux is not None and aux.shape == (4, 2 * model.config.hidden_size)
    torch.testing.assert_close(aux[:3], eager_aux, rtol=1e-4, atol=1e-4)


def test_aux_hidden_states_are_transformers_layer_inputs(tiny_llama, random_prompts) -> None:
    """The forward's auxiliary output is the input of each asked layer (id 0: the
    embedding), as transformers' `output_hidden_states` reports it, in the asked order."""
    folder, model = tiny_llama
    prompts = random_prompts([5, 11], model.config.vocab_size, seed=3)
    prefill, _ = _steps(prompts, [1, 2])
    runner = _runner(folder)
    runner.model.set_aux_hidden_state_layers((1, 0, 1))
    with torch.inference_mode():
        step = runner.prepare(prefill)
        assert step is not None
        hidden, aux = runner.model(step.input_ids, step.positions, step.attn)
    row = 0
    for p in prompts:
        with torch.no_grad():
            ref = model(torch.tensor([p]), output_hidden_states=True).hidden_states
        want = torch.cat([ref[1][0], ref[0][0], ref[1][0]], dim=-1)
        torch.testing.assert_close(aux[row : row + len(p)], want, rtol=1e-4, atol=1e-4)
        row += len(p)
    assert hidden.shape == (row, model.config.hidden_size)


@pytest.mark.skipif(
    not (interpreting() and triton_available()),
    reason="needs the Triton interpreter (TRITON_INTERPRET=1, set by the root "
    "conftest when there is no GPU)",
)
def test_verify_bucket_step_matches_the_eager_step(tiny_llama, random_prompts) -> None:
    """A verify step's shape (every request 3 tokens: its last one and two drafts) padded
    to a bucket of 4 rows gives the eager step's logits at every real token, and the padded
    row's tokens see no key (finite output, nothing written)."""
    folder, model = tiny_llama
    prompts = random_prompts([5, 14, 3], model.config.vocab_size, seed=9)
    prefill, _ = _steps(prompts, [0, 0, 0])
    verify = []
    for s, extra in zip(prefill.scheduled, ([4, 8, 1], [9, 9, 2], [2, 7, 30])):
        verify.append(
            ScheduledRequest(s.request_id, extra, s.num_tokens, 3, [], True, False, s.request)
        )
    runner = _runner(folder)
    assert runner.kv_cache is not None
    with torch.inference_mode():
        runner.execute_model(prefill)
        step = runner.prepare(SchedulerOutput(verify, 9))
        assert step is not None and step.batch is not None
        batch = step.batch
        inputs = BucketInputs.create(
            4,
            runner.max_blocks_per_seq,
            runner.device,
            tuple(runner.kv_cache.caches[0][0].shape),
            runner.model_config.num_attention_heads,
            runner.dtype,
            backend="triton",
            query_len=3,
        )
        before = runner.kv_cache.caches[0][0].clone()
        inputs.load(
            batch.input_ids.numpy(),
            batch.positions,
            batch.slots,
            batch.seq_lens,
            batch.block_tables,
        )
        padded, hidden, _ = inputs.step(runner.model.forward, runner.model.compute_logits)
        written = runner.kv_cache.caches[0][0].clone()
        eager_hidden = runner.model(step.input_ids, step.positions, step.attn)
        eager = runner.model.compute_logits(eager_hidden)
    assert padded.shape == (12, model.config.vocab_size)
    torch.testing.assert_close(padded[:9], eager, rtol=1e-4, atol=1e-4)
    assert torch.equal(padded[:9].argmax(-1), eager.argmax(-1))
    assert torch.isfinite(padded[9:]).all()
    torch.testing.assert_close(hidden[:9], eager_hidden, rtol=1e-4, atol=1e-4)
    # Only the real tokens' slots were written (the eager pass rewrote the same values).
    changed = (written != before).flatten(1).any(-1).nonzero().flatten().tolist()
    assert set(changed) <= {int(b) for b in batch.block_tables.flatten()}
