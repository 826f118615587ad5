"""Phi-3: the Llama layer, read from a checkpoint with fused projections.

Phi-3 checkpoints already hold ``self_attn.qkv_proj`` ([q; k; v] rows) and
``mlp.gate_up_proj`` ([gate; up] rows) — exactly the fused layout the Llama module
computes with — so they load whole into the same `Linear`s, with no split. Partial RoPE
(``partial_rotary_factor`` < 1) and the sliding window (every layer, when the config sets
one: Phi-3-mini-4k's 2047) come from the config through the shared attention layer.
``longrope`` scaling (the 128k variants, Phi-3.5, Phi-4-mini) is only a different RoPE
table (`pagemill.kernels.rotary`), read from the config by `ModelConfig`.
"""

from __future__ import annotations

import torch

from pagemill.runtime.model_executor.layers import Linear
from pagemill.runtime.model_executor.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def _targets(self) -> dict[str, list[tuple[torch.Tensor | Linear, int, int]]]:
        c = self.config
        t = super()._targets()
        for i, layer in enumerate(self.decoder_layers()):
            p = f"model.layers.{i}."
            for name in ("q_proj", "k_proj", "v_proj"):
                del t[p + f"self_attn.{name}.weight"]
            for name in ("gate_proj", "up_proj"):
                del t[p + f"mlp.{name}.weight"]
            t[p + "self_attn.qkv_proj.weight"] = [
                (layer.self_attn.qkv_proj, 0, c.q_size + 2 * c.kv_size)
            ]
            t[p + "mlp.gate_up_proj.weight"] = [
                (layer.mlp.gate_up_proj, 0, 2 * c.intermediate_size)
            ]
        return t
