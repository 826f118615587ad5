"""SmolLM3: the Llama layer, with RoPE left out of some layers ("NoPE").

``no_rope_layers[i]`` is 1 where layer ``i`` rotates q and k and 0 where it does not
(attention there sees content only); configs without the list drop RoPE from every
``no_rope_layer_interval``-th layer (4: layers 3, 7, ...), as transformers fills it. When
``use_sliding_window`` is set, the NoPE layers attend through the window (the config's
``layer_types`` say so; `ModelConfig` reads them). Everything else is Llama's.
"""

from __future__ import annotations

import torch

from pagemill.runtime.distributed.parallel_state import TensorParallelGroup
from pagemill.runtime.model_config import ModelConfig
from pagemill.runtime.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM


def rope_layers(config: ModelConfig) -> list[bool]:
    """Whether each layer applies RoPE."""
    n = config.num_hidden_layers
    given = config.hf_config.get("no_rope_layers")
    if given is not None:
        if len(given) != n:
            raise ValueError(f"no_rope_layers has {len(given)} entries for {n} layers")
        return [bool(v) for v in given]
    interval = int(config.hf_config.get("no_rope_layer_interval") or 4)
    return [(i + 1) % interval != 0 for i in range(n)]


class SmolLM3DecoderLayer(LlamaDecoderLayer):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        layer: int = 0,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__(config, dtype, layer, tp)
        if not rope_layers(config)[layer]:
            self.self_attn.rotary_dim = 0


class SmolLM3ForCausalLM(LlamaForCausalLM):
    layer_cls = SmolLM3DecoderLayer
