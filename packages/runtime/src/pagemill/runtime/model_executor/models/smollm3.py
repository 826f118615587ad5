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
from pagemill.runtime.model_config import ModelConfig, smollm3_rope_layers
from pagemill.runtime.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class SmolLM3DecoderLayer(LlamaDecoderLayer):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        layer: int = 0,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__(config, dtype, layer, tp)
        if not smollm3_rope_layers(config.hf_config, config.num_hidden_layers)[layer]:
            self.self_attn.rotary_dim = 0


class SmolLM3ForCausalLM(LlamaForCausalLM):
    layer_cls = SmolLM3DecoderLayer
