"""pagemill.runtime: models, weights, model runner, sampler, detokenizer, engine and the LLM API.

Builds a working inference engine out of pagemill.blockpool (KV memory), pagemill.scheduler
(continuous batching) and pagemill.kernels (paged attention and fused ops).

The public names load lazily (PEP 562): the CLI and the capacity planner import
`pagemill.runtime.config` and `pagemill.runtime.model_config`, which are torch-free, and
importing a submodule runs this file first, so it must not import torch itself.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagemill.runtime.config import DEFAULT_MODEL, EngineConfig
    from pagemill.runtime.engine import EngineStats, LLMEngine
    from pagemill.runtime.inputs import PromptType, TextPrompt, TokensPrompt
    from pagemill.runtime.llm import LLM
    from pagemill.runtime.model_config import ModelConfig
    from pagemill.runtime.outputs import (
        CompletionOutput,
        EmbeddingOutput,
        EmbeddingRequestOutput,
        Logprob,
        RequestMetrics,
        RequestOutput,
    )
    from pagemill.runtime.pooling_params import PoolingParams
    from pagemill.runtime.sample.structured_output import StructuredOutputsParams
    from pagemill.runtime.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.4.0"

_LAZY = {
    "DEFAULT_MODEL": ".config",
    "EngineConfig": ".config",
    "ModelConfig": ".model_config",
    "EngineStats": ".engine",
    "LLMEngine": ".engine",
    "LLM": ".llm",
    "CompletionOutput": ".outputs",
    "Logprob": ".outputs",
    "PromptType": ".inputs",
    "TextPrompt": ".inputs",
    "TokensPrompt": ".inputs",
    "RequestMetrics": ".outputs",
    "RequestOutput": ".outputs",
    "EmbeddingOutput": ".outputs",
    "EmbeddingRequestOutput": ".outputs",
    "PoolingParams": ".pooling_params",
    "SamplingParams": ".sampling_params",
    "RequestOutputKind": ".sampling_params",
    "StructuredOutputsParams": ".sample.structured_output",
}

__all__ = [
    "DEFAULT_MODEL",
    "LLM",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "Logprob",
    "ModelConfig",
    "PoolingParams",
    "PromptType",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
