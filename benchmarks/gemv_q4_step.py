"""The default model's linears several ways in one process, interleaved: its int4 layers on
`gemv_q4` with two int8 activation planes (`PAGEMILL_CPU_INT8_ACTIVATIONS=2`) or one
(llama.cpp's rounding) or on PyTorch's int4 kernel (bf16 activations and scales), its Q8_0
LM head on `gemv_q8` (two planes or one) or as two int4 planes on PyTorch's kernel (what
serves it without the switch), and the dense dequantized twin in fp32 (the exact weights,
nothing rounded but the output) for both.

    uv run python benchmarks/gemv_q4_step.py [--threads 1] [--rounds 10] [--tokens 32]
        [--prompts 64] [--structured-seeds 64]

Accuracy: every prompt + its twin's greedy continuation in one teacher-forced pass through
each mode (as `test_quant_smollm2` does): agreement of the argmax with the twin's, the mean
KL(twin || mode) of the next-token distributions, the mean/min cosine and max |error| of
the logits; and free-run greedy agreement (the share of positions whose token equals the
twin's greedy token there). `--structured-seeds N`: N sampled JSON-schema requests per mode
(the schemas and prompts of `tests/test_structured_smollm2.py`, temperature 0.7 / 1.0,
seeds 0..N-1, max 200 tokens, free whitespace as the server allows), counting how many
ramble to the token limit and how many do not parse. Speed (`--rounds` > 0): eager decode ms
per token of one request (a run of `--tokens` minus a run of 4 tokens, the same prompt,
modes alternated per round; medians and the median of paired ratios). With one thread the
clock is this thread's CPU time (the engine steps in this thread), which other load on the
box inflates little; otherwise wall time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pagemill.kernels import gemv_q4_cpu, gemv_q8_cpu
from pagemill.runtime import DEFAULT_MODEL, LLM, SamplingParams
from pagemill.runtime.model_executor.layers import Linear
from pagemill.runtime.model_executor.quantization.formats import (
    Int8Blocks,
    int4_planes,
    pack_int4,
)

# Time compiled steps: a cold compile cache compiles before the engine is ready, not beside
# eager steps (the engine's default on a cold start).
os.environ.setdefault("PAGEMILL_COMPILE_BACKGROUND", "0")

# mode -> (int4 layers, LM head)
MODES = {
    "torch int4": ("torch", "int4x2"),  # the default today
    "torch+q8 head": ("torch", "q8 x2"),
    "q4x2+q8x2": ("x2", "q8 x2"),
    "q4x2": ("x2", "int4x2"),  # PAGEMILL_CPU_INT8_ACTIVATIONS=2 before the Q8_0 head
    "q4x1+q8x1": ("x1", "q8 x1"),
    "exact twin": ("twin", "twin"),
}
BASE = "torch int4"
MODE = {"now": BASE}
PROMPTS = [
    "What is the capital of France?",
    "Name three colors.",
    "How do airplanes fly?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "Give me a tip for learning Python.",
    "Why is the sky blue?",
    "What does a computer's CPU do?",
    "How do vaccines work?",
    "What is an API?",
    "The quick brown fox",
    "Once upon a time, in a small village,",
    "The history of the Roman Empire",
    "def fibonacci(n):",
    "The best way to make coffee is",
    "Neural networks are",
]
TOPICS = [
    "volcanoes",
    "the moon",
    "bees",
    "chess",
    "rain",
    "bread",
    "trains",
    "music",
    "gravity",
    "the ocean",
    "libraries",
    "bicycles",
    "clouds",
    "money",
    "sleep",
    "robots",
]
TEMPLATES = [
    "Explain {} to a child.",
    "Write two sentences about {}.",
    "What are the pros and cons of {}?",
    "Tell me a surprising fact about {}.",
]


def prompts(n: int) -> list[str]:
    more = [t.format(topic) for t in TEMPLATES for topic in TOPICS]
    return (PROMPTS + more)[:n]


def _body(layer: Linear, alt: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
    mode = MODES[MODE["now"]][0]
    if mode in ("x1", "x2"):
        layer.int8_act = 2 if mode == "x2" else 1
        return Linear._gemv_q4(layer, x)
    if mode == "torch":
        xk = x.reshape(-1, layer.in_features).to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xk, alt["packed"], 32, alt["sz"])
    else:
        y = F.linear(x.reshape(-1, layer.in_features).float(), alt["w"])
    y = y.to(x.dtype).view(*x.shape[:-1], layer.out_features)
    return y if layer.bias is None else y + layer.bias


def _head(layer: Linear, alt: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
    mode = MODES[MODE["now"]][1]
    xk = x.reshape(-1, layer.in_features)
    if mode.startswith("q8"):
        assert layer.qweight is not None
        planes = 2 if mode.endswith("x2") else 1
        y = gemv_q8_cpu.gemv_q8(xk, layer.qweight, layer.out_features, planes=planes)
    elif mode == "int4x2":
        xk = xk.to(torch.bfloat16)
        xk = torch.cat([xk, xk], dim=-1).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xk, alt["packed"], 32, alt["sz"])
    else:
        y = F.linear(xk.float(), alt["w"])
    return y.to(x.dtype).view(*x.shape[:-1], layer.out_features)


def install(model: torch.nn.Module) -> int:
    n = 0
    head = getattr(model, "logits_proj", None)
    for m in model.modules():
        if isinstance(m, Linear) and m.int8_act and m is not head:
            assert m.qweight is not None
            q, d, mins = gemv_q4_cpu.unpack_q4_blocks(m.qweight, m.out_features)
            packed, sz = pack_int4(q, d, mins + 8 * d, torch.bfloat16)
            alt = {
                "packed": packed,
                "sz": sz,
                "w": gemv_q4_cpu.dequantize_q4_blocks(m.qweight, m.out_features),
            }
            m._gemv_q4 = partial(_body, m, alt)  # type: ignore[method-assign]
            m.packed_max_tokens = 1 << 30  # prefill through the packed path too
            n += 1
    assert isinstance(head, Linear) and head.weight_format == "q8_0", "no Q8_0 head on gemv_q8"
    assert head.qweight is not None
    q8, d8 = gemv_q8_cpu.unpack_q8_blocks(head.qweight, head.out_features)
    q4, s4, z4, _, _ = int4_planes([Int8Blocks(q8, d8, 32)])
    packed, sz = pack_int4(q4, s4, z4, torch.bfloat16)
    alt = {
        "packed": packed,
        "sz": sz,
        "w": gemv_q8_cpu.dequantize_q8_blocks(head.qweight, q8.shape[0]),
    }
    head._packed = partial(_head, head, alt)  # type: ignore[method-assign]
    head.packed_max_tokens = 1 << 30
    return n


def teacher_forced(llm: Any, prompts: list[list[int]], conts: list[list[int]]) -> list:
    from pagemill.runtime.sampling_params import SamplingParams as SP
    from pagemill.runtime.worker.model_runner import ModelRunner
    from pagemill.scheduler import Request, ScheduledRequest, SchedulerOutput

    model = llm.llm_engine.engine_core.model_runner.model
    seqs = [p + c[:-1] for p, c in zip(prompts, conts, strict=True)]
    total = sum(map(len, seqs))
    runner = ModelRunner(
        model, model.config, torch.device("cpu"), torch.bfloat16, 16, len(seqs), total, 512
    )
    runner.init_kv_cache(sum(-(-len(s) // 16) for s in seqs))
    sched, block = [], 0
    for i, s in enumerate(seqs):
        nb = -(-len(s) // 16)
        rec = Request(f"r{i}", s, sampling_params=SP(temperature=0.0))
        blocks = list(range(block, block + nb))
        sched.append(ScheduledRequest(rec.request_id, s, 0, len(s), blocks, True, True, rec))
        block += nb
    batch = runner.prepare(SchedulerOutput(sched, total, [], []))
    assert batch is not None
    with torch.inference_mode():
        logits = model.compute_logits(model(batch.input_ids, batch.positions, batch.attn))
    starts = batch.attn.plan.query_start_loc.tolist()
    return [logits[starts[i] + len(p) - 1 : starts[i + 1]].float() for i, p in enumerate(prompts)]


def _structured_cases(n: int) -> list[tuple[str, dict[str, Any], str, float, int]]:
    """(name, schema, prompt, temperature, seed) of the slow structured-output test's
    schemas, round robin."""
    path = Path(__file__).resolve().parents[1] / "tests" / "test_structured_smollm2.py"
    spec = importlib.util.spec_from_file_location("_structured_cases", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    names = list(mod.SCHEMAS)
    return [
        (
            names[i % len(names)],
            mod.SCHEMAS[names[i % len(names)]],
            mod.PROMPTS[names[i % len(names)]] + " Answer in JSON.",
            0.7 if i % 2 else 1.0,
            i,
        )
        for i in range(n)
    ]


def structured(llm: Any, n: int) -> tuple[int, int]:
    """(rambled to max_tokens, did not parse) over `n` seeded JSON-schema requests."""
    from pagemill.runtime.sample.structured_output.params import StructuredOutputsParams

    cases = _structured_cases(n)
    params = [
        SamplingParams(
            temperature=t,
            seed=seed,
            max_tokens=200,
            structured_outputs=StructuredOutputsParams(json=schema),
        )
        for _, schema, _, t, seed in cases
    ]
    convs = [[{"role": "user", "content": prompt}] for _, _, prompt, _, _ in cases]
    outs = llm.chat(convs, params, use_tqdm=False)
    rambled = bad = 0
    for o in outs:
        c = o.outputs[0]
        if c.finish_reason == "length":
            rambled += 1
            continue
        try:
            json.loads(c.text)
        except ValueError:
            bad += 1
    return rambled, bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=10, help="speed rounds (0: no speed table)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=16, help=f"up to {len(prompts(1000))}")
    ap.add_argument("--structured-seeds", type=int, default=0)
    ap.add_argument("--modes", default=",".join(MODES), help="a subset of the modes")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = args.modes.split(",")
    assert BASE in modes and "exact twin" in modes and set(modes) <= set(MODES), modes
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    Linear.int8_activations = 2  # opt-in in the engine: lay the layers out for gemv_q4/q8
    llm = LLM(
        DEFAULT_MODEL,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=512,
        kv_cache_memory_bytes=256 << 20,
    )
    model = llm.llm_engine.engine_core.model_runner.model
    print(f"{install(model)} int4 linears + the Q8_0 head; threads {torch.get_num_threads()}")
    tok = llm.get_tokenizer()
    texts = prompts(args.prompts)
    ids = [tok.encode(p) for p in texts]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)

    MODE["now"] = "exact twin"
    conts = [o.outputs[0].token_ids for o in llm.generate(texts, greedy, use_tqdm=False)]
    free: dict[str, float] = {}
    for mode in modes:
        MODE["now"] = mode
        outs = [o.outputs[0].token_ids for o in llm.generate(texts, greedy, use_tqdm=False)]
        same = sum(a == b for o, c in zip(outs, conts) for a, b in zip(o, c))
        free[mode] = same / sum(map(len, conts))

    if args.structured_seeds:
        print(f"\nstructured output, {args.structured_seeds} seeded JSON-schema samples per mode:")
        for mode in modes:
            MODE["now"] = mode
            rambled, bad = structured(llm, args.structured_seeds)
            print(f"{mode:>14} rambled to max_tokens {rambled:3d}   did not parse {bad:3d}")

    if args.rounds:

        def run(n: int) -> float:
            p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            t0 = clock()
            llm.generate([PROMPTS[0]], p, use_tqdm=False)
            return clock() - t0

        times: dict[str, list[float]] = {m: [] for m in modes}
        for mode in modes:
            MODE["now"] = mode
            run(args.tokens)
        for _ in range(args.rounds):
            for mode in modes:
                MODE["now"] = mode
                times[mode].append((run(args.tokens) - run(4)) / (args.tokens - 4))
        print(f"\neager decode, one request, ms per token ({clock.__name__}):")
        for mode in modes:
            ratio = statistics.median(t / b for t, b in zip(times[mode], times[BASE], strict=True))
            print(f"{mode:>14} {statistics.median(times[mode]) * 1e3:8.2f}  x {BASE} {ratio:5.2f}")

    logits = {}
    # Last: the teacher-forced runner binds its own KV cache into the model.
    for mode in modes:
        MODE["now"] = mode
        logits[mode] = teacher_forced(llm, ids, [list(c) for c in conts])
    ref = logits["exact twin"]
    n_pos = sum(r.shape[0] for r in ref)
    print(
        f"\naccuracy over {len(texts)} prompts x {args.tokens} tokens ({n_pos} positions), vs twin:"
    )
    print(
        f"{'mode':>14} {'forced argmax':>14} {'free-run':>9} {'mean KL':>9} {'cos mean':>9} "
        f"{'cos min':>8} {'max |err|':>10}"
    )
    for mode in modes:
        agree = (
            sum((a.argmax(-1) == r.argmax(-1)).sum().item() for a, r in zip(logits[mode], ref))
            / n_pos
        )
        kl = torch.cat(
            [
                F.kl_div(
                    a.log_softmax(-1), r.log_softmax(-1), log_target=True, reduction="none"
                ).sum(-1)
                for a, r in zip(logits[mode], ref)
            ]
        )
        cos = torch.cat([F.cosine_similarity(a, r, dim=-1) for a, r in zip(logits[mode], ref)])
        err = max((a - r).abs().max().item() for a, r in zip(logits[mode], ref))
        print(
            f"{mode:>14} {agree:14.4f} {free[mode]:9.4f} {kl.mean().item():9.5f} "
            f"{cos.mean().item():9.5f} {cos.min().item():8.5f} {err:10.3f}"
        )


if __name__ == "__main__":
    main()
