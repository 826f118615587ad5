"""benchmarks/gpu_check.py's pieces that need no GPU: the dummy model folder and the merge.

The whole script is exercised on CPU by `benchmarks/gpu_check.sh --cpu` (about two
minutes, so not here); these checks keep its arithmetic and its model folder honest, since
the script is the first thing a GPU session runs and a mistake there costs device time.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dummy_model_folder(gpu_check, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    folder = gpu_check.make_model_dir("tiny", tmp_path / "tiny")
    config = AutoConfig.from_pretrained(folder)
    assert config.architectures == ["LlamaForCausalLM"] and config.vocab_size == 512
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.decode([5, 7]) == "w5 w7" and tok.eos_token_id == 2
    big = json.loads(json.dumps(gpu_check.LLAMA_31_8B))
    assert (big["hidden_size"], big["num_key_value_heads"], big["vocab_size"]) == (4096, 8, 128256)


def test_merge_step_table_and_targets(gpu_check, tmp_path: Path) -> None:
    weight_bytes, stream_s, kv_per_token = 16e9, 3.35e-3, 131072
    plan = {
        "weight_bytes": weight_bytes,
        "weight_stream_time_s": stream_s,
        "kv_bytes_per_token": kv_per_token,
        "roofline": [
            {"batch_size": n, "weights_only_step_time_s": stream_s} for n in (1, 128, 256)
        ],
    }
    rows = [
        {"batch_size": n, "step_ms": ms, "mean_context": 200.0}
        for n, ms in ((1, 3.6), (128, 4.5), (256, 9.0))
    ]
    eager = {"device": "cuda", "rows": [dict(r, step_ms=r["step_ms"] * 2) for r in rows]}
    files = {
        "plan": plan,
        "steps-eager": eager,
        "steps-graphs": {"device": "cuda", "rows": rows},
        "kernels": {"summary": {"decode_of_copy": 0.75}},
    }
    for name, data in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    (tmp_path / "stages.jsonl").write_text('{"stage": "plan", "rc": 0, "seconds": 1}\n')
    assert gpu_check.main(["merge", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    table = {r["batch_size"]: r for r in result["decode_step_table"]}
    assert table[1]["graphs_over_roofline"] == pytest.approx(3.6 / 3.35)
    kv_ms = 128 * 200 * kv_per_token / (weight_bytes / stream_s) * 1e3
    assert table[128]["roofline_with_kv_ms"] == pytest.approx(3.35 + kv_ms)
    assert table[128]["eager_ms"] == pytest.approx(9.0)
    assert table[128]["graphs_speedup"] == pytest.approx(2.0)
    targets = result["targets"]
    worst = max(3.6 / 3.35, 4.5 / 3.35)  # batch 256 is past the target's range
    assert targets["decode_step_graphs_over_roofline_le_1.25_up_to_128"] == {
        "worst": pytest.approx(worst),
        "met": False,
    }
    assert targets["decode_attention_ge_70pct_of_copy"]["met"] is True
    assert not math.isnan(table[256]["roofline_with_kv_ms"])
