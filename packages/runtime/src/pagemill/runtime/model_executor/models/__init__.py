"""Model implementations on pagemill kernels (one module per architecture family).

`ARCHITECTURES` maps each ``architectures`` name of a config.json that pagemill serves to
its module.
"""

from pagemill.runtime.model_executor.models.gemma import GemmaForCausalLM
from pagemill.runtime.model_executor.models.gpt_oss import GptOssForCausalLM
from pagemill.runtime.model_executor.models.granite import GraniteForCausalLM
from pagemill.runtime.model_executor.models.llama import LlamaForCausalLM
from pagemill.runtime.model_executor.models.mixtral import MixtralForCausalLM
from pagemill.runtime.model_executor.models.olmo2 import Olmo2ForCausalLM
from pagemill.runtime.model_executor.models.olmoe import OlmoeForCausalLM
from pagemill.runtime.model_executor.models.phi3 import Phi3ForCausalLM
from pagemill.runtime.model_executor.models.qwen3 import Qwen3ForCausalLM
from pagemill.runtime.model_executor.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from pagemill.runtime.model_executor.models.smollm3 import SmolLM3ForCausalLM

ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
}

__all__ = [
    "ARCHITECTURES",
    "GemmaForCausalLM",
    "GptOssForCausalLM",
    "GraniteForCausalLM",
    "LlamaForCausalLM",
    "MixtralForCausalLM",
    "Olmo2ForCausalLM",
    "OlmoeForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "SmolLM3ForCausalLM",
]
