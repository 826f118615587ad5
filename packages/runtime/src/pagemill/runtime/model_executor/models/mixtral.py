"""Mixtral: the Mistral layer with a sparse MLP in every layer.

The router's top-k softmax weights are always renormalised over the k chosen. The
checkpoint names its block ``block_sparse_moe`` and the expert projections ``w1`` (gate),
``w3`` (up) and ``w2`` (down); ``intermediate_size`` is each expert's.
"""

from __future__ import annotations

from pagemill.runtime.model_executor.models.qwen_moe import MoeForCausalLM, Qwen2MoeDecoderLayer


class MixtralForCausalLM(MoeForCausalLM):
    layer_cls = Qwen2MoeDecoderLayer  # every layer sparse, no shared expert (its spec)
    moe_module = "block_sparse_moe"
    expert_names = ("w1", "w3", "w2")
