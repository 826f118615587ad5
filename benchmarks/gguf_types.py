"""Every GGUF quant type as pagemill serves it: bytes, logit error and decode step time.

No real K-quant files can be downloaded here, so a Llama-shaped model is written once per
type with random blocks (any bytes are valid blocks once their fp16 scales are finite; the
scales are chosen so that the weights have a typical spread): every matrix, embedding and
output included, in that type. Each type is measured in a fresh process:

- bytes: the file, the weights resident after loading (`weight_report`), and the process's
  RSS growth over `LLM(...)` (with --cpu-dense-weights never: packed weights only);
- logit error: the bf16 packed model against the same file dequantized exactly in fp32
  (which equals the `gguf` package's dequantization; see tests/test_gguf_kquants.py),
  max abs over the prompt's positions, and relative to the largest reference logit;
- decode step time with 1/16/64 requests decoding (`throughput.step_time_table`, eager).

    python benchmarks/gguf_types.py --json benchmarks/results/gguf-types-cpu.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

TYPES = (
    "F16",
    "Q8_0",
    "Q6_K",
    "Q5_K",
    "Q5_1",
    "Q5_0",
    "Q4_K",
    "Q4_1",
    "Q4_0",
    "IQ4_NL",
    "IQ4_XS",
    "Q3_K",
    "Q2_K",
    "IQ2_XXS",
)
# Byte offsets of each type's fp16 fields inside a block (llama.cpp's block structs).
FP16_FIELDS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "IQ4_NL": [0],
    "Q2_K": [80, 82],
    "Q3_K": [108],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
    "IQ4_XS": [0],
    "IQ2_XXS": [0],
}
WEIGHT_STD = 0.03


def _blocks(name: str, rows: int, k: int, rng: np.random.Generator, scale: float) -> np.ndarray:
    import gguf

    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    raw = rng.integers(0, 256, (rows, k // block, type_size), dtype=np.uint8)
    for at in FP16_FIELDS[name]:
        values = (rng.standard_normal((rows, k // block, 1)) * scale).astype(np.float16)
        raw[..., at : at + 2] = values.view(np.uint8)
    return raw.reshape(rows, -1)


def _tensor(writer: Any, name: str, qtype: str, rows: int, k: int, rng: np.random.Generator):
    import gguf

    if qtype == "F16":
        writer.add_tensor(name, (rng.standard_normal((rows, k)) * WEIGHT_STD).astype(np.float16))
        return
    t = gguf.GGMLQuantizationType[qtype]
    probe = _blocks(qtype, 4, k, np.random.default_rng(0), 1.0)
    std = float(gguf.quants.dequantize(probe, t).std())  # w is linear in the fp16 fields
    writer.add_tensor(name, _blocks(qtype, rows, k, rng, WEIGHT_STD / std), raw_dtype=t)


def write_model(path: Path, qtype: str, a: argparse.Namespace) -> Path:
    import gguf

    rng = np.random.default_rng(0)
    h, inter, head_dim = a.hidden, a.intermediate, a.hidden // a.heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(a.layers)
    w.add_context_length(2048)
    w.add_embedding_length(h)
    w.add_feed_forward_length(inter)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(a.vocab)
    ones = np.ones(h, dtype=np.float32)
    _tensor(w, "token_embd.weight", qtype, a.vocab, h, rng)
    w.add_tensor("output_norm.weight", ones)
    _tensor(w, "output.weight", qtype, a.vocab, h, rng)
    kv = a.kv_heads * head_dim
    for i in range(a.layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        for name, rows, k in (
            ("attn_q", h, h),
            ("attn_k", kv, h),
            ("attn_v", kv, h),
            ("attn_output", h, h),
            ("ffn_gate", inter, h),
            ("ffn_up", inter, h),
            ("ffn_down", h, inter),
        ):
            _tensor(w, f"blk.{i}.{name}.weight", qtype, rows, k, rng)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _prefill_logits(model: Any, config: Any, dtype: Any, prompt: list[int]) -> Any:
    """Logits at every position of one prompt through a fresh runner's paged KV cache."""
    import torch

    from pagemill.runtime import SamplingParams
    from pagemill.runtime.worker.model_runner import ModelRunner
    from pagemill.scheduler import Request, ScheduledRequest, SchedulerOutput

    runner = ModelRunner(model, config, torch.device("cpu"), dtype, 16, 8, 512, 512)
    runner.init_kv_cache(-(-len(prompt) // 16))
    record = Request("r", prompt, sampling_params=SamplingParams(temperature=0.0))
    blocks = list(range(-(-len(prompt) // 16)))
    sched = [ScheduledRequest("r", prompt, 0, len(prompt), blocks, True, True, record)]
    batch = runner.prepare(SchedulerOutput(sched, len(prompt), [], []))
    with torch.inference_mode():
        return model.compute_logits(model(batch.input_ids, batch.positions, batch.attn)).float()


def measure(path: Path, qtype: str, a: argparse.Namespace) -> dict[str, Any]:
    """In a fresh process: everything about one file."""
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from throughput import step_time_table

    from pagemill.runtime import LLM
    from pagemill.runtime.config import ModelConfig
    from pagemill.runtime.model_executor.loader import load_model
    from pagemill.runtime.model_executor.quantization import weight_report

    if a.threads:
        torch.set_num_threads(a.threads)
    before = _rss_bytes()
    llm = LLM(
        str(path),
        dtype="bfloat16",
        enforce_eager=True,
        cpu_dense_weights="never",
        kv_cache_memory_bytes=256 << 20,
        max_model_len=512,
    )
    rss = _rss_bytes() - before
    engine = llm.llm_engine
    model = engine.engine_core.model_runner.model
    report = weight_report(model)
    formats = dict(report.formats)
    step_args = SimpleNamespace(
        seed=0,
        step_max_tokens=256,
        step_batch_sizes=a.batch_sizes,
        step_context=32,
        step_iters=a.iters,
        step_rounds=1,
        device="cpu",
    )
    steps = step_time_table(llm, step_args, a.vocab)
    config = ModelConfig.from_pretrained(engine.model_path)
    prompt = torch.randint(3, a.vocab, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    got = _prefill_logits(model, config, torch.bfloat16, prompt)
    exact = load_model(engine.model_path, config, torch.float32, torch.device("cpu"), 512)
    want = _prefill_logits(exact, config, torch.float32, prompt)
    err = (got - want).abs()
    return {
        "type": qtype,
        "file_bytes": path.stat().st_size,
        "weights_resident_bytes": report.total_bytes,
        "rss_growth_bytes": rss,
        "formats": formats,
        "requantized": report.requantized,
        "logit_max_abs_err": float(err.max()),
        "logit_rel_err": float(err.max() / want.abs().max()),
        "argmax_agreement": float((got.argmax(-1) == want.argmax(-1)).float().mean()),
        "steps": {r["batch_size"]: r["step_ms"] for r in steps},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--one", nargs=2, default=None, help=argparse.SUPPRESS)  # type, file
    a = ap.parse_args(argv)
    if a.one is not None:
        print(json.dumps(measure(Path(a.one[1]), a.one[0], a)))
        return 0
    forwarded = [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(a).items()
        if k not in ("types", "json", "one") and v is not None
    ]
    rows = []
    sizes = a.batch_sizes.split(",")
    print(
        f"{'type':>8} {'file MB':>8} {'served MB':>9} {'x file':>6} {'RSS MB':>7} "
        f"{'logit err':>9} {'rel':>7} {'argmax':>6} "
        + " ".join(f"{'step@' + s + ' ms':>11}" for s in sizes)
        + "  served as"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for qtype in a.types.split(","):
            path = write_model(Path(tmp) / f"synthetic-{qtype}.gguf", qtype, a)
            out = subprocess.run(
                [sys.executable, __file__, *forwarded, "--one", qtype, str(path)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            row = json.loads(out.strip().splitlines()[-1])
            rows.append(row)
            formats = ", ".join(f"{n} {k}" for k, n in row["formats"].items())
            print(
                f"{qtype:>8} {row['file_bytes'] / 1e6:8.1f} "
                f"{row['weights_resident_bytes'] / 1e6:9.1f} "
                f"{row['weights_resident_bytes'] / row['file_bytes']:6.2f} "
                f"{row['rss_growth_bytes'] / 1e6:7.1f} {row['logit_max_abs_err']:9.4f} "
                f"{row['logit_rel_err']:7.2%} {row['argmax_agreement']:6.0%} "
                + " ".join(f"{row['steps'][s]:11.1f}" for s in sizes)
                + f"  {formats}",
                flush=True,
            )
            path.unlink()
    if a.json is not None:
        a.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
