"""gpt-oss (``GptOssForCausalLM``): the Llama layer with attention sinks and gpt-oss's experts.

What differs from Llama, and where it lives:

* attention sinks — one learned logit per query head (``self_attn.sinks``) in every
  softmax's denominator — are the attention op's optional ``sinks`` (fp32, so the kernels
  read them without a cast); q/k/v and o carry biases (``attention_bias``);
* layers alternate sliding-window (``sliding_window``, 128 keys) and full attention as
  ``layer_types`` lists them (`ModelConfig.layer_window`); RoPE is YaRN;
* every MLP is sparse: the router (``mlp.router``, with a bias) takes the top-k *logits*
  and softmaxes over them; the experts carry biases and use the clamped SwiGLU
  ``(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``
  (``swiglu_alpha`` / ``swiglu_limit``; the fused op's ``"swigluoai"``).

The checkpoint stores each layer's experts stacked and transposed against ours:
``experts.gate_up_proj`` [E, H, 2I] with gate and up *interleaved* along the last axis
(gate columns even, up odd), ``gate_up_proj_bias`` [E, 2I] interleaved alike,
``down_proj`` [E, I, H] and ``down_proj_bias`` [E, H]. They are transposed and
de-interleaved into `FusedMoE`'s [E, 2I, H] (gate rows, then up rows) / [E, H, I] as they
load. The released checkpoints hold the experts in MXFP4 (``*_blocks`` + ``*_scales``);
`quantization.mxfp4` dequantizes them into these same dense tensors first, so the model
(and tensor parallelism's cut, which takes contiguous pairs of the interleaved axis) sees
one format.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pagemill.runtime.distributed.parallel_state import TensorParallelGroup
from pagemill.runtime.model_config import ModelConfig
from pagemill.runtime.model_executor.layers import Linear
from pagemill.runtime.model_executor.layers.fused_moe import FusedMoE
from pagemill.runtime.model_executor.models.llama import LlamaDecoderLayer
from pagemill.runtime.model_executor.models.qwen_moe import MoeForCausalLM, spec_of
from pagemill.runtime.model_executor.quantization.formats import QuantizedRows


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class GptOssMoeBlock(nn.Module):
    """Router (weight + bias) and the routed experts, all-reduced once under tensor
    parallelism (the router is replicated, so every rank routes identically)."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallelGroup | None = None
    ) -> None:
        super().__init__()
        spec = spec_of(config)
        hf = config.hf_config
        n = 1 if tp is None else tp.world_size
        self.tp = tp
        self.router_weight = _param(spec.num_experts, config.hidden_size, dtype=dtype)
        self.router_bias = _param(spec.num_experts, dtype=dtype)
        self.experts = FusedMoE(
            spec.num_experts,
            spec.top_k,
            config.hidden_size,
            spec.intermediate_size // n,
            True,
            dtype,
            bias=True,
            activation="swigluoai",
            swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
            topk_first=True,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, F.linear(x, self.router_weight, self.router_bias))
        return out if self.tp is None else self.tp.all_reduce(out)


class GptOssDecoderLayer(LlamaDecoderLayer):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        layer: int = 0,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__(config, dtype, layer, tp)
        # fp32 whatever the model dtype: the kernels add them to fp32 scores.
        self.self_attn.sinks = _param(config.num_attention_heads, dtype=torch.float32)

    def _make_mlp(
        self, config: ModelConfig, dtype: torch.dtype, layer: int, tp: TensorParallelGroup | None
    ) -> nn.Module:
        return GptOssMoeBlock(config, dtype, tp)


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[..., 2I] with gate/up alternating -> [..., gate (I) | up (I)]."""
    return torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)


def stacked_experts(
    weights: Iterable[tuple[str, torch.Tensor | QuantizedRows]],
) -> Iterator[tuple[str, torch.Tensor | QuantizedRows]]:
    """The checkpoint's stacked expert tensors in `FusedMoE`'s layout (see the module doc)."""
    for name, t in weights:
        if ".mlp.experts." in name and isinstance(t, torch.Tensor):
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "gate_up_proj":  # [E, H, 2I] -> [E, 2I, H], gate rows then up rows
                t = _deinterleave(t).transpose(1, 2)
            elif leaf == "gate_up_proj_bias":
                t = _deinterleave(t)
            elif leaf == "down_proj":  # [E, I, H] -> [E, H, I]
                t = t.transpose(1, 2)
        yield name, t


class GptOssForCausalLM(MoeForCausalLM):
    layer_cls = GptOssDecoderLayer

    def _targets(self) -> dict[str, list[tuple[torch.Tensor | Linear, int, int]]]:
        t = super()._targets()
        heads = self.config.num_attention_heads
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, GptOssDecoderLayer)  # layer_cls
            a, m = layer.self_attn, layer.mlp
            assert a.sinks is not None and isinstance(m, GptOssMoeBlock)
            e = m.experts
            assert e.w13_bias is not None and e.w2_bias is not None
            num = e.num_experts
            p = f"model.layers.{i}."
            t[p + "self_attn.sinks"] = [(a.sinks, 0, heads)]
            t[p + "mlp.router.weight"] = [(m.router_weight, 0, num)]
            t[p + "mlp.router.bias"] = [(m.router_bias, 0, num)]
            t[p + "mlp.experts.gate_up_proj"] = [(e.w13_weight, 0, num)]
            t[p + "mlp.experts.gate_up_proj_bias"] = [(e.w13_bias, 0, num)]
            t[p + "mlp.experts.down_proj"] = [(e.w2_weight, 0, num)]
            t[p + "mlp.experts.down_proj_bias"] = [(e.w2_bias, 0, num)]
        return t

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedRows]]) -> None:
        super().load_weights(stacked_experts(weights))
