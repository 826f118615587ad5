"""Qwen2-MoE and Qwen3-MoE: the Qwen2 / Qwen3 layers with a sparse MLP.

A layer is sparse unless it is in ``mlp_only_layers`` or off the ``decoder_sparse_step``
grid; a dense one keeps the plain MLP of ``intermediate_size``. The sparse MLP
(`layers.fused_moe`) routes by softmax top-k, renormalised when ``norm_topk_prob`` is set,
over experts of ``moe_intermediate_size``; Qwen2-MoE adds a shared expert every token runs,
scaled by ``sigmoid(shared_expert_gate(x))``. Attention is Qwen2's (q/k/v biases) or
Qwen3's (per-head q/k norms). Checkpoint names are transformers': ``mlp.gate``,
``mlp.experts.{e}.{gate,up,down}_proj``, ``mlp.shared_expert.*``, ``mlp.shared_expert_gate``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagemill.runtime.distributed.parallel_state import TensorParallelGroup
from pagemill.runtime.model_config import ModelConfig
from pagemill.runtime.model_executor.layers import Linear
from pagemill.runtime.model_executor.layers.fused_moe import SparseMoeBlock
from pagemill.runtime.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from pagemill.runtime.model_executor.quantization.formats import QuantizedRows
from pagemill.runtime.moe_config import MoeSpec, moe_spec


def spec_of(config: ModelConfig) -> MoeSpec:
    spec = moe_spec(config.hf_config)
    if spec is None:
        raise ValueError(f"{config.architecture} config has no mixture-of-experts fields")
    return spec


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    def _make_mlp(
        self, config: ModelConfig, dtype: torch.dtype, layer: int, tp: TensorParallelGroup | None
    ) -> nn.Module:
        spec = spec_of(config)
        if not spec.sparse_layers[layer]:
            return super()._make_mlp(config, dtype, layer, tp)
        return SparseMoeBlock(spec, config.hidden_size, dtype, tp)


class Qwen3MoeDecoderLayer(Qwen2MoeDecoderLayer):
    qk_norm = True


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-layout model whose sparse layers' MLPs are `SparseMoeBlock`s named ``mlp``."""

    layer_cls: type[nn.Module] = Qwen2MoeDecoderLayer
    moe_module = "mlp"
    expert_names = ("gate_proj", "up_proj", "down_proj")

    def _check_schemes(self) -> None:
        """Refuse int8/int4 quantization: the routed experts keep a GGUF file's packed rows
        but are not quantized from dense ones, and quantizing only the attention would not
        be what was asked."""
        asked = {m.scheme.method for m in self.modules() if isinstance(m, Linear)}
        packed = sorted(asked & {"int8", "int4"})
        if packed:
            raise ValueError(
                f"quantization {packed[0]!r} is not supported for mixture-of-experts models "
                f"({self.config.architecture}): expert weights are served dense"
            )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedRows]]) -> None:
        self._check_schemes()
        super().load_weights(weights)

    def init_dummy_weights(self, seed: int = 0) -> None:
        self._check_schemes()
        super().init_dummy_weights(seed)

    def _plan_experts(self) -> None:
        """The experts follow the projections' scheme: a "native" one (a GGUF file in bf16 on
        CPU) keeps their quantized rows packed too (`FusedMoE.plan_packing`)."""
        schemes = [m.scheme for m in self.modules() if isinstance(m, Linear)]
        if not schemes:
            return
        for layer in self.layers:
            mlp = getattr(layer, "mlp", None)
            if isinstance(mlp, SparseMoeBlock):
                mlp.experts.plan_packing(schemes[0].method, schemes[0].kernel_dtype)

    def _targets(self) -> dict[str, list[tuple[torch.Tensor | Linear, int, int]]]:
        t = super()._targets()
        self._plan_experts()
        for i, layer in enumerate(self.layers):
            mlp = getattr(layer, "mlp", None)
            if isinstance(mlp, SparseMoeBlock):
                t.update(mlp.targets(f"model.layers.{i}.{self.moe_module}.", self.expert_names))
        return t


class Qwen2MoeForCausalLM(MoeForCausalLM):
    layer_cls = Qwen2MoeDecoderLayer


class Qwen3MoeForCausalLM(MoeForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer
