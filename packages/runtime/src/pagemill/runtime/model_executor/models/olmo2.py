"""OLMo 2: norms after each block instead of before, and q/k norms over whole projections.

What differs from Llama, and where it lives:

* no ``input_layernorm``: a layer computes ``h = x + norm(attn(x))`` and then
  ``h + norm(mlp(h))`` (``post_attention_layernorm`` / ``post_feedforward_layernorm``),
  so the residual add follows the norm and is not fused into it;
* ``self_attn.q_norm`` / ``k_norm`` are RMSNorms over the whole q (``heads * head_dim``)
  and k projections, applied before the heads split and before RoPE — not per head as in
  Qwen3. Under tensor parallelism a rank holds some heads only, so the sum of squares is
  all-reduced (one exchange per layer for q and k together); a replicated KV head counts
  once per rank holding it, and so does its share of the element count, which cancels.
* every norm rounds as transformers' ``Olmo2RMSNorm`` does (the weight multiplies the
  fp32 value, one rounding at the end), unlike Llama's (rounded, then multiplied).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from pagemill.runtime.distributed.parallel_state import TensorParallelGroup
from pagemill.runtime.model_config import ModelConfig
from pagemill.runtime.model_executor.layers import Linear
from pagemill.runtime.model_executor.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
)
from pagemill.runtime.worker.attention_metadata import AttentionMetadata


def _normalize(
    h: torch.Tensor, variance: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    return (weight * (h * torch.rsqrt(variance + eps))).to(dtype)


class Olmo2RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return _normalize(h, h.pow(2).mean(-1, keepdim=True), self.weight, self.eps, x.dtype)


class Olmo2Attention(LlamaAttention):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        *,
        window: int = 0,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__(config, dtype, window=window, tp=tp)
        self.tp = tp
        self.q_proj_norm = Olmo2RMSNorm(self.q_size, config.rms_norm_eps, dtype)
        self.k_proj_norm = Olmo2RMSNorm(self.kv_size, config.rms_norm_eps, dtype)

    def _norm_projections(
        self, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tp is None:
            return self.q_proj_norm(q), self.k_proj_norm(k)
        hq, hk = q.float(), k.float()
        sums = torch.cat((hq.pow(2).sum(-1, keepdim=True), hk.pow(2).sum(-1, keepdim=True)), dim=-1)
        sums = self.tp.all_reduce(sums)
        n = self.tp.world_size
        var_q = sums[:, :1] / (hq.shape[-1] * n)
        var_k = sums[:, 1:] / (hk.shape[-1] * n)
        qn, kn = self.q_proj_norm, self.k_proj_norm
        return (
            _normalize(hq, var_q, qn.weight, qn.eps, q.dtype),
            _normalize(hk, var_k, kn.weight, kn.eps, k.dtype),
        )


class Olmo2DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        layer: int = 0,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Olmo2Attention(config, dtype, window=config.layer_window(layer), tp=tp)
        self.post_attention_layernorm = Olmo2RMSNorm(hidden, eps, dtype)
        self.mlp = LlamaMLP(config, dtype, tp=tp)
        self.post_feedforward_layernorm = Olmo2RMSNorm(hidden, eps, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # (x, residual) as every layer passes them: the hidden state is their sum.
        h = x if residual is None else x + residual
        h = h + self.post_attention_layernorm(self.self_attn(positions, h, cos_sin, meta))
        return self.post_feedforward_layernorm(self.mlp(h)), h


class Olmo2ForCausalLM(LlamaForCausalLM):
    layer_cls = Olmo2DecoderLayer

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        max_position: int,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__(config, dtype, max_position, tp)
        # The final norm rounds as OLMo 2's other norms do (and fuses no residual add).
        self.norm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)  # type: ignore[assignment]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        residual: torch.Tensor | None = None
        layers = self.layers
        for i in range(len(layers)):  # by index: see LlamaForCausalLM.forward
            x, residual = layers[i](positions, x, residual, self.cos_sin, meta)
        return cast(torch.Tensor, self.norm(x if residual is None else x + residual))

    def _targets(self) -> dict[str, list[tuple[torch.Tensor | Linear, int, int]]]:
        t = super()._targets()
        c = self.config
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, Olmo2DecoderLayer)  # layer_cls
            p = f"model.layers.{i}."
            a = layer.self_attn
            t[p + "self_attn.q_norm.weight"] = [(a.q_proj_norm.weight, 0, c.q_size)]
            t[p + "self_attn.k_norm.weight"] = [(a.k_proj_norm.weight, 0, c.kv_size)]
            t[p + "post_feedforward_layernorm.weight"] = [
                (layer.post_feedforward_layernorm.weight, 0, c.hidden_size)
            ]
        return t
