"""The weight cache against packing the GGUF: loading the default model, both ways, alternated.

In one process, `load_model` runs with the weight cache off (read and pack the file) and
on (fill the model from the cache's safetensors), in turns (A B B A ...), on one torch
thread, timing each with the thread's CPU clock, so a loaded machine slows both alike.
The first load with the cache on writes its entry (untimed).

    python benchmarks/weight_cache.py                 # 4 pairs
    python benchmarks/weight_cache.py --pairs 8 --cpu-dense-weights never

Figures are printed; nothing is asserted.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch

from pagemill.runtime.model_config import ModelConfig
from pagemill.runtime.model_executor.default_model import ensure_default_model
from pagemill.runtime.model_executor.loader import load_model
from pagemill.runtime.model_executor.weight_cache import WEIGHT_CACHE_ENV


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--cpu-dense-weights", default="auto", choices=["auto", "always", "never"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    folder = ensure_default_model()
    config = ModelConfig.from_pretrained(folder)

    def load(cache: bool) -> float:
        os.environ[WEIGHT_CACHE_ENV] = "1" if cache else "0"
        start = time.thread_time()
        model = load_model(
            folder,
            config,
            torch.bfloat16,
            torch.device("cpu"),
            max_position=2048,
            cpu_dense_weights=args.cpu_dense_weights,
        )
        seconds = time.thread_time() - start
        del model
        gc.collect()
        return seconds

    load(True)  # writes the entry if there is none
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(args.pairs):
        for cache in (False, True) if i % 2 == 0 else (True, False):
            times[cache].append(load(cache))
    ratios = [c / p for p, c in zip(times[False], times[True])]
    print(f"load average {os.getloadavg()}")
    for cache, name in ((False, "pack the GGUF"), (True, "weight cache")):
        print(f"{name:14s}: median {statistics.median(times[cache]):.2f} CPU s {times[cache]}")
    print(f"cache / pack: median ratio {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
