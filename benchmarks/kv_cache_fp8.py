"""8-bit KV caches (fp8, int8) vs the compute-dtype cache on one model: pool blocks in the
same budget, greedy agreement over many prompts, prefill logit error, and a CPU decode
step's time.

    python benchmarks/kv_cache_fp8.py [--model M] [--kv fp8,fp8+calc,int8] [--prompts 32]
        [--tokens 32]
    python benchmarks/kv_cache_fp8.py --kv fp8+calc,fp8+calc+head,int8,int8+head \
        --decode-batch 0 --scale-stats

``--kv`` lists the caches to compare with the compute-dtype one: a ``--kv-cache-dtype``
value, ``+calc`` adding ``--calculate-kv-scales`` (int8 always calculates its scales),
``+head`` adding ``--kv-scales-per-head`` (one K and one V scale per KV head).
``--scale-stats`` also reports, per calculated engine, how far apart its layers' heads are
(the largest head amax over the smallest, per layer) and how many of the K/V values a
later prompt writes exceed the range its scales give (they saturate).
Every engine runs in one process on the same weights (default: the default model); the
prompts are chat-templated questions so the continuations are the model's usual text.
Agreement counts generated tokens equal at the same position (after a first divergence the
texts differ, so this is a lower bound of how alike they read) and whole continuations
that are identical. The step times are medians on a shared CPU: noisy, compare within a run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pagemill.runtime import LLM, SamplingParams
from pagemill.runtime.config import DEFAULT_MODEL

TOPICS = [
    "the moon",
    "bread",
    "rivers",
    "volcanoes",
    "bees",
    "chess",
    "the ocean",
    "trains",
    "music",
    "winter",
    "coffee",
    "birds",
    "mountains",
    "rain",
    "libraries",
    "bicycles",
    "gardens",
    "stars",
    "cats",
    "the desert",
    "forests",
    "clocks",
    "maps",
    "bridges",
    "islands",
    "snow",
    "paper",
    "the wind",
    "apples",
    "lighthouses",
    "owls",
    "glass",
]


def prompts(llm: LLM, n: int) -> list[list[int]]:
    tok = llm.get_tokenizer()
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        msgs = [{"role": "user", "content": f"Write two sentences about {topic}. ({i})"}]
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        out.append(tok.encode(text, add_special_tokens=False))
    return out


def decode_step_ms(llm: LLM, batch: int, ctx: int, steps: int) -> float:
    """Median engine step time of `batch` decodes at ~`ctx` tokens of context."""
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        ids = torch.randint(100, 20000, (ctx,), generator=g).tolist()
        engine.add_request(f"d{i}", ids, params)
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    # The last steps are pure decodes of the whole batch (prefill steps come first).
    times = times[-(steps - 2) : -1]
    return statistics.median(times) * 1e3


def compare(ref: LLM, q: LLM, ps: list[list[int]], tokens: int) -> dict:
    """Greedy agreement and prefill logprob error of engine ``q`` against ``ref``."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in ref.generate(ps, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in q.generate(ps, params, use_tqdm=False)]
    same_pos = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    prefix = [
        next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), len(ra)) for ra, rb in zip(a, b)
    ]
    # Logprobs at the last prompt position (the first generated token's distribution).
    lp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=20)
    errs, top1 = [], 0
    for p in ps:
        ra = ref.generate([p], lp, use_tqdm=False)[0].outputs[0].logprobs[0]
        rb = q.generate([p], lp, use_tqdm=False)[0].outputs[0].logprobs[0]
        shared = set(ra) & set(rb)
        errs.append(max(abs(ra[t].logprob - rb[t].logprob) for t in shared))
        top1 += max(ra, key=lambda t: ra[t].logprob) == max(rb, key=lambda t: rb[t].logprob)
    return {
        "blocks_same_budget": q.llm_engine.engine_core.num_blocks,
        "token_agreement_same_position": same_pos / (len(ps) * tokens),
        "identical_continuations": sum(ra == rb for ra, rb in zip(a, b)) / len(ps),
        "mean_common_prefix_tokens": statistics.mean(prefix),
        "first_token_top1_agreement": top1 / len(ps),
        "max_abs_logprob_err_top20_mean": statistics.mean(errs),
        "max_abs_logprob_err_top20_max": max(errs),
    }


