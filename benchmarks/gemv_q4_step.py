"""The default model's int4 linears four ways in one process, interleaved: `gemv_q4` with two
int8 activation planes (`PAGEMILL_CPU_INT8_ACTIVATIONS=2`) and with one (llama.cpp's
rounding), PyTorch's int4
kernel (bf16 activations and scales), and the dense dequantized twin in fp32 (the exact
weights, nothing rounded but the output).

    uv run python benchmarks/gemv_q4_step.py [--threads 1] [--rounds 10] [--tokens 32]

Accuracy: every prompt + its twin's greedy continuation in one teacher-forced pass through
the packed path (as `test_quant_smollm2` does): per mode, agreement of the argmax with the
twin's, the mean/min cosine and max |error| of the logits against the twin's. Speed: eager
decode ms per token of one request (a run of `--tokens` minus a run of 4 tokens, the same
prompt, modes alternated per round; medians and the median of paired ratios). With one
thread the clock is this thread's CPU time (the engine steps in this thread), which other
load on the box inflates little; otherwise wall time. The LM head (Q8_0 in this file)
runs PyTorch's kernel in every mode.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from pagemill.kernels import gemv_q4_cpu
from pagemill.runtime import DEFAULT_MODEL, LLM, SamplingParams
from pagemill.runtime.model_executor.layers import Linear
from pagemill.runtime.model_executor.quantization.formats import pack_int4

MODES = ("gemv_q4 x2", "gemv_q4 x1", "torch int4", "exact twin")
MODE = {"now": "gemv_q4 x2"}
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


def _dispatch(layer: Linear, alt: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
    mode = MODE["now"]
    if mode.startswith("gemv_q4"):
        layer.int8_act = 2 if mode.endswith("x2") else 1
        return Linear._gemv_q4(layer, x)
    if mode == "torch int4":
        xk = x.reshape(-1, layer.in_features).to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xk, alt["packed"], 32, alt["sz"])
    else:
        y = F.linear(x.reshape(-1, layer.in_features).float(), alt["w"])
    y = y.to(x.dtype).view(*x.shape[:-1], layer.out_features)
    return y if layer.bias is None else y + layer.bias


def install(model: torch.nn.Module) -> int:
    n = 0
    for m in model.modules():
        if isinstance(m, Linear) and m.int8_act:
            assert m.qweight is not None
            q, d, mins = gemv_q4_cpu.unpack_q4_blocks(m.qweight, m.out_features)
            packed, sz = pack_int4(q, d, mins + 8 * d, torch.bfloat16)
            alt = {
                "packed": packed,
                "sz": sz,
                "w": gemv_q4_cpu.dequantize_q4_blocks(m.qweight, m.out_features),
            }
            m._gemv_q4 = partial(_dispatch, m, alt)  # type: ignore[method-assign]
            m.packed_max_tokens = 1 << 30  # prefill through the packed path too
            n += 1
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    Linear.int8_activations = 2  # opt-in in the engine: lay the int4 layers out for gemv_q4
    llm = LLM(
        DEFAULT_MODEL,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=512,
        kv_cache_memory_bytes=128 << 20,
    )
    model = llm.llm_engine.engine_core.model_runner.model
    print(f"{install(model)} int4 linears on gemv_q4; threads {torch.get_num_threads()}")
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)

    MODE["now"] = "exact twin"
    conts = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    free: dict[str, float] = {}
    for mode in MODES:
        MODE["now"] = mode
        outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
        same = sum(a == b for o, c in zip(outs, conts) for a, b in zip(o, c))
        free[mode] = same / sum(map(len, conts))

    def run(n: int) -> float:
        p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0 = clock()
        llm.generate([PROMPTS[0]], p, use_tqdm=False)
        return clock() - t0

    times: dict[str, list[float]] = {m: [] for m in MODES}
    for mode in MODES:
        MODE["now"] = mode
        run(args.tokens)
    for _ in range(args.rounds):
        for mode in MODES:
            MODE["now"] = mode
            times[mode].append((run(args.tokens) - run(4)) / (args.tokens - 4))
    print(f"\neager decode, one request, ms per token ({clock.__name__}):")
    for mode in MODES:
        ratio = statistics.median(
            t / b for t, b in zip(times[mode], times["gemv_q4 x2"], strict=True)
        )
        print(f"{mode:>12} {statistics.median(times[mode]) * 1e3:8.2f}  x gemv_q4 x2 {ratio:5.2f}")

    logits = {}
    # Last: the teacher-forced runner binds its own KV cache into the model.
    for mode in MODES:
        MODE["now"] = mode
        logits[mode] = teacher_forced(llm, prompts, [list(c) for c in conts])
    ref = logits["exact twin"]
    print(f"\naccuracy over {len(PROMPTS)} prompts x {args.tokens} tokens, against the twin:")
    print(
        f"{'mode':>12} {'forced argmax':>14} {'free-run':>9} {'cos mean':>9} {'cos min':>8} "
        f"{'max |err|':>10} {'max |logit|':>12}"
    )
    for mode in MODES:
        agree = sum(
            (a.argmax(-1) == r.argmax(-1)).sum().item() for a, r in zip(logits[mode], ref)
        ) / sum(r.shape[0] for r in ref)
        cos = torch.cat([F.cosine_similarity(a, r, dim=-1) for a, r in zip(logits[mode], ref)])
        err = max((a - r).abs().max().item() for a, r in zip(logits[mode], ref))
        top = max(r.abs().max().item() for r in ref)
        print(
            f"{mode:>12} {agree:14.3f} {free[mode]:9.3f} {cos.mean().item():9.5f} "
            f"{cos.min().item():8.5f} {err:10.3f} {top:12.2f}"
        )


if __name__ == "__main__":
    main()
