"""Per-request grammar state for the engine core: compile, wait, mask, advance.

The engine core owns one `StructuredOutputManager`. A constrained request is handed to
it on arrival; its grammar compiles in a worker process under a deadline (`worker.py`: one
compile per distinct `GrammarKey`, shared by every request that asks for it, stopped when
no request waits for it any more, kept in a cache bounded in entries and in bytes; a
failure is remembered too, so a repeated runaway grammar fails at once), and the core holds
the request back from the scheduler until it is ready, so other requests keep running
meanwhile. Once admitted, the request gets its own matcher: each step the manager
fills the token bitmask of the constrained rows (`grammar_bitmask`), the sampler applies
it as a tensor, and every accepted token advances the matcher (`accept_tokens`). A matcher
that has terminated (the grammar is complete and a stop token was taken) ends the request.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

from pagemill.runtime.sample.structured_output.compiler import GrammarCompiler
from pagemill.runtime.sample.structured_output.config import StructuredOutputsConfig
from pagemill.runtime.sample.structured_output.params import GrammarKey, StructuredOutputsParams
from pagemill.runtime.sample.structured_output.worker import (
    CompileJob,
    CompileWorkers,
    GrammarCompileError,
)

logger = logging.getLogger(__name__)

_CACHE_SIZE = 512


@dataclass(slots=True)
class _Constrained:
    """A request's grammar: the compile in flight, then its matcher."""

    future: cf.Future[xgr.CompiledGrammar]
    key: GrammarKey | None = None
    matcher: xgr.GrammarMatcher | None = None
    rejected: bool = False
    reasoning_end: frozenset[int] = frozenset()
    """While non-empty the request is still reasoning: its tokens are free and do not
    advance the matcher; the first of these tokens starts the grammar."""


@dataclass(slots=True, eq=False)
class _Entry:
    """A cached grammar: its compile, how many requests wait for it, its size once known."""

    job: CompileJob
    waiters: int = 0
    nbytes: int | None = None

    @property
    def future(self) -> cf.Future[xgr.CompiledGrammar]:
        return self.job.future

    def size(self) -> int:
        if self.nbytes is None:
            f = self.future
            if not f.done():
                return 0
            ok = not f.cancelled() and f.exception() is None
            self.nbytes = f.result().memory_size_bytes if ok else 0
        return self.nbytes


