"""EAGLE-1 draft head for a Llama-family target (vLLM's `EagleLlamaForCausalLM`).

The head predicts the target's next *feature* rather than its next token: at position p it
reads the embedding of token p+1 and the target's final hidden state at p (after the final
norm, the vector the LM head consumes), fuses them with `fc`, runs them through one (or a
few) Llama decoder layers and hands the result straight to the target's LM head. The first
layer has no input norm (the EAGLE paper's layout, which its checkpoints are trained with);
the embedding and the LM head are the target's, so the checkpoint holds only `fc` and the
layers. The head keeps its own paged KV cache (`spec_decode.eagle`).

`EagleHeadBase` is the part the EAGLE-3 head shares: KV binding, RoPE table, and the
checkpoint-name table of a plain Llama layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from pagemill.kernels import rope_cos_sin
from pagemill.runtime.model_config import ModelConfig
from pagemill.runtime.model_executor.layers import Linear
from pagemill.runtime.model_executor.models.llama import LlamaDecoderLayer, LlamaMLP, RMSNorm
from pagemill.runtime.worker.attention_metadata import AttentionMetadata

if TYPE_CHECKING:
    from pagemill.runtime.worker.kv_cache import LayerKVScales

Target = tuple[torch.Tensor | Linear, int, int]


class EagleHeadBase(nn.Module):
    """What both EAGLE heads share with the `ModelRunner` contract of a model: `layers`
    bound to a KV pool, and a RoPE table of their own (the head may set its own theta)."""

    layers: nn.ModuleList
    cos_sin: torch.Tensor

    def __init__(self, config: ModelConfig, dtype: torch.dtype, max_position: int) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.register_buffer(
            "cos_sin",
            rope_cos_sin(
                config.rotary_dim,
                max_position,
                config.rope_theta,
                config.rope_scaling,
                device=torch.get_default_device(),
            ),
            persistent=False,
        )

    # The feature the head reads from the target for each token; EAGLE-3 fuses three.
    feature_size: int

    def combine_hidden_states(self, features: torch.Tensor) -> torch.Tensor:
        """Target features -> the head's hidden input (EAGLE-3 fuses its three layers)."""
        return features

    def forward_head(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (rows for the logits, the hidden state the next draft position reads)."""
        raise NotImplementedError

    def draft_logits(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """The head's argmax ids as target token ids (EAGLE-3's reduced vocabulary)."""
        return ids

    def bind_kv_caches(
        self,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        kv_scales: list[LayerKVScales] | None = None,
        kv_groups: list[int] | None = None,
        kv_pool: torch.Tensor | None = None,
    ) -> None:
        if len(kv_caches) != len(self.layers):
            raise ValueError(
                f"got KV caches for {len(kv_caches)} layers, the head has {len(self.layers)}"
            )
        for i, (layer, (k, v)) in enumerate(zip(self.decoder_layers(), kv_caches)):
            layer.self_attn.k_cache, layer.self_attn.v_cache = k, v
            layer.self_attn.kv_scales = None if kv_scales is None else kv_scales[i]
            layer.self_attn.bind_pool(kv_pool)

    def unbind_kv_caches(self) -> None:
        for layer in self.decoder_layers():
            layer.self_attn.k_cache = layer.self_attn.v_cache = None
            layer.self_attn.kv_scales = None
            layer.self_attn.bind_pool(None)

    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        return [cast(LlamaDecoderLayer, layer) for layer in self.layers]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """A run without target features (the runner's warm-up/profiling shape only)."""
        hidden = torch.zeros(
            input_ids.shape[0], self.feature_size, dtype=self.dtype, device=input_ids.device
        )
        return self.forward_head(input_ids, positions, self.combine_hidden_states(hidden), meta)[0]

    def compute_logits(self, rows: torch.Tensor) -> torch.Tensor:
        return self.draft_logits(rows)

    @staticmethod
    def layer_targets(prefix: str, layer: LlamaDecoderLayer, c: ModelConfig) -> dict[str, Target]:
        """Checkpoint name -> (parameter or Linear, row offset, rows) of one Llama layer."""
        a, m = layer.self_attn, layer.mlp
        assert isinstance(m, LlamaMLP)
        q, kv, inter, h = c.q_size, c.kv_size, c.intermediate_size, c.hidden_size
        post = layer.post_attention_layernorm.weight
        t: dict[str, Target] = {
            prefix + "post_attention_layernorm.weight": (post, 0, h),
            prefix + "self_attn.o_proj.weight": (a.o_proj, 0, h),
            prefix + "mlp.gate_proj.weight": (m.gate_up_proj, 0, inter),
            prefix + "mlp.up_proj.weight": (m.gate_up_proj, inter, inter),
            prefix + "mlp.down_proj.weight": (m.down_proj, 0, h),
        }
        norm = getattr(layer, "input_layernorm", None)
        if isinstance(norm, RMSNorm):
            t[prefix + "input_layernorm.weight"] = (norm.weight, 0, h)
        for name, off, rows in (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)):
            t[prefix + f"self_attn.{name}.weight"] = (a.qkv_proj, off, rows)
            if a.qkv_proj.bias is not None:
                t[prefix + f"self_attn.{name}.bias"] = (a.qkv_proj.bias, off, rows)
        return t

    @torch.no_grad()
    def load_targets(
        self,
        targets: dict[str, Target],
        weights: Iterable[tuple[str, torch.Tensor]],
        rename: Callable[[str], str | None],
    ) -> None:
        """Copy the checkpoint into `targets`; names `rename` maps to None are not the
        head's (a shared embedding, EAGLE-3's reverse map); a missing one is refused."""
        loaded: set[str] = set()
        for raw, tensor in weights:
            name = rename(raw)
            if name is None:
                continue
            if name not in targets:
                raise ValueError(f"EAGLE head checkpoint: unexpected tensor {raw!r}")
            dest, off, rows = targets[name]
            shape: tuple[int, ...] = ()
            if isinstance(dest, Linear):
                shape = (rows, dest.in_features)
            elif dest.dim():
                shape = tuple(dest.narrow(0, off, rows).shape)
            if tuple(tensor.shape) != shape:
                raise ValueError(
                    f"EAGLE head checkpoint: {raw} has shape {tuple(tensor.shape)}, the head's "
                    f"config implies {tuple(shape)}"
                )
            if isinstance(dest, Linear):
                dest.load_rows(off, tensor.to(self.dtype))
            elif dest.dim():
                dest.narrow(0, off, rows).copy_(tensor)
            else:
                dest.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(targets) - loaded)
        if missing:
            raise ValueError(f"EAGLE head checkpoint is missing tensor(s): {', '.join(missing)}")
        for module in self.modules():
            if isinstance(module, Linear):
                module.finalize()


