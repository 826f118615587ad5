"""`pagemill plan` / `pagemill simulate` through argparse, as the main CLI mounts them."""

from __future__ import annotations

import argparse
import json

import pytest

from pagemill.server.sim.cli import register


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pagemill")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_plan_text(capsys) -> None:
    assert run(["plan", "--model", "llama-3.1-8b", "--gpu", "h200"]) == 0
    out = capsys.readouterr().out
    assert "131,072" in out
    assert "3.35 ms" in out
    assert "crossover batch (weights only)     206" in out


def test_plan_json_and_plot(capsys, tmp_path) -> None:
    png = tmp_path / "roofline.png"
    code = run(
        [
            "plan",
            "--model",
            "smollm2-135m",
            "--gpu",
            "rtx-4090",
            "--json",
            "--context-len",
            "2048",
            "--batch-sizes",
            "1,8,64",
            "--plot",
            str(png),
            "--activation-reserve-gib",
            "4",
        ]
    )
    assert code == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2
    assert plan["max_concurrent_seqs"] == plan["num_blocks"] // (2048 // 16)
    assert [p["batch_size"] for p in plan["roofline"]] == [1, 8, 64]
    assert plan["activation_reserve_bytes"] == 4 * 1024**3
    assert plan["kv_budget_bytes"] == plan["usable_bytes"] - plan["weight_bytes"] - 4 * 1024**3
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_counts_fp8_kv_blocks(capsys) -> None:
    """--kv-cache-dtype fp8 (the engine's spelling): half the bytes per token, twice the
    blocks in the same KV budget."""
    base = ["plan", "--model", "smollm2-135m", "--gpu", "rtx-4090", "--json"]
    assert run(base) == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert run([*base, "--kv-cache-dtype", "fp8_e5m2"]) == 0
    fp8 = json.loads(capsys.readouterr().out)
    assert fp8["kv_bytes_per_token"] * 2 == bf16["kv_bytes_per_token"]
    assert fp8["kv_budget_bytes"] == bf16["kv_budget_bytes"]
    assert fp8["num_blocks"] in (2 * bf16["num_blocks"], 2 * bf16["num_blocks"] + 1)


def test_plan_list_and_errors(capsys) -> None:
    assert run(["plan", "--list"]) == 0
    assert "llama-3.1-70b" in capsys.readouterr().out
    assert run(["plan", "--model", "nope"]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert run(["plan", "--kv-dtype", "int3"]) == 2
    assert run(["plan", "--model", "smollm2-135m", "--context-len", "100000"]) == 2
    assert "exceeds" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run(["plan", "--batch-sizes", "1,x"])


def test_simulate_small(capsys, tmp_path) -> None:
    code = run(
        [
            "simulate",
            "--model",
            "smollm2-135m",
            "--gpu",
            "rtx-4090",
            "--num-blocks",
            "512",
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "16",
            "--max-num-batched-tokens",
            "256",
            "--num-requests",
            "24",
            "--prompt-len",
            "64",
            "--output-len",
            "16",
            "--system-prompt-len",
            "128",
            "--budgets",
            "64,256",
            "--request-rate",
            "200",
            "--out-dir",
            str(tmp_path),
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    for title in ("static batching", "prefix caching off vs on", "token budget"):
        assert title in out
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results) == {"static", "prefix", "budget"}
    assert len(results["static"]["runs"]) == 4
    assert len(results["budget"]["runs"]) == 3
    for key in results:
        assert (tmp_path / f"{key}.png").stat().st_size > 1000


def test_simulate_errors(capsys, tmp_path) -> None:
    # A 70B model in bf16 leaves no room for KV on one H100.
    assert (
        run(["simulate", "--model", "llama-3.1-70b", "--gpu", "h100", "--out-dir", str(tmp_path)])
        == 2
    )
    assert "no memory for the KV cache" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run(["simulate", "--experiments", "static,bogus"])
