"""Model implementations on pagemill kernels (one module per architecture family).

`ARCHITECTURES` maps each ``architectures`` name of a config.json that pagemill serves to
its module.
"""

from pagemill.runtime.model_executor.models.gemma import GemmaForCausalLM
from pagemill.runtime.model_executor.models.llama import LlamaForCausalLM
from pagemill.runtime.model_executor.models.phi3 import Phi3ForCausalLM
from pagemill.runtime.model_executor.models.qwen3 import Qwen3ForCausalLM

ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
}

__all__ = [
    "ARCHITECTURES",
    "GemmaForCausalLM",
    "LlamaForCausalLM",
    "Phi3ForCausalLM",
    "Qwen3ForCausalLM",
]
