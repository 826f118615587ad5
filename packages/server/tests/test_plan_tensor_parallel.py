"""`plan` / `simulate` with tensor parallelism: per-GPU weights and KV heads, and the
all-reduces per layer costed from the GPU's link bandwidth and latency."""

from __future__ import annotations

import argparse
import json

import pytest

from pagemill.server.sim.cost_model import RooflineCostModel
from pagemill.server.sim.hardware import Deployment
from pagemill.server.sim.plan import make_plan
from pagemill.server.sim.specs import GPUSpec, load_gpu, load_model


def test_every_shipped_gpu_has_link_data() -> None:
    for name in ("h100", "h200", "a100-80g", "l40s", "rtx-4090"):
        gpu = load_gpu(name)
        assert gpu.link_bandwidth_bytes_per_s and gpu.link_latency_s


def test_ring_all_reduce_cost() -> None:
    model, gpu = load_model("llama-3.1-8b"), load_gpu("h100")
    one = RooflineCostModel(model, gpu)
    two = RooflineCostModel(model, gpu, tensor_parallel_size=2)
    assert one.all_reduce_time_s(1e6) == 0.0
    # 2 ranks: 2 ring steps, each the latency plus half the bytes over the link.
    assert two.all_reduce_time_s(1e6) == pytest.approx(2 * (4e-6 + 0.5e6 / 450e9))
    # A decode step of 8 sequences: 2 all-reduces per layer + the embedding's, + the gather.
    step = two.decode_step(8, 1024)
    per = two.all_reduce_time_s(8 * model.hidden_size * 2)
    gather = 4e-6 + 8 * model.vocab_size / 2 * 4 / 450e9
    assert step.comm_time_s == pytest.approx((2 * model.num_layers + 1) * per + gather)
    assert step.time_s == pytest.approx(
        max(step.memory_time_s, step.compute_time_s) + step.comm_time_s
    )
    # Each GPU streams half the weights and reads half the KV heads.
    base = one.decode_step(8, 1024)
    assert step.weight_bytes == pytest.approx(base.weight_bytes / 2, rel=1e-9)
    assert two.kv_bytes_per_token * 2 == one.kv_bytes_per_token
    assert step.time_s < base.time_s


def test_kv_heads_replicated_beyond_their_count() -> None:
    model = load_model("llama-3.1-70b")  # 8 KV heads
    per_gpu = [
        RooflineCostModel(model, load_gpu("h100"), tensor_parallel_size=n).kv_bytes_per_token
        for n in (1, 8, 16)
    ]
    assert per_gpu[1] * 8 == per_gpu[0]
    assert per_gpu[2] == per_gpu[1]  # one KV head per GPU: replicated, not split further


def test_tp_that_does_not_divide_the_heads_is_refused() -> None:
    with pytest.raises(ValueError, match=r"does not divide Llama-3\.1-70B's 64 attention heads"):
        make_plan(load_model("llama-3.1-70b"), load_gpu("h100"), tensor_parallel_size=3)
    gpu = GPUSpec("mystery", 80 * 2**30, 3e12, 1e15)
    with pytest.raises(ValueError, match="no link_bandwidth_bytes_per_s"):
        RooflineCostModel(load_model("llama-3.1-8b"), gpu, tensor_parallel_size=2)


def test_70b_fits_on_two_h100s_not_one() -> None:
    model, gpu = load_model("llama-3.1-70b"), load_gpu("h100")
    assert not make_plan(model, gpu).fits
    plan = make_plan(model, gpu, tensor_parallel_size=2)
    assert plan.fits and plan.num_blocks > 0
    assert (
        plan.kv_budget_bytes
        == plan.usable_bytes - plan.rank_weight_bytes - plan.activation_reserve_bytes
    )


def _run(argv: list[str]) -> int:
    from pagemill.server.sim.cli import register

    parser = argparse.ArgumentParser(prog="pagemill")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_plan_and_simulate_take_the_flag(capsys, tmp_path) -> None:
    assert (
        _run(
            [
                "plan",
                "--model",
                "llama-3.1-70b",
                "--gpu",
                "h100",
                "-tp",
                "2",
                "--json",
                "--batch-sizes",
                "1,64",
            ]
        )
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    assert plan["tensor_parallel_size"] == 2 and plan["fits"]
    assert all(p["comm_time_s"] > 0 and p["all_reduce_s"] > 0 for p in plan["roofline"])
    assert (
        _run(["plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--tensor-parallel-size", "2"])
        == 0
    )
    out = capsys.readouterr().out
    assert "tensor parallel over 2 GPUs" in out and "all-reduce per layer (x2)" in out
    assert _run(["plan", "--model", "llama-3.1-70b", "-tp", "3"]) == 2
    assert (
        Deployment(
            load_model("smollm2-135m"), load_gpu("l40s"), tensor_parallel_size=3, max_model_len=512
        ).cost_model.tensor_parallel_size
        == 3
    )
    code = _run(
        [
            "simulate",
            "--model",
            "smollm2-135m",
            "--gpu",
            "l40s",
            "-tp",
            "3",
            "--num-blocks",
            "256",
            "--max-model-len",
            "512",
            "--num-requests",
            "12",
            "--prompt-len",
            "32",
            "--output-len",
            "8",
            "--experiments",
            "static",
            "--no-plots",
            "--out-dir",
            str(tmp_path),
        ]
    )
    assert code == 0
    assert "on 3 x L40S" in capsys.readouterr().out
