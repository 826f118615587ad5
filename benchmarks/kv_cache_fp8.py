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
later prompt writes exceed the range its scales give (they saturate); ``--quant-error``
the round-trip error of each scheme on the K/V the 16-bit engine writes (see `quant_error`).
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


def run(llm: LLM, ps: list[list[int]], tokens: int) -> tuple[list, list]:
    """Greedy continuations, and the top-20 logprobs at each prompt's last position (the
    first generated token's distribution), each in one batched call."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
    lp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=20)
    first = [o.outputs[0].logprobs[0] for o in llm.generate(ps, lp, use_tqdm=False)]
    return outs, first


def compare(ref_run: tuple[list, list], q: LLM, ps: list[list[int]], tokens: int) -> dict:
    """Greedy agreement and prefill logprob error of engine ``q`` against the reference
    engine's `run` (computed once for every engine compared)."""
    a, ref_first = ref_run
    b, q_first = run(q, ps, tokens)
    same_pos = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    prefix = [
        next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), len(ra)) for ra, rb in zip(a, b)
    ]
    errs, top1 = [], 0
    for ra, rb in zip(ref_first, q_first):
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


def quant_error(llm: LLM, ps: list[list[int]]) -> dict:
    """Why a scheme loses accuracy, on the K/V this model writes for ``ps`` (one batched
    prefill of a 16-bit-cache engine): per scheme, the relative RMS error of the round trip
    (quantize then dequantize, with scales from these same values, so no saturation) and
    the fraction of values that become 0; per layer, how far apart the heads' amax are and
    how far each head's amax is above its RMS (outliers inside a head, which per-head
    scales cannot help)."""
    import pagemill.runtime.model_executor.models.llama as llama
    from pagemill.kernels.kv_quant import dequantize, quantize

    got: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = llama.write_kv_cache

    def spy(k, v, *a, **kw):  # type: ignore[no-untyped-def]
        got.append((k.detach().float().clone(), v.detach().float().clone()))
        real(k, v, *a, **kw)

    llama.write_kv_cache = spy
    try:
        llm.generate(ps, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    finally:
        llama.write_kv_cache = real
    schemes = {
        "fp8 scale 1.0": (torch.float8_e4m3fn, None, None),
        "fp8 calc per tensor": (torch.float8_e4m3fn, (200.0, 100.0), False),
        "fp8 calc per head": (torch.float8_e4m3fn, (200.0, 100.0), True),
        "int8 per tensor": (torch.int8, (127.0, 127.0), False),
        "int8 per head": (torch.int8, (127.0, 127.0), True),
    }
    out: dict = {}
    torch.set_grad_enabled(False)
    got = [(k.clone(), v.clone()) for k, v in got]  # out of inference mode: plain tensors
    for name, (dtype, consts, per_head) in schemes.items():
        errs = {"k": [], "v": []}
        zeros = {"k": [], "v": []}
        for k, v in got:
            for which, x, c in (
                ("k", k, consts[0] if consts else 1.0),
                ("v", v, consts[1] if consts else 1.0),
            ):
                if consts is None:
                    scale = None
                elif per_head:
                    scale = x.abs().amax(dim=(0, 2)) / c
                else:
                    scale = x.abs().amax() / c
                back = dequantize(quantize(x, scale, dtype), scale, torch.float32)
                errs[which].append(float((back - x).norm() / x.norm()))
                zeros[which].append(float(((back == 0) & (x != 0)).float().mean()))
        out[name] = {f"{w}_rel_rms_err_mean": statistics.mean(errs[w]) for w in ("k", "v")} | {
            f"{w}_zeroed_mean": statistics.mean(zeros[w]) for w in ("k", "v")
        }
    spread, crest = {"k": [], "v": []}, {"k": [], "v": []}
    for k, v in got:
        for w, x in (("k", k), ("v", v)):
            amax = x.abs().amax(dim=(0, 2))
            rms = x.pow(2).mean(dim=(0, 2)).sqrt()
            spread[w].append(float(amax.max() / amax.min()))
            crest[w].append(float((amax / rms).median()))
    out["layers"] = {
        f"{w}_head_amax_max_over_min_median": statistics.median(spread[w]) for w in ("k", "v")
    } | {f"{w}_head_amax_over_rms_median": statistics.median(crest[w]) for w in ("k", "v")}
    return out


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
    ap.add_argument("--quant-error", action="store_true")
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
    if args.quant_error:
        res["quant_error"] = quant_error(ref, ps)
        print(json.dumps({"quant_error": res["quant_error"]}, indent=1), flush=True)
    ref_run = run(ref, ps, args.tokens)
    for spec in filter(None, args.kv.split(",")):
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
            **compare(ref_run, q, ps, args.tokens),
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
