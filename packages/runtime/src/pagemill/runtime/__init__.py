"""pagemill.runtime: models, weights, model runner, sampler, detokenizer, engine and the LLM API.

Builds a working inference engine out of pagemill.blockpool (KV memory), pagemill.scheduler
(continuous batching) and pagemill.kernels (paged attention and fused ops).
"""

from .config import DEFAULT_MODEL, EngineConfig, ModelConfig
from .engine import EngineStats, LLMEngine
from .llm import LLM
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MODEL",
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "ModelConfig",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]