class SaturationSpy:
    """Counts, per engine, the K/V values written after the scales were set that lie beyond
    what the scales can store (``|x| > scale * max code``: saturated), and summarises how far
    apart the KV heads' ranges are in each layer."""

    def __init__(self, llm: LLM) -> None:
        import pagemill.runtime.model_executor.models.llama as llama

        runner = llm.llm_engine.engine_core.model_runner
        self.scales = runner.kv_cache.scales
        self.layer_of = {kc.data_ptr(): i for i, (kc, _) in enumerate(runner.kv_cache.caches)}
        self.limit = float(
            127 if runner.kv_cache.dtype == torch.int8 else torch.finfo(runner.kv_cache.dtype).max
        )
        self.total = self.saturated = 0
        self.head_amax: dict[int, torch.Tensor] = {}
        real = llama.write_kv_cache

        def write(k, v, kc, vc, slots, ks=None, vs=None):  # type: ignore[no-untyped-def]
            i = self.layer_of.get(kc.data_ptr())
            # A layer's first write is the calibration prefill (its amax set the scales).
            if i is not None and ks is not None and i in self.head_amax:
                for x, s in ((k, ks), (v, vs)):
                    s = s[:, None] if s.dim() == 1 else s
                    self.saturated += int((x.float().abs() > s * self.limit).sum())
                    self.total += x.numel()
            if i is not None and i not in self.head_amax:
                self.head_amax[i] = k.detach().float().abs().amax(dim=(0, 2))
            real(k, v, kc, vc, slots, ks, vs)

        llama.write_kv_cache = write
        self._restore = lambda: setattr(llama, "write_kv_cache", real)

    def report(self) -> dict:
        self._restore()
        spread = [float(a.max() / a.min().clamp_min(1e-12)) for a in self.head_amax.values()]
        return {
            "saturated_fraction_after_calibration": self.saturated / max(self.total, 1),
            "k_head_amax_spread_median": statistics.median(spread) if spread else None,
            "k_head_amax_spread_max": max(spread) if spread else None,
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--kv", default="fp8,fp8+calc,int8")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--budget", default=str(256 << 20))
    ap.add_argument("--decode-batch", type=int, default=16)
    ap.add_argument("--decode-ctx", type=int, default=512)
    ap.add_argument("--json", default=None)
    ap.add_argument("--scale-stats", action="store_true")
    args = ap.parse_args()
    common = dict(enforce_eager=True, kv_cache_memory_bytes=int(args.budget), max_model_len=2048)
    ref = LLM(args.model, **common)
    ps = prompts(ref, args.prompts)
    res: dict = {
        "model": args.model,
        "dtype": str(ref.llm_engine.engine_core.dtype),
        "prompts": len(ps),
        "tokens_each": args.tokens,
        "blocks_same_budget_auto": ref.llm_engine.engine_core.num_blocks,
        "kv": {},
    }
    engines = {"auto": ref}
    for spec in args.kv.split(","):
        kv, *flags = spec.split("+")
        calc = "calc" in flags or kv == "int8"
        head = "head" in flags
        q = LLM(
            args.model,
            kv_cache_dtype=kv,
            calculate_kv_scales=calc,
            kv_scales_per_head=head,
            **common,
        )
        spy = SaturationSpy(q) if args.scale_stats and calc else None
        res["kv"][spec] = {
            "calculate_kv_scales": calc,
            "kv_scales_per_head": head,
            **compare(ref, q, ps, args.tokens),
        }
        if spy is not None:
            res["kv"][spec].update(spy.report())
        print(json.dumps({spec: res["kv"][spec]}, indent=1), flush=True)
        if args.decode_batch:
            engines[spec] = q
        else:
            del q
    for name, llm in engines.items() if args.decode_batch else ():
        ms = decode_step_ms(llm, args.decode_batch, args.decode_ctx, 12)
        res.setdefault("decode_step_ms", {})[name] = ms
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
