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
    def load(cls, config: EngineConfig, *, tokenizer: bool = True) -> ModelAssets:
        """Resolve the model (a Hub id is downloaded here, once), check the folder, read its
        config, tokenizer (with `--chat-template` applied) and generation defaults.

        `tokenizer=False` (an engine core process, which needs it only for grammars) leaves
        it unloaded: see `structured_output_manager(deferred=True)`."""
        path = resolve_model_path(config.model, config.revision)
        check_model_folder(path, config.load_format)
        model_config = ModelConfig.from_pretrained(path)
        loaded = None
        if tokenizer:
            loaded = _load_tokenizer(config, path)
            apply_chat_template_override(loaded, config.chat_template)
        defaults = load_generation_defaults(
            config.generation_config, path, config.override_generation_config
        )
        return cls(path, model_config, loaded, defaults)

    @property
    def eos_token_ids(self) -> list[int]:
        return eos_ids(self.tokenizer, self.model_config.eos_token_ids)

    def structured_output_manager(
        self, config: EngineConfig, *, deferred: bool = False
    ) -> StructuredOutputManager | None:
        """The core's grammar state; None for a model without a tokenizer.

        `deferred`: the tokenizer (and xgrammar) load at the manager's `prestart()` or its
        first grammar, not now; a model without a tokenizer then refuses each grammar."""
        from pagemill.runtime.sample.structured_output import StructuredOutputManager

        if deferred:
            model_eos = self.model_config.eos_token_ids
            vocab_size = self.model_config.vocab_size

            def load() -> tuple[Any, list[int]]:
                """The grammar table (read back from the tokenizer cache, or built from the
                tokenizer and saved there) and the stop ids; (None, ids) without one."""
                from pagemill.runtime.sample.structured_output.compiler import (
                    build_tokenizer_info,
                )
                from pagemill.runtime.sample.structured_output.tokenizer_cache import (
                    TokenizerInfoCache,
                    info_key,
                    tokenizer_cache_enabled,
                )

                where = _tokenizer_location(config, self.path)
                cache = TokenizerInfoCache.default() if tokenizer_cache_enabled() else None
                key = None if cache is None else info_key(where, vocab_size, model_eos)
                if cache is not None and key is not None:
                    hit = cache.load(key)
                    if hit is not None:
                        return hit
                tokenizer = load_tokenizer(where)
                stop = eos_ids(tokenizer, model_eos)
                if tokenizer is None:
                    return None, stop
                info = build_tokenizer_info(tokenizer, vocab_size, stop)
                if cache is not None and key is not None:
                    cache.save(key, info, stop)
                return info, stop

            return StructuredOutputManager.deferred(
                load,
                self.model_config.vocab_size,
                config.scheduler.max_num_seqs,
                config.structured_outputs,
            )
        if self.tokenizer is None:
            return None
        return StructuredOutputManager(
            self.tokenizer,
            self.model_config.vocab_size,
            self.eos_token_ids,
            config.scheduler.max_num_seqs,
            config.structured_outputs,
        )


def _tokenizer_location(config: EngineConfig, path: Path) -> str:
    return resolve_tokenizer(config.tokenizer) if config.tokenizer else str(path)


def _load_tokenizer(config: EngineConfig, path: Path) -> Any | None:
    return load_tokenizer(_tokenizer_location(config, path))
