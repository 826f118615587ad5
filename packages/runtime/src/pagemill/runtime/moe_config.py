"""The mixture-of-experts facts of a config.json, for the runtime and the planner alike.

Torch-free (as `model_config`): the planner sizes held vs streamed weights from it. Each
family spells the same facts differently — Qwen2/3-MoE ``num_experts`` and
``moe_intermediate_size`` (their ``intermediate_size`` is the dense layers' MLP), Mixtral
``intermediate_size`` for the experts' — so they are read once here.
Sizes are the whole model's; a tensor-parallel rank holds ``1 / tp`` of each expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "gpt_oss")


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # each routed expert's
    renormalize: bool  # top-k weights divided by their sum
    shared_intermediate_size: int  # 0: no shared expert (Qwen2-MoE has one, sigmoid-gated)
    sparse_layers: tuple[bool, ...]  # False: a dense MLP of ``intermediate_size`` there

    def params_per_layer(self, hidden: int, *, active: bool) -> int:
        """Expert (+ router + shared expert) weights of one sparse layer: all of them, or the
        ones a token reads (its top-k experts)."""
        experts = self.top_k if active else self.num_experts
        shared = 3 * hidden * self.shared_intermediate_size
        shared += hidden if self.shared_intermediate_size else 0
        return experts * 3 * hidden * self.intermediate_size + hidden * self.num_experts + shared


def moe_spec(raw: dict[str, Any]) -> MoeSpec | None:
    """The MoE spec of a parsed config.json, or None for a dense model."""
    model_type = raw.get("model_type")
    if model_type not in MOE_MODEL_TYPES:
        return None
    layers = int(raw["num_hidden_layers"])
    # transformers aliases the two spellings (and saves either, depending on its version).
    experts = raw.get("num_experts") or raw.get("num_local_experts")
    if model_type == "mixtral":
        return MoeSpec(
            num_experts=int(experts or 8),
            top_k=int(raw.get("num_experts_per_tok", 2)),
            intermediate_size=int(raw["intermediate_size"]),
            renormalize=True,
            shared_intermediate_size=0,
            sparse_layers=(True,) * layers,
        )
    if model_type == "gpt_oss":  # softmax over the top-k logits: renormalised top-k
        return MoeSpec(
            num_experts=int(experts or 128),
            top_k=int(raw.get("num_experts_per_tok", 4)),
            intermediate_size=int(raw["intermediate_size"]),
            renormalize=True,
            shared_intermediate_size=0,
            sparse_layers=(True,) * layers,
        )
    if model_type == "olmoe":
        return MoeSpec(
            num_experts=int(experts or 64),
            top_k=int(raw.get("num_experts_per_tok", 8)),
            intermediate_size=int(raw["intermediate_size"]),
            renormalize=bool(raw.get("norm_topk_prob", False)),
            shared_intermediate_size=0,
            sparse_layers=(True,) * layers,
        )
    num_experts = int(experts or 0)
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = set(raw.get("mlp_only_layers") or [])
    return MoeSpec(
        num_experts=num_experts,
        top_k=int(raw.get("num_experts_per_tok", 0)),
        intermediate_size=int(raw.get("moe_intermediate_size") or raw["intermediate_size"]),
        renormalize=bool(raw.get("norm_topk_prob", False)),
        shared_intermediate_size=(
            int(raw.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
        ),
        sparse_layers=tuple(
            i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(layers)
        ),
    )
