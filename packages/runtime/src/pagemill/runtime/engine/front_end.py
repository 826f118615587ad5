"""What every front end answers about its model, one way: `LLMEngine` (offline) and the
server's `AsyncEngine` both hold the model's assets, an input processor and a core that
reported its facts (`EngineCoreReady`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagemill.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagemill.runtime.engine.input_processor import InputProcessor
    from pagemill.runtime.engine.model_assets import ModelAssets
    from pagemill.runtime.engine.protocol import EngineCoreReady
    from pagemill.runtime.model_config import ModelConfig


class ModelFacts:
    """Mixed into a front end that sets `assets`, `input_processor` and `core_info`."""

    assets: ModelAssets
    input_processor: InputProcessor

    @property
    def core_info(self) -> EngineCoreReady:
        raise NotImplementedError

    @property
    def tokenizer(self) -> Any | None:
        return self.assets.tokenizer

    def get_tokenizer(self) -> Any | None:
        return self.assets.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self.assets.model_config

    @property
    def model_path(self) -> Path:
        return self.assets.path

    @property
    def generation_defaults(self) -> dict[str, Any]:
        return self.assets.generation_defaults

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation-config defaults (vLLM's name)."""
        return SamplingParams(**self.assets.generation_defaults)

    @property
    def max_model_len(self) -> int:
        return self.core_info.max_model_len

    @property
    def num_blocks(self) -> int:
        return self.core_info.num_blocks

    def encode(self, prompt: str) -> list[int]:
        """Blocking (tokenizing): in a server, call it off the event loop."""
        return self.input_processor.encode(prompt)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Blocking (templating and tokenizing): in a server, call it off the event loop."""
        return self.input_processor.apply_chat_template(
            messages, add_generation_prompt, chat_template=chat_template, tools=tools
        )
