"""Granite 3 (dense): the Llama layer with four scalar multipliers from its config.

``embedding_multiplier`` scales the token embeddings, ``residual_multiplier`` each
attention and MLP output before it joins the residual stream, ``attention_multiplier``
replaces ``head_dim ** -0.5`` as the score scale, and the logits are divided by
``logits_scaling``. The residual scaling is applied to the branch output, so the norms'
fused residual add (see `LlamaDecoderLayer`) stays as it is.
"""

from __future__ import annotations

import torch

from pagemill.runtime.distributed.parallel_state import TensorParallelGroup
from pagemill.runtime.model_config import ModelConfig
from pagemill.runtime.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from pagemill.runtime.worker.attention_metadata import AttentionMetadata


def _multiplier(config: ModelConfig, key: str) -> float:
    return float(config.hf_config.get(key, 1.0) or 1.0)


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        layer: int = 0,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__(config, dtype, layer, tp)
        self.self_attn.scale = _multiplier(config, "attention_multiplier")
        self.residual_multiplier = _multiplier(config, "residual_multiplier")

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, cos_sin, meta) * self.residual_multiplier
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x) * self.residual_multiplier, residual


class GraniteForCausalLM(LlamaForCausalLM):
    layer_cls = GraniteDecoderLayer

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        max_position: int,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__(config, dtype, max_position, tp)
        self.embedding_multiplier = _multiplier(config, "embedding_multiplier")
        self.logits_scaling = _multiplier(config, "logits_scaling")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.logits_scaling
