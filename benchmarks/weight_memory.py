"""How much memory a model's weights take in a fresh process, against the file's size.

Each measurement runs in a new Python process: RSS is read after the imports, then after
`load_model` has loaded the weights (the weights alone), or after `LLM(model, ...)` has
started (a small KV pool, eager: no compiled graph; the whole engine), and the growth is
compared with the size of the model's file (the GGUF for a .gguf or the default model).
Two rows per --cpu-dense-weights value:

    python benchmarks/weight_memory.py                       # the default model
    python benchmarks/weight_memory.py --model path/to/model.gguf --modes never,always
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def measure(model: str, mode: str, dtype: str, what: str) -> dict[str, Any]:
    """In this process (call it in a fresh one): RSS growth of loading `model`'s weights
    (`what` "load": `load_model` alone) or of a whole engine ("llm": `LLM(...)`, which adds
    the tokenizer, the engine's own buffers and helper processes' pipes)."""
    import torch

    from pagemill.runtime import LLM
    from pagemill.runtime.config import ModelConfig
    from pagemill.runtime.model_executor.loader import load_model, resolve_model_path
    from pagemill.runtime.model_executor.model_source import gguf_for_folder
    from pagemill.runtime.model_executor.quantization import weight_report

    path = resolve_model_path(model)
    config = ModelConfig.from_pretrained(path)
    before = _rss_bytes()
    if what == "load":
        torch_dtype = getattr(torch, dtype)
        loaded = load_model(
            path, config, torch_dtype, torch.device("cpu"), 256, cpu_dense_weights=mode
        )
    else:
        llm = LLM(
            model,
            dtype=dtype,
            enforce_eager=True,
            kv_cache_memory_bytes=8 << 20,
            max_model_len=256,
            cpu_dense_weights=mode,
        )
        loaded = llm.llm_engine.engine_core.model_runner.model
    after = _rss_bytes()
    gguf = gguf_for_folder(path)
    report = weight_report(loaded)
    file_bytes = gguf.stat().st_size if gguf is not None else 0
    return {
        "mode": mode,
        "what": what,
        "file": str(gguf) if gguf is not None else None,
        "file_bytes": file_bytes,
        "rss_growth_bytes": after - before,
        "ratio": (after - before) / file_bytes if file_bytes else None,
        "weights_resident_bytes": report.total_bytes,
        "dense_copy_bytes": report.dense_copy_bytes,
        "weights": report.summary(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--modes", default="never,auto,always")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--one", nargs=2, default=None, help=argparse.SUPPRESS)  # mode, what
    args = ap.parse_args(argv)
    if args.one is not None:
        print(json.dumps(measure(args.model, args.one[0], args.dtype, args.one[1])))
        return 0
    rows = []
    for mode in args.modes.split(","):
        for what in ("load", "llm"):
            cmd = [sys.executable, __file__, "--model", args.model, "--dtype", args.dtype]
            out = subprocess.run(
                [*cmd, "--one", mode, what], check=True, capture_output=True, text=True
            ).stdout
            row = json.loads(out.strip().splitlines()[-1])
            rows.append(row)
            ratio = f"{row['ratio']:.2f}x the file" if row["ratio"] else ""
            print(
                f"{mode:>6} {what:>4}: RSS +{row['rss_growth_bytes'] / 1e6:7.1f} MB {ratio} "
                f"(file {row['file_bytes'] / 1e6:.1f} MB; weights {row['weights']})"
            )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
