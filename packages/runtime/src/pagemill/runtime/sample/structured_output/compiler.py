"""The tokenizer's side of grammar compilation, for one tokenizer.

A compiled grammar precomputes, for every grammar state, which vocabulary tokens can
follow; that costs milliseconds to seconds per schema, so it runs in worker processes
(`worker.CompileWorkers`), never on the engine's thread. The tokenizer's vocabulary table
(`TokenizerInfo`, about 0.2 s for a 49k vocabulary) is built once, lazily.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pagemill.runtime.sample.structured_output.params import GrammarKey
from pagemill.runtime.sample.structured_output.worker import compile_key

if TYPE_CHECKING:  # imported where first used: it costs an engine's start seconds
    import xgrammar as xgr


def build_tokenizer_info(
    tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]
) -> xgr.TokenizerInfo:
    """xgrammar's table of the Hugging Face `tokenizer`'s vocabulary, padded to the model's
    `vocab_size`, with the model's own stop ids."""
    import xgrammar as xgr

    return xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
    )


class GrammarCompiler:
    """The tokenizer's `TokenizerInfo`, and an in-process compile (tests, tools)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        max_threads: int = 1,
        cache_limit_bytes: int = -1,
    ) -> None:
        """`tokenizer`: the Hugging Face tokenizer, or its `TokenizerInfo` already built
        (read back by a warm start: see `tokenizer_cache`)."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        # The model's own stop ids: once a grammar is complete, only these may follow.
        self._stop_token_ids = list(stop_token_ids)
        self._max_threads = max_threads
        self._cache_limit_bytes = cache_limit_bytes
        self._lock = threading.Lock()
        self._info: xgr.TokenizerInfo | None = None
        self._compiler: xgr.GrammarCompiler | None = None

    @property
    def tokenizer_info(self) -> xgr.TokenizerInfo:
        import xgrammar as xgr

        with self._lock:
            if self._info is None:
                if isinstance(self._tokenizer, xgr.TokenizerInfo):
                    self._info = self._tokenizer
                else:
                    self._info = build_tokenizer_info(
                        self._tokenizer, self.vocab_size, self._stop_token_ids
                    )
            return self._info

    def _get(self) -> xgr.GrammarCompiler:
        import xgrammar as xgr

        info = self.tokenizer_info
        with self._lock:
            if self._compiler is None:
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=self._max_threads, cache_limit_bytes=self._cache_limit_bytes
                )
            return self._compiler

    def compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        return compile_key(self._get(), key)
