"""OLMoE: the Llama layer with OLMo 2's whole-projection q/k norms and a sparse MLP.

``self_attn.q_norm`` / ``k_norm`` normalise the whole q (``heads * head_dim``) and k
projections before the heads split, as OLMo 2's do (under tensor parallelism the sum of
squares is all-reduced, see `olmo2`), but round as Llama's RMSNorm does (normalised value
rounded to the input dtype, then times the weight), as transformers' ``OlmoeRMSNorm``.
Routing is softmax top-k, renormalised only with ``norm_topk_prob``. ``clip_qkv`` (unset in
the released checkpoints) is refused rather than ignored.
"""

from __future__ import annotations

import torch

from pagemill.runtime.distributed.parallel_state import TensorParallelGroup
from pagemill.runtime.model_config import ModelConfig
from pagemill.runtime.model_executor.layers import Linear
from pagemill.runtime.model_executor.models.olmo2 import Olmo2Attention
from pagemill.runtime.model_executor.models.qwen_moe import MoeForCausalLM, Qwen2MoeDecoderLayer


class OlmoeAttention(Olmo2Attention):
    def _norm_projections(
        self, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hq, hk = q.float(), k.float()
        sums = torch.cat((hq.pow(2).sum(-1, keepdim=True), hk.pow(2).sum(-1, keepdim=True)), dim=-1)
        n = 1
        if self.tp is not None:
            sums = self.tp.all_reduce(sums)
            n = self.tp.world_size
        var_q = sums[:, :1] / (hq.shape[-1] * n)
        var_k = sums[:, 1:] / (hk.shape[-1] * n)
        qn, kn = self.q_proj_norm, self.k_proj_norm
        return (
            qn.weight * (hq * torch.rsqrt(var_q + qn.eps)).to(q.dtype),
            kn.weight * (hk * torch.rsqrt(var_k + kn.eps)).to(k.dtype),
        )


class OlmoeDecoderLayer(Qwen2MoeDecoderLayer):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        layer: int = 0,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__(config, dtype, layer, tp)
        self.self_attn = OlmoeAttention(config, dtype, window=config.layer_window(layer), tp=tp)


class OlmoeForCausalLM(MoeForCausalLM):
    layer_cls = OlmoeDecoderLayer

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        max_position: int,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        if config.hf_config.get("clip_qkv") is not None:
            raise ValueError("OLMoE with clip_qkv set is not supported (q/k/v clamping)")
        super().__init__(config, dtype, max_position, tp)

    def _targets(self) -> dict[str, list[tuple[torch.Tensor | Linear, int, int]]]:
        t = super()._targets()
        c = self.config
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, OlmoeDecoderLayer)  # layer_cls
            a = layer.self_attn
            assert isinstance(a, OlmoeAttention)
            p = f"model.layers.{i}.self_attn."
            t[p + "q_norm.weight"] = [(a.q_proj_norm.weight, 0, c.q_size)]
            t[p + "k_norm.weight"] = [(a.k_proj_norm.weight, 0, c.kv_size)]
        return t
