"""The default model served from its own Q4_1 weights (packed int4, bf16 compute) against
transformers' dequantized model, over many prompts.

Two figures: teacher-forced agreement (at each of the first 16 positions of transformers'
greedy continuation, does our argmax pick its token?) and free-running agreement (our own
greedy continuation, position by position). The second compounds: one flipped near-tie
changes every later token, and bf16 alone flips enough of them on this small model that
free-running agreement with fp32 transformers is ~0.85-0.9 for *any* bf16 serving —
dense bf16 weights and transformers' own bf16 included (measured when this was written:
packed int4 0.85, dense bf16 0.89, transformers bf16 0.91; teacher-forced 0.98 / 0.975).
So the 95% bar is on the teacher-forced figure; the repack itself is exact (first test).
"""

from __future__ import annotations

import pytest
import torch

from pagemill.runtime import DEFAULT_MODEL, LLM, SamplingParams

N = 16
QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "How do airplanes fly?",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Explain photosynthesis in one sentence.",
    "Who wrote Romeo and Juliet?",
    "Give me a tip for learning Python.",
    "What causes rain?",
    "Translate 'good morning' into Spanish.",
    "What is the largest planet in our solar system?",
    "Suggest a name for a pet cat.",
    "Why is the sky blue?",
    "List two benefits of exercise.",
    "What is a prime number?",
    "How many days are in a leap year?",
    "Describe a sunset.",
    "What does a computer's CPU do?",
    "Recommend a book for a long flight.",
    "What is gravity?",
    "How do I boil an egg?",
    "What is the boiling point of water?",
    "Tell me a fun fact about octopuses.",
    "What is machine learning?",
    "Write one sentence about autumn.",
    "What language is spoken in Brazil?",
    "How do vaccines work?",
    "What is the speed of light?",
    "Give an example of a mammal that can fly.",
    "What is the difference between weather and climate?",
    "Who painted the Mona Lisa?",
    "What is an API?",
]
TEXTS = [
    "The quick brown fox",
    "Once upon a time, in a small village,",
    "The history of the Roman Empire",
    "In mathematics, a group is",
    "def fibonacci(n):",
    "The best way to make coffee is",
    "Paris is known for",
    "Water is made of",
    "The first step in baking bread is",
    "Neural networks are",
    "My favorite season is",
    "The ocean covers",
    "To install a Python package, run",
    "The moon orbits",
    "A good breakfast includes",
    "The main causes of the French Revolution were",
]


@pytest.fixture(scope="module")
def reference():
    """(folder, prompts, transformers' fp32 greedy continuations on the dequantized GGUF)."""
    transformers = pytest.importorskip("transformers")
    from pagemill.runtime.model_executor.default_model import (
        ensure_default_model,
        ensure_dense_weights,
    )

    folder = ensure_default_model()
    ensure_dense_weights(folder)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
        for q in QUESTIONS
    ]
    prompts += [tok.encode(t) for t in TEXTS]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    # One left-padded batch: the mask keeps padding out of every row's attention.
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=N,
            do_sample=False,
            eos_token_id=[],
            pad_token_id=0,
        )
    return folder, prompts, out[:, width:].tolist()


def test_q4_1_rows_are_served_exactly(reference) -> None:
    """The packed int4 weights (fp32 kernels) equal the dequantized checkpoint bit for bit."""
    from safetensors import safe_open

    from pagemill.runtime.config import ModelConfig
    from pagemill.runtime.model_executor.default_model import gguf_for_folder
    from pagemill.runtime.model_executor.gguf_weights import GGUFCheckpoint
    from pagemill.runtime.model_executor.layers import Linear
    from pagemill.runtime.model_executor.quantization import WeightScheme

    folder, _, _ = reference
    config = ModelConfig.from_pretrained(folder)
    wanted = [
        f"model.layers.{i}.{n}.weight"
        for i in (0, 29)
        for n in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj")
    ]
    rows = dict(GGUFCheckpoint(gguf_for_folder(folder)).weights(wanted, config))
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for name in wanted:
            layer = Linear(rows[name].shape[1], rows[name].shape[0], False, torch.float32)
            layer.scheme = WeightScheme("native", kernel_dtype=torch.float32)
            layer.load_rows(0, rows[name])
            assert layer.weight_format == "int4" and rows[name].source == "Q4_1"
            with torch.no_grad():
                served = layer(torch.eye(layer.in_features)).T
            assert torch.equal(served, f.get_tensor(name)), name


def _agreement(outs: list[list[int]], refs: list[list[int]]) -> float:
    return sum(a == b for o, r in zip(outs, refs) for a, b in zip(o, r)) / sum(map(len, refs))


@pytest.mark.slow
def test_packed_q4_1_agrees_with_transformers(reference) -> None:
    from pagemill.runtime.model_executor.layers import Linear
    from pagemill.runtime.sampling_params import SamplingParams as SP
    from pagemill.runtime.worker.model_runner import ModelRunner
    from pagemill.scheduler import Request, ScheduledRequest, SchedulerOutput

    _, prompts, refs = reference
    llm = LLM(
        DEFAULT_MODEL,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=512,
        kv_cache_memory_bytes=128 << 20,
    )
    model = llm.llm_engine.engine_core.model_runner.model
    assert (
        model.layers[0].mlp.down_proj.source == "Q4_1"
        and model.layers[0].mlp.down_proj.weight_format == "int4"
    )
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    free = _agreement(
        [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)], refs
    )

    # Teacher-forced: every prompt + reference continuation in one flattened prefill, through
    # the packed kernels (the decode path) rather than the dense copies prefill would use.
    for m in model.modules():
        if isinstance(m, Linear):
            m.packed_max_tokens = 1 << 30
    seqs = [p + r[:-1] for p, r in zip(prompts, refs)]
    runner = ModelRunner(
        model,
        model.config,
        torch.device("cpu"),
        torch.bfloat16,
        16,
        len(seqs),
        sum(map(len, seqs)),
        512,
    )
    runner.init_kv_cache(sum(-(-len(s) // 16) for s in seqs))
    sched, block = [], 0
    for i, s in enumerate(seqs):
        nb = -(-len(s) // 16)
        record = Request(f"r{i}", s, sampling_params=SP(temperature=0.0))
        sched.append(
            ScheduledRequest(
                record.request_id, s, 0, len(s), list(range(block, block + nb)), True, True, record
            )
        )
        block += nb
    batch = runner.prepare(SchedulerOutput(sched, sum(map(len, seqs)), [], []))
    with torch.inference_mode():
        logits = model.compute_logits(model(batch.input_ids, batch.positions, batch.attn))
    starts = batch.attn.plan.query_start_loc.tolist()
    picks = [
        logits[starts[i] + len(p) - 1 : starts[i + 1]].argmax(-1).tolist()
        for i, p in enumerate(prompts)
    ]
    forced = _agreement(picks, refs)
    print(
        f"\nQ4_1 packed int4, bf16, vs transformers fp32 over {len(prompts)} prompts x {N} tokens: "
        f"teacher-forced {forced:.3f}, free-running {free:.3f}"
    )
    assert forced >= 0.95
    assert free >= 0.75  # bf16's own level (see the module docstring), with room for noise
