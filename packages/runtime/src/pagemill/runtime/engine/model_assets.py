"""What both sides of the engine-core boundary read from a model folder, loaded one way.

The front end needs the tokenizer (prompts, chat templates, detokenization), the model's
config (vocabulary, EOS ids) and its generation defaults; the engine core needs the folder
and config to load weights, and the tokenizer only to compile grammars. Both load them
here, so the two sides cannot disagree about EOS ids, the chat template or the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagemill.runtime.chat_template import apply_chat_template_override
from pagemill.runtime.config import EngineConfig
from pagemill.runtime.generation_defaults import load_generation_defaults
from pagemill.runtime.model_config import ModelConfig
from pagemill.runtime.model_executor.loader import (
    check_model_folder,
    load_tokenizer,
    resolve_model_path,
)
from pagemill.runtime.model_executor.model_source import resolve_tokenizer

if TYPE_CHECKING:
    from pagemill.runtime.sample.structured_output import StructuredOutputManager


def eos_ids(tokenizer: Any | None, model_eos_ids: list[int] | tuple[int, ...]) -> list[int]:
    """The model's EOS ids, then the tokenizer's own if it is not among them."""
    eos = list(model_eos_ids)
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tok_eos, int) and tok_eos not in eos:
        eos.append(tok_eos)
    return eos


@dataclass
class ModelAssets:
    path: Path
    model_config: ModelConfig
    tokenizer: Any | None
    # SamplingParams field -> the model's default, for fields a request leaves unset.
    generation_defaults: dict[str, Any]

    @classmethod
    def load(cls, config: EngineConfig) -> ModelAssets:
        """Resolve the model (a Hub id is downloaded here, once), check the folder, read its
        config, tokenizer (with `--chat-template` applied) and generation defaults."""
        path = resolve_model_path(config.model, config.revision)
        check_model_folder(path, config.load_format)
        model_config = ModelConfig.from_pretrained(path)
        tokenizer = load_tokenizer(
            resolve_tokenizer(config.tokenizer) if config.tokenizer else str(path)
        )
        apply_chat_template_override(tokenizer, config.chat_template)
        defaults = load_generation_defaults(
            config.generation_config, path, config.override_generation_config
        )
        return cls(path, model_config, tokenizer, defaults)

    @property
    def eos_token_ids(self) -> list[int]:
        return eos_ids(self.tokenizer, self.model_config.eos_token_ids)

    def structured_output_manager(self, config: EngineConfig) -> StructuredOutputManager | None:
        """The core's grammar state; None for a model without a tokenizer."""
        if self.tokenizer is None:
            return None
        from pagemill.runtime.sample.structured_output import StructuredOutputManager

        return StructuredOutputManager(
            self.tokenizer,
            self.model_config.vocab_size,
            self.eos_token_ids,
            config.scheduler.max_num_seqs,
            config.structured_outputs,
        )