def strip_model_prefix(name: str) -> str:
    return name[len("model.") :] if name.startswith("model.") else name


class EagleLlamaForCausalLM(EagleHeadBase):
    """EAGLE-1: fc(embed(token p+1) | target hidden p) -> decoder layers -> target LM head."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        max_position: int,
        embed: Callable[[torch.Tensor], torch.Tensor],
        lm_head: Callable[[torch.Tensor], torch.Tensor],
        fc_bias: bool,
    ) -> None:
        super().__init__(config, dtype, max_position)
        h = config.hidden_size
        self.feature_size = h
        # The target's: plain callables, so the target is no submodule of the head.
        self._embed = embed
        self._lm_head = lm_head
        self.fc = Linear(2 * h, h, fc_bias, dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, dtype, i) for i in range(config.num_hidden_layers)
        )
        # EAGLE's first layer reads the fused vector un-normed.
        self.layers[0].input_layernorm = nn.Identity()

    def forward_head(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.fc(torch.cat((self._embed(input_ids), hidden), dim=-1))
        residual: torch.Tensor | None = None
        for i in range(len(self.layers)):
            x, residual = self.layers[i](positions, x, residual, self.cos_sin, meta)
        assert residual is not None
        out = x + residual
        return out, out

    def draft_logits(self, rows: torch.Tensor) -> torch.Tensor:
        return self._lm_head(rows)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        c = self.config
        targets: dict[str, Target] = {"fc.weight": (self.fc, 0, c.hidden_size)}
        if self.fc.bias is not None:
            targets["fc.bias"] = (self.fc.bias, 0, c.hidden_size)
        for i, layer in enumerate(self.decoder_layers()):
            targets.update(self.layer_targets(f"layers.{i}.", layer, c))

        def rename(name: str) -> str | None:
            name = strip_model_prefix(name)
            # The target's embedding serves; a first-layer input norm is not part of EAGLE.
            # (vLLM's EAGLE-1 ignores both, and a copied LM head too.)
            if name.startswith(("embed_tokens.", "lm_head.")):
                return None
            if name == "layers.0.input_layernorm.weight":
                return None
            return name

        self.load_targets(targets, weights, rename)
