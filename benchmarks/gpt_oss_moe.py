"""gpt-oss-20b's MoE layer: pagemill's block against transformers' eager one, same weights.

    python benchmarks/gpt_oss_moe.py                 # CPU, bf16, batch 1 and 16
    python benchmarks/gpt_oss_moe.py --device cuda --batch-sizes 1,64

One sparse layer with gpt-oss-20b's shapes (hidden 2880, 32 experts, top-4, expert
intermediate 2880, biases, clamped SwiGLU; random weights) as `GptOssMoeBlock` and as
transformers' `GptOssMLP` (``experts_implementation="eager"``), loaded from the same
tensors through the checkpoint-layout conversion. Printed per batch size: median step
time of each, the floor (the bytes of every expert some token picked plus the router) and
that floor over pagemill's time, and pagemill's relative error against transformers.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

H, E, K, INTER = 2880, 32, 4, 2880


def build(dtype: torch.dtype, device: torch.device):
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    from pagemill.runtime.model_config import ModelConfig
    from pagemill.runtime.model_executor.models.gpt_oss import GptOssMoeBlock, stacked_experts

    config = transformers.GptOssConfig(
        hidden_size=H,
        intermediate_size=INTER,
        num_local_experts=E,
        num_experts_per_tok=K,
        num_hidden_layers=1,
        experts_implementation="eager",
    )
    torch.manual_seed(0)
    with torch.device(device):
        hf = GptOssMLP(config).to(dtype).eval()
        with torch.no_grad():
            for p in hf.parameters():
                p.normal_(0, 0.02)
        raw = dict(
            architectures=["GptOssForCausalLM"],
            model_type="gpt_oss",
            vocab_size=8,
            hidden_size=H,
            intermediate_size=INTER,
            num_hidden_layers=1,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            num_local_experts=E,
            num_experts_per_tok=K,
        )
        ours = GptOssMoeBlock(ModelConfig.from_dict(raw), dtype)
    names = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    got = dict(
        stacked_experts((f".mlp.experts.{n}", getattr(hf.experts, n).detach()) for n in names)
    )
    e = ours.experts
    assert e.w13_bias is not None and e.w2_bias is not None
    with torch.no_grad():
        ours.router_weight.copy_(hf.router.weight)
        ours.router_bias.copy_(hf.router.bias)
        e.w13_weight.copy_(got[".mlp.experts.gate_up_proj"])
        e.w13_bias.copy_(got[".mlp.experts.gate_up_proj_bias"])
        e.w2_weight.copy_(got[".mlp.experts.down_proj"])
        e.w2_bias.copy_(got[".mlp.experts.down_proj_bias"])
    return ours, hf


def timed(fn, device: torch.device, iters: int) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    fn()
    fn()
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    device, dtype = torch.device(args.device), torch.bfloat16
    ours, hf = build(dtype, device)
    print(f"device {device}, threads {torch.get_num_threads()}, bf16")
    for b in (int(s) for s in args.batch_sizes.split(",")):
        x = torch.randn(b, H, device=device).to(dtype)
        with torch.no_grad():
            ref, out = hf(x[None])[0][0], ours(x)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            logits = torch.nn.functional.linear(x, hf.router.weight, hf.router.bias)
            picked = torch.topk(logits, K).indices.unique().numel()
            floor = (picked * 3 * H * INTER + E * H) * 2
            t_ours = timed(lambda x=x: ours(x), device, args.iters)
            t_hf = timed(lambda x=x: hf(x[None]), device, args.iters)
        print(
            f"batch {b}: pagemill {t_ours * 1e3:.1f} ms, transformers eager {t_hf * 1e3:.1f} ms "
            f"({t_hf / t_ours:.2f}x); floor {floor / 1e6:.0f} MB ({picked} experts) = "
            f"{floor / t_ours / 1e9:.1f} GB/s at pagemill's time; rel err {err:.1e}"
        )


if __name__ == "__main__":
    main()
