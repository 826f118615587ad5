"""Qwen3: the Llama layer with a per-head RMSNorm on q and k before RoPE.

Qwen3 drops Qwen2's q/k/v biases (its config's ``attention_bias`` says so) and normalises
each head of q and k instead (``self_attn.q_norm`` / ``k_norm``, one weight of
``head_dim``); everything else, a sliding window included, is the Llama module's.
"""

from __future__ import annotations

from pagemill.runtime.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class Qwen3DecoderLayer(LlamaDecoderLayer):
    qk_norm = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
