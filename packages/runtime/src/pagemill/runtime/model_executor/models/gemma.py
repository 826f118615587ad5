"""Gemma 2 and Gemma 3 (text): their own decoder layer on the shared attention and MLP.

What differs from Llama, and where it lives:

* four norms per layer — after attention and around the MLP (``pre_feedforward`` /
  ``post_feedforward``) — each ``x * (1 + w)``: the checkpoint stores ``w``, the loader
  stores ``1 + w`` so the shared RMSNorm kernel applies it unchanged;
* embeddings scaled by ``sqrt(hidden_size)`` (rounded to the model dtype, as transformers
  does); GeGLU (tanh-GELU gate) instead of SwiGLU;
* scores scaled by ``query_pre_attn_scalar ** -0.5`` rather than ``head_dim ** -0.5``;
* sliding-window layers alternating with global ones (``config.layer_types``: Gemma 2
  every other layer, Gemma 3 five in six), the window going to the attention op per layer;
* Gemma 2 soft-caps attention scores (``attn_logit_softcapping``) and final logits
  (``final_logit_softcapping``); Gemma 3 instead normalises q and k per head and gives its
  sliding layers their own RoPE base (``rope_local_base_freq``, 10k vs 1M).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pagemill.kernels import gelu_tanh_and_mul, rope_cos_sin
from pagemill.runtime.distributed.parallel_state import TensorParallelGroup
from pagemill.runtime.model_config import SLIDING, ModelConfig
from pagemill.runtime.model_executor.layers import Linear
from pagemill.runtime.model_executor.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    RMSNorm,
)
from pagemill.runtime.model_executor.quantization.formats import QuantizedRows, dequantize
from pagemill.runtime.worker.attention_metadata import AttentionMetadata

_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu")


class GemmaDecoderLayer(torch.nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        layer: int = 0,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        hf = config.hf_config
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in _GELU_TANH:
            raise ValueError(
                f"unsupported Gemma activation {act!r}; pagemill serves "
                f"{', '.join(_GELU_TANH)} (as tanh-approximated GELU)"
            )
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.is_sliding = config.layer_window(layer) > 0
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.self_attn = LlamaAttention(
            config,
            dtype,
            window=config.layer_window(layer),
            softcap=float(hf.get("attn_logit_softcapping") or 0.0),
            scale=float(hf.get("query_pre_attn_scalar") or config.head_dim) ** -0.5,
            qk_norm=config.model_type == "gemma3_text",
            tp=tp,
        )
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, dtype)
        self.mlp = LlamaMLP(config, dtype, gelu_tanh_and_mul, tp=tp)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Each residual add is fused into the norm that follows it, as in the Llama layer.
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, cos_sin, meta)
        x = self.post_attention_layernorm(x)
        x, residual = self.pre_feedforward_layernorm(x, residual)
        x = self.post_feedforward_layernorm(self.mlp(x))
        return x, residual


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 (``Gemma2ForCausalLM``) and Gemma 3 text (``Gemma3ForCausalLM``)."""

    layer_cls = GemmaDecoderLayer

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        max_position: int,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__(config, dtype, max_position, tp)
        self.final_softcap = float(config.hf_config.get("final_logit_softcapping") or 0.0)
        # sqrt(hidden) rounded to the model dtype first, as transformers scales.
        self.embed_scale = float(torch.tensor(config.hidden_size**0.5, dtype=dtype))
        theta, scaling = config.rope_for(SLIDING)
        self.register_buffer(
            "cos_sin_local",
            rope_cos_sin(
                config.rotary_dim, max_position, theta, scaling, device=self.embed_tokens.device
            ),
            persistent=False,
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.embed(input_ids) * self.embed_scale
        residual: torch.Tensor | None = None
        layers = self.layers
        for i in range(len(layers)):  # by index: see LlamaForCausalLM.forward
            layer = layers[i]
            cos_sin = self.cos_sin_local if layer.is_sliding else self.cos_sin
            x, residual = layer(positions, x, residual, cos_sin, meta)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_softcap > 0:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def _targets(self) -> dict[str, list[tuple[torch.Tensor | Linear, int, int]]]:
        t = super()._targets()
        h = self.config.hidden_size
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, GemmaDecoderLayer)  # layer_cls
            p = f"model.layers.{i}."
            t[p + "pre_feedforward_layernorm.weight"] = [
                (layer.pre_feedforward_layernorm.weight, 0, h)
            ]
            t[p + "post_feedforward_layernorm.weight"] = [
                (layer.post_feedforward_layernorm.weight, 0, h)
            ]
        return t

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedRows]]) -> None:
        """Gemma's norms compute ``x * (1 + w)``: store ``1 + w`` (in fp32, then the model
        dtype) so the shared RMSNorm applies it as a plain weight."""

        def shifted() -> Iterable[tuple[str, torch.Tensor | QuantizedRows]]:
            for name, tensor in weights:
                if name.endswith("norm.weight"):
                    tensor = dequantize(tensor, torch.float32) + 1.0
                yield name, tensor

        super().load_weights(shifted())
