"""EAGLE-3 draft head for a Llama-family target (vLLM's `Eagle3LlamaForCausalLM`, the
checkpoints' `LlamaForCausalLMEagle3`).

EAGLE-3 reads three of the target's hidden states per token (a low, a middle and a high
layer's input, `eagle_aux_hidden_state_layer_ids`), fuses them with `fc` into one vector,
and its first decoder layer attends over the concatenation of the (normed) token embedding
and the (normed) fused vector, so its q/k/v projections take twice the hidden size. Later
layers, if any, are plain Llama layers. The head ends in its own norm and LM head, often
over a reduced draft vocabulary whose id i stands for target id ``i + d2t[i]``. The
pre-norm output is what the next draft position reads as its hidden input.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagemill.runtime.model_config import ModelConfig
from pagemill.runtime.model_executor.layers import Linear
from pagemill.runtime.model_executor.models.llama import LlamaDecoderLayer, RMSNorm
from pagemill.runtime.model_executor.models.llama_eagle import (
    EagleHeadBase,
    Target,
    strip_model_prefix,
)
from pagemill.runtime.worker.attention_metadata import AttentionMetadata


class Eagle3FirstLayer(LlamaDecoderLayer):
    """Attention over [norm(embedding) | norm(fused hidden)]; the residual is the hidden."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, norm_before_residual: bool):
        super().__init__(config, dtype, 0)
        a = self.self_attn
        a.qkv_proj = Linear(
            2 * config.hidden_size, a.q_size + 2 * a.kv_size, config.attention_bias, dtype
        )
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.norm_before_residual = norm_before_residual

    def forward_fused(
        self,
        positions: torch.Tensor,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos_sin: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.input_layernorm(embeds)
        h = self.hidden_norm(hidden)
        residual = h if self.norm_before_residual else hidden
        assert isinstance(e, torch.Tensor) and isinstance(h, torch.Tensor)
        x = self.self_attn(positions, torch.cat((e, h), dim=-1), cos_sin, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Eagle3LlamaForCausalLM(EagleHeadBase):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        max_position: int,
        *,
        target_embed: Callable[[torch.Tensor], torch.Tensor],
        target_hidden_size: int,
        draft_vocab_size: int,
        own_embedding: bool,
        norm_before_residual: bool,
    ) -> None:
        super().__init__(config, dtype, max_position)
        h = config.hidden_size
        self.feature_size = 3 * target_hidden_size
        self._target_embed = target_embed
        self.embed_tokens = (
            nn.Parameter(torch.empty(config.vocab_size, h, dtype=dtype), requires_grad=False)
            if own_embedding
            else None
        )
        self.fc = Linear(3 * target_hidden_size, h, False, dtype)
        layers: list[nn.Module] = [Eagle3FirstLayer(config, dtype, norm_before_residual)]
        layers += [LlamaDecoderLayer(config, dtype, i) for i in range(1, config.num_hidden_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(h, config.rms_norm_eps, dtype)
        head = torch.empty(draft_vocab_size, h, dtype=dtype)
        self.lm_head = nn.Parameter(head, requires_grad=False)
        # Draft id -> target id offset; zeros (identity) when the vocabularies are the same.
        self.d2t: torch.Tensor
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.has_d2t = False

    def combine_hidden_states(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(features)

    def forward_head(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = (
            self._target_embed(input_ids)
            if self.embed_tokens is None
            else F.embedding(input_ids, self.embed_tokens)
        )
        first = self.layers[0]
        assert isinstance(first, Eagle3FirstLayer)
        x, residual = first.forward_fused(positions, embeds, hidden, self.cos_sin, meta)
        for i in range(1, len(self.layers)):
            x, residual = self.layers[i](positions, x, residual, self.cos_sin, meta)
        normed, prenorm = self.norm(x, residual)
        return normed, prenorm

    def draft_logits(self, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(rows, self.lm_head)

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.d2t[ids]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        c = self.config
        h = c.hidden_size
        targets: dict[str, Target] = {
            "fc.weight": (self.fc, 0, h),
            "norm.weight": (self.norm.weight, 0, h),
            "lm_head.weight": (self.lm_head, 0, self.lm_head.shape[0]),
        }
        if self.embed_tokens is not None:
            targets["embed_tokens.weight"] = (self.embed_tokens, 0, c.vocab_size)
        if self.has_d2t:
            targets["d2t"] = (self.d2t, 0, self.d2t.shape[0])
        for i, layer in enumerate(self.decoder_layers()):
            targets.update(self.layer_targets(f"layers.{i}.", layer, c))
        first = self.layers[0]
        assert isinstance(first, Eagle3FirstLayer)
        targets["layers.0.hidden_norm.weight"] = (first.hidden_norm.weight, 0, h)

        def rename(name: str) -> str | None:
            name = strip_model_prefix(name)
            if name.startswith("midlayer."):  # the EAGLE repo's name for layer 0
                name = "layers.0." + name[len("midlayer.") :]
            if name == "t2d":  # target -> draft membership: not needed to draft
                return None
            return name

        self.load_targets(targets, weights, rename)
