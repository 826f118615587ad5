"""Grammar compilation through xgrammar, for one tokenizer.

A compiled grammar precomputes, for every grammar state, which vocabulary tokens can
follow; that costs milliseconds to seconds per schema, so it runs on a worker thread
(`StructuredOutputManager`), never on the engine's. The tokenizer's vocabulary table
(`TokenizerInfo`, about 0.1 s for a 49k vocabulary) is built lazily, by the first compile.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import xgrammar as xgr

from pagemill.runtime.sample.structured_output.params import GrammarKey


class GrammarCompiler:
    """Compiles `GrammarKey`s into xgrammar `CompiledGrammar`s; thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 max_threads: int = 1) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        # The model's own stop ids: once a grammar is complete, only these may follow.
        self._stop_token_ids = list(stop_token_ids)
        self._max_threads = max_threads
        self._lock = threading.Lock()
        self._compiler: xgr.GrammarCompiler | None = None

    def _get(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self._stop_token_ids or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads)
            return self._compiler

    def compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        compiler = self._get()
        kind, text = key
        base, _, style = kind.partition(":")
        compact = style == "compact"
        if base == "json":
            return compiler.compile_json_schema(text, any_whitespace=not compact)
        if base == "json_object":
            if compact:
                # Any object, compact: a schema for "an object" with no free whitespace.
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            return compiler.compile_builtin_json_grammar()
        if base == "regex":
            return compiler.compile_regex(text)
        if base == "grammar":
            return compiler.compile_grammar(text)
        raise ValueError(f"unknown structured output kind {kind!r}")