class StructuredOutputManager:
    """Compiled-grammar cache and matchers, driven from the engine thread only."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        max_num_seqs: int,
        config: StructuredOutputsConfig | None = None,
        *,
        prestart: bool = True,
    ) -> None:
        self.vocab_size = vocab_size
        self.config = config = config or StructuredOutputsConfig()
        self.cache_limit_bytes = config.structured_outputs_cache_bytes
        self.compiler = GrammarCompiler(
            tokenizer, vocab_size, stop_token_ids, cache_limit_bytes=self.cache_limit_bytes
        )
        # Started now, in the background (the first start of the forkserver imports
        # xgrammar and torch: seconds), so the first grammar does not wait for it.
        self._workers: CompileWorkers | None = None
        self._workers_lock = threading.Lock()
        if prestart:
            threading.Thread(
                target=self._start_workers, name="pagemill-grammar-start", daemon=True
            ).start()
        self._cache: OrderedDict[GrammarKey, _Entry] = OrderedDict()
        self._requests: dict[str, _Constrained] = {}
        self._bitmask = xgr.allocate_token_bitmask(max_num_seqs, vocab_size)
        self.num_compiles = 0
        self._cache_bytes = 0

    def _start_workers(self) -> CompileWorkers:
        with self._workers_lock:
            if self._workers is None:
                workers = CompileWorkers(
                    self.compiler.tokenizer_info,
                    num_workers=self.config.structured_outputs_compile_workers,
                    timeout=self.config.structured_outputs_compile_timeout,
                    cache_limit_bytes=self.cache_limit_bytes // 4,
                )
                # The workers stop with the manager (or at exit, or with the process).
                weakref.finalize(self, workers.shutdown)
                self._workers = workers
            return self._workers

    def _submit(self, key: GrammarKey) -> CompileJob:
        return self._start_workers().submit(key)

    @property
    def cache_bytes(self) -> int:
        """Bytes held by the compiled grammars in the cache (xgrammar's own measure), as of
        the last admission (read every step by the metrics: constant time)."""
        return self._cache_bytes

    # ---- requests ------------------------------------------------------------------------

    def add_request(self, request_id: str, params: StructuredOutputsParams) -> None:
        """Start (or join) the compile of the request's grammar; returns at once."""
        key = params.key
        entry = self._cache.get(key)
        if entry is not None and entry.future.done():
            exc = None if entry.future.cancelled() else entry.future.exception()
            # A grammar that cannot compile (or ran out of time) fails again at once; a
            # crashed or cancelled compile is tried again.
            if entry.future.cancelled() or (
                exc is not None and not isinstance(exc, GrammarCompileError)
            ):
                entry = None
        if entry is None:
            entry = _Entry(self._submit(key))
            self.num_compiles += 1
            self._cache[key] = entry
            self._evict()
        else:
            self._cache.move_to_end(key)
        entry.waiters += 1
        reasoning_end = frozenset(params.reasoning_end_token_ids or ())
        self._requests[request_id] = _Constrained(entry.future, key, reasoning_end=reasoning_end)

    def _evict(self) -> None:
        """Least recently used grammars nobody waits for go, until the cache holds at most
        _CACHE_SIZE entries and cache_limit_bytes bytes."""
        total = sum(e.size() for e in self._cache.values())
        for key in list(self._cache):
            if len(self._cache) <= _CACHE_SIZE and total <= self.cache_limit_bytes:
                break
            entry = self._cache[key]
            if entry.waiters:
                continue
            total -= entry.size()
            del self._cache[key]
        self._cache_bytes = total

    def is_ready(self, request_id: str) -> bool:
        """True once the grammar is compiled (or failed: `error` says so)."""
        state = self._requests.get(request_id)
        return state is None or state.future.done()

    def error(self, request_id: str) -> BaseException | None:
        state = self._requests.get(request_id)
        return None if state is None or not state.future.done() else state.future.exception()

    def start(self, request_id: str) -> None:
        """Give a request whose grammar is ready its own matcher."""
        state = self._requests[request_id]
        if state.matcher is None:
            state.matcher = xgr.GrammarMatcher(state.future.result())
            self._evict()  # its size is known now

    def wait_any(self, request_ids: Iterable[str], timeout: float) -> None:
        """Block up to `timeout` s until one of these requests' grammars is ready."""
        futures = [self._requests[r].future for r in request_ids if r in self._requests]
        if futures:
            cf.wait(futures, timeout=timeout, return_when=cf.FIRST_COMPLETED)

    def remove_requests(self, request_ids: Iterable[str]) -> None:
        """Forget these requests; a compile that nobody waits for any more is stopped."""
        for rid in request_ids:
            state = self._requests.pop(rid, None)
            if state is None or state.key is None:
                continue
            entry = self._cache.get(state.key)
            if entry is None or entry.future is not state.future:
                continue
            entry.waiters -= 1
            if entry.waiters <= 0 and not entry.future.done():
                entry.job.abandon()
                del self._cache[state.key]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # ---- the step ------------------------------------------------------------------------

    def grammar_bitmask(self, req_ids: Sequence[str]) -> torch.Tensor | None:
        """[len(req_ids), ceil(V/32)] int32 (bit set = allowed) for the step's sampled rows,
        all ones in unconstrained rows; None when no row is constrained."""
        requests = self._requests
        if not requests:
            return None
        rows = [(i, requests[r]) for i, r in enumerate(req_ids) if r in requests]
        if not rows:
            return None
        bitmask = self._bitmask[: len(req_ids)]
        if len(rows) < len(req_ids):
            bitmask.fill_(-1)
        for i, state in rows:
            matcher = state.matcher
            if matcher is None:  # not admitted yet: cannot be sampled this step
                continue
            if state.reasoning_end:
                bitmask[i].fill_(-1)  # still reasoning: the grammar has not started
            elif matcher.is_terminated():
                bitmask[i].fill_(-1)  # it ends this step anyway
            else:
                matcher.fill_next_token_bitmask(bitmask, i)
        return bitmask

    def accept_tokens(self, sampled: dict[str, int]) -> list[str]:
        """Advance each constrained request's matcher by its sampled token.

        Returns the requests whose grammar is now finished: terminated (a stop token was
        taken after the grammar completed) or stuck on a token it rejects (possible only
        when another rule, such as min_tokens banning EOS, empties the allowed set).
        """
        done: list[str] = []
        for rid, state in self._requests.items():
            token = sampled.get(rid)
            matcher = state.matcher
            if token is None or matcher is None:
                continue
            if state.reasoning_end:
                if token in state.reasoning_end:
                    state.reasoning_end = frozenset()  # the answer, constrained, starts now
                continue
            if matcher.is_terminated():
                done.append(rid)
            elif not matcher.accept_token(token):
                state.rejected = True
                logger.warning("request %s: the grammar rejected token %d; ending it", rid, token)
                done.append(rid)
            elif matcher.is_terminated():
                done.append(rid)
        return done

    def shutdown(self) -> None:
        if self._workers is not None:
            self._workers.shutdown()
