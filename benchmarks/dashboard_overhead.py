"""What the dashboard costs the engine: µs per step, unwatched and watched, vs the step itself.

Three measurements, printed (nothing asserted):

1. A real engine decoding a batch (a tiny random Llama by default, `--model PATH` for
   another) with the dashboard's tap in its loop, as the engine process runs it: the step
   time; the tap's cost per step while nobody watches (one read of the shared watcher
   count); the cost of one picture (snapshot + pickle, as sent over the pipe); and the
   cost per step averaged over a run watched at the default rate (one picture per 0.25 s).
   With `--no-engine-process` the hub also folds each step into the charts on the engine
   thread (with an engine process that happens in the API process): that is timed too.
2. Pictures of big pools (the real scheduler and block pool, full, no model): how the
   cost and size grow with the number of blocks, so a GPU-sized pool can be judged.
3. The page's payload: the bytes a browser loads once (HTML, script, style, uPlot).

    .venv/bin/python benchmarks/dashboard_overhead.py
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import os
import pickle
import statistics
import tempfile
import time
from importlib import resources
from pathlib import Path

os.environ.setdefault("PAGEMILL_ENFORCE_EAGER", "1")


def build_tiny_llama(folder: Path) -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        ["the quick brown fox jumps over the lazy dog"] * 8,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<eos>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.save_pretrained(str(folder))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=fast.eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(config).eval().save_pretrained(str(folder))


def engine_run(model: str, batch: int, tokens: int, interval: float) -> dict[str, float]:
    from pagemill.runtime import LLMEngine, SamplingParams
    from pagemill.server.dashboard import (
        DashboardHub,
        DashboardSettings,
        LocalWatchers,
        SnapshotTap,
    )

    engine = LLMEngine(
        model=model, device="cpu", max_model_len=2048, kv_cache_memory_bytes=64 << 20
    )
    watchers = LocalWatchers()
    tap = SnapshotTap(DashboardSettings(interval), watchers)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0)

    def run(watched: bool, every_step: bool = False) -> dict[str, list[float]]:
        for i in range(batch):
            engine.add_request(
                f"r{watched}{every_step}{i}", "the quick brown fox " * (4 + i), params
            )
        watchers.value = 1 if watched else 0
        tap.interval = 0.0 if every_step else interval
        steps, taps, pictures = [], [], []
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            t1 = time.perf_counter()
            snap = tap.poll(engine)
            if snap is not None:
                pickle.dumps(("dashboard", snap), protocol=pickle.HIGHEST_PROTOCOL)
            t2 = time.perf_counter()
            steps.append(t1 - t0)
            taps.append(t2 - t1)
            if snap is not None:
                pictures.append(t2 - t1)
        return {"steps": steps, "taps": taps, "pictures": pictures}

    run(False)  # warm-up
    idle = run(False)
    # In-process: the hub as the engine thread's observer (charts + its own tap), unwatched.
    from pagemill.server.metrics import EngineMetrics

    hub = DashboardHub(DashboardSettings(interval))
    hub.attach(object())
    metrics = EngineMetrics("bench")
    prometheus = []
    for i in range(batch):
        engine.add_request(f"h{i}", "the quick brown fox " * (4 + i), params)
    observe = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        metrics.on_step(engine, t1 - t0)  # what every server already does per step
        t2 = time.perf_counter()
        hub.on_step(engine, t1 - t0)
        observe.append(time.perf_counter() - t2)
        prometheus.append(t2 - t1)
    watched = run(True)
    each = run(True, every_step=True)
    snap = tap.take(engine)
    return {
        "step_ms": 1e3 * statistics.median(idle["steps"]),
        "num_blocks": engine.num_blocks,
        "unwatched_us_per_step": 1e6 * statistics.mean(idle["taps"]),
        "in_process_observer_us": 1e6 * statistics.median(observe),
        "in_process_observer_mean_us": 1e6 * statistics.mean(observe),
        "prometheus_us": 1e6 * statistics.median(prometheus),
        "picture_us": 1e6 * statistics.median(each["pictures"]),
        "watched_us_per_step": 1e6 * statistics.mean(watched["taps"]),
        "watched_pictures": len(watched["pictures"]),
        "watched_steps": len(watched["steps"]),
        "picture_bytes": len(json.dumps(snap)) if snap else 0,
    }


def big_pool(num_blocks: int, running: int, context: int) -> dict[str, float]:
    from pagemill.blockpool import KVCacheManager
    from pagemill.scheduler import Request, Scheduler
    from pagemill.scheduler.config import SchedulerConfig
    from pagemill.server.dashboard import snapshot_scheduler

    kv = KVCacheManager(num_blocks, 16, enable_caching=True)
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=1 << 20, max_num_seqs=running, max_model_len=context + 16
        ),
        kv,
    )
    for i in range(running):
        sched.add_request(
            Request(f"req-{i}", [1 + (i * 7 + j) % 30000 for j in range(context)], max_tokens=8)
        )
    sched.schedule()
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        snap = snapshot_scheduler(sched)
        data = pickle.dumps(snap, protocol=pickle.HIGHEST_PROTOCOL)
        times.append(time.perf_counter() - t0)
    text = json.dumps(snap)
    return {
        "blocks": num_blocks,
        "in_use": snap["in_use"],
        "running": len(snap["running"]),
        "picture_us": 1e6 * statistics.median(times),
        "pickle_bytes": len(data),
        "json_bytes": len(text),
        "gzip_bytes": len(gzip.compress(text.encode())),
    }


def page_payload() -> dict[str, int]:
    static = resources.files("pagemill.server.dashboard").joinpath("static")
    names = [
        "index.html",
        "dashboard.js",
        "dashboard.css",
        "vendor/uPlot.iife.min.js",
        "vendor/uPlot.min.css",
    ]
    raw = {n: static.joinpath(n).read_bytes() for n in names}
    return {
        "bytes": sum(len(b) for b in raw.values()),
        "gzip_bytes": sum(len(gzip.compress(b)) for b in raw.values()),
        "uplot_bytes": len(raw["vendor/uPlot.iife.min.js"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: a tiny random Llama)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--interval", type=float, default=0.25)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            build_tiny_llama(Path(tmp))
            model = tmp
        r = engine_run(model, args.batch, args.tokens, args.interval)
    print(
        f"engine: batch {args.batch}, {r['num_blocks']} blocks, median step "
        f"{r['step_ms']:.2f} ms ({multiprocessing.cpu_count()} CPUs)"
    )
    print(f"  unwatched: {r['unwatched_us_per_step']:.2f} µs per step (the watcher check)")
    print(
        f"  --no-engine-process, unwatched: {r['in_process_observer_us']:.1f} µs per step "
        f"(median; mean {r['in_process_observer_mean_us']:.1f}: charts folded on the engine "
        f"thread + the watcher check); Prometheus metrics, for scale: "
        f"{r['prometheus_us']:.1f} µs"
    )
    print(
        f"  one picture (snapshot + pickle): {r['picture_us']:.0f} µs, "
        f"{r['picture_bytes']:,} bytes of JSON"
    )
    print(
        f"  watched, one picture per {args.interval:g} s: {r['watched_us_per_step']:.1f} µs "
        f"per step on average ({r['watched_pictures']} pictures in {r['watched_steps']} steps)"
        f" = {100 * r['watched_us_per_step'] / (1e3 * r['step_ms']):.2f}% of a step"
    )
    steady = r["picture_us"] * min(1.0, 1e-3 * r["step_ms"] / args.interval)
    print(
        f"  steady state (one picture per {args.interval:g} s of steps): {steady:.1f} µs per "
        f"step = {100 * steady / (1e3 * r['step_ms']):.2f}% of a step"
    )
    print("big pools (full, no model): blocks, in use, running, µs per picture, pickle, JSON, gzip")
    for blocks, running, context in ((4096, 64, 1000), (16384, 128, 2000), (65536, 256, 4000)):
        b = big_pool(blocks, running, context)
        print(
            f"  {b['blocks']:>6} {b['in_use']:>6} {b['running']:>4} "
            f"{b['picture_us']:>9.0f} µs {b['pickle_bytes']:>9,} B {b['json_bytes']:>9,} B "
            f"{b['gzip_bytes']:>8,} B"
        )
    p = page_payload()
    print(
        f"page: {p['bytes']:,} bytes ({p['gzip_bytes']:,} gzipped), of which uPlot "
        f"{p['uplot_bytes']:,}"
    )


if __name__ == "__main__":
    main()
