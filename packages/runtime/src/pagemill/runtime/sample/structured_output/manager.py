"""Per-request grammar state for the engine core: compile, wait, mask, advance.

The engine core owns one `StructuredOutputManager`. A constrained request is handed to
it on arrival; its grammar compiles on a worker thread (one compile per distinct
`GrammarKey`, shared by every request that asks for it, kept in a bounded cache), and the
core holds the request back from the scheduler until it is ready, so other requests keep
running meanwhile. Once admitted, the request gets its own matcher: each step the manager
fills the token bitmask of the constrained rows (`grammar_bitmask`), the sampler applies
it as a tensor, and every accepted token advances the matcher (`accept_tokens`). A matcher
that has terminated (the grammar is complete and a stop token was taken) ends the request.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

from pagemill.runtime.sample.structured_output.compiler import GrammarCompiler
from pagemill.runtime.sample.structured_output.params import GrammarKey, StructuredOutputsParams

logger = logging.getLogger(__name__)

_CACHE_SIZE = 512


@dataclass(slots=True)
class _Constrained:
    """A request's grammar: the compile in flight, then its matcher."""

    future: cf.Future[xgr.CompiledGrammar]
    matcher: xgr.GrammarMatcher | None = None
    rejected: bool = False


class StructuredOutputManager:
    """Compiled-grammar cache and matchers, driven from the engine thread only."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 max_num_seqs: int, max_workers: int = 1) -> None:
        self.vocab_size = vocab_size
        self.compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids)
        self._executor = cf.ThreadPoolExecutor(max_workers=max_workers,
                                               thread_name_prefix="pagemill-grammar")
        self._cache: OrderedDict[GrammarKey, cf.Future[xgr.CompiledGrammar]] = OrderedDict()
        self._requests: dict[str, _Constrained] = {}
        self._bitmask = xgr.allocate_token_bitmask(max_num_seqs, vocab_size)
        self.num_compiles = 0

    # ---- requests ------------------------------------------------------------------------

    def add_request(self, request_id: str, params: StructuredOutputsParams) -> None:
        """Start (or join) the compile of the request's grammar; returns at once."""
        key = params.key
        future = self._cache.get(key)
        if future is None or (future.done() and future.exception() is not None):
            future = self._executor.submit(self.compiler.compile, key)
            self.num_compiles += 1
            self._cache[key] = future
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        self._requests[request_id] = _Constrained(future)

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

    def wait_any(self, request_ids: Iterable[str], timeout: float) -> None:
        """Block up to `timeout` s until one of these requests' grammars is ready."""
        futures = [self._requests[r].future for r in request_ids if r in self._requests]
        if futures:
            cf.wait(futures, timeout=timeout, return_when=cf.FIRST_COMPLETED)

    def remove_requests(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._requests.pop(rid, None)

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
        rows = [(i, requests[r].matcher) for i, r in enumerate(req_ids) if r in requests]
        if not rows:
            return None
        bitmask = self._bitmask[: len(req_ids)]
        if len(rows) < len(req_ids):
            bitmask.fill_(-1)
        for i, matcher in rows:
            if matcher is None:  # not admitted yet: cannot be sampled this step
                continue
            if matcher.is_terminated():
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
        self._executor.shutdown(wait=False, cancel_futures=True)
