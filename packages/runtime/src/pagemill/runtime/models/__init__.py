"""Model implementations on pagemill kernels (one module per architecture family).

`ARCHITECTURES` maps each ``architectures`` name of a config.json that pagemill serves to
its module.
"""

from .gemma import GemmaForCausalLM
from .llama import LlamaForCausalLM
from .phi3 import Phi3ForCausalLM
from .qwen3 import Qwen3ForCausalLM

ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
}

__all__ = ["ARCHITECTURES", "GemmaForCausalLM", "LlamaForCausalLM", "Phi3ForCausalLM",
           "Qwen3ForCausalLM"]
