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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pagemill.runtime.sample.structured_output.compiler import GrammarCompiler
from pagemill.runtime.sample.structured_output.config import StructuredOutputsConfig
from pagemill.runtime.sample.structured_output.limits import (
    MAX_JSON_NEWLINES,
    MAX_JSON_WHITESPACE,
)
from pagemill.runtime.sample.structured_output.params import GrammarKey, StructuredOutputsParams
from pagemill.runtime.sample.structured_output.whitespace import Run, WhitespaceCap
from pagemill.runtime.sample.structured_output.worker import (
    CompileJob,
    CompileWorkers,
    GrammarCompileError,
)

if TYPE_CHECKING:  # imported where first needed: the import costs an engine's start seconds
    import xgrammar as xgr

logger = logging.getLogger(__name__)

_CACHE_SIZE = 512

# What a deferred manager calls, once, for the tokenizer and the stop ids its grammars end on.
TokenizerLoader = Callable[[], tuple[Any, Sequence[int]]]


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
    ws_run: Run | None = None
    """JSON output: the whitespace it ends in (`WhitespaceCap`); None for other
    grammars."""


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
    """Compiled-grammar cache and matchers, driven from the engine thread only.

    Give it the tokenizer and the stop ids, or (`StructuredOutputManager.deferred`) a
    function that loads them: an engine core process then starts without the tokenizer
    or xgrammar, and loads them when `prestart()` is called (in the background, beside the
    model's load) or when the first grammar needs them, whichever comes first.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        max_num_seqs: int,
        config: StructuredOutputsConfig | None = None,
        *,
        prestart: bool = True,
        load_tokenizer: TokenizerLoader | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs
        self.config = config = config or StructuredOutputsConfig()
        self.cache_limit_bytes = config.structured_outputs_cache_bytes
        self._compiler: GrammarCompiler | None = None
        self._load_tokenizer = load_tokenizer
        if load_tokenizer is None:
            self._compiler = GrammarCompiler(
                tokenizer, vocab_size, stop_token_ids, cache_limit_bytes=self.cache_limit_bytes
            )
        self._workers: CompileWorkers | None = None
        self._workers_lock = threading.Lock()
        self._prestart_thread: threading.Thread | None = None
        self._cache: OrderedDict[GrammarKey, _Entry] = OrderedDict()
        self._requests: dict[str, _Constrained] = {}
        # Allocated with the workers (by xgrammar): a row is only read once a grammar is in.
        self._bitmask: torch.Tensor | None = None
        self._draft_bitmask: torch.Tensor | None = None
        self._ws_cap: WhitespaceCap | None = None  # built with the workers, like the bitmask
        self.num_compiles = 0
        self._cache_bytes = 0
        if prestart:
            self.prestart()

    @classmethod
    def deferred(
        cls,
        load_tokenizer: TokenizerLoader,
        vocab_size: int,
        max_num_seqs: int,
        config: StructuredOutputsConfig | None = None,
    ) -> StructuredOutputManager:
        """A manager that loads the tokenizer (and xgrammar) only at `prestart()` or at
        its first grammar; `load_tokenizer` returns (tokenizer or None, stop ids)."""
        return cls(
            None,
            vocab_size,
            (),
            max_num_seqs,
            config,
            prestart=False,
            load_tokenizer=load_tokenizer,
        )

    def prestart(self) -> None:
        """Start the compile workers in the background (the tokenizer's table, and the
        first start of the workers' zygote imports xgrammar and torch: seconds), so the
        first grammar does not wait for them. Once only; `wait_prestarted` joins it."""
        if self._prestart_thread is not None:
            return
        self._prestart_thread = threading.Thread(
            target=self._start_workers_quietly, name="pagemill-grammar-start", daemon=True
        )
        self._prestart_thread.start()

    def wait_prestarted(self, timeout: float | None = None) -> bool:
        """Wait for `prestart()`'s work (if it was called); False if it is still running.

        An engine core calls this before it reports ready: started alongside the model's
        load, the grammar side costs the start little, while finishing after ready it would
        take a core from the first requests' steps (seconds of them, on a small machine)."""
        thread = self._prestart_thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def _start_workers_quietly(self) -> None:
        try:
            self._start_workers()
        except Exception as exc:  # said again to the first request that needs a grammar
            logger.warning("structured output is not available: %s", exc)

    @property
    def compiler(self) -> GrammarCompiler:
        """The tokenizer's side of compiling (a deferred manager loads the tokenizer now)."""
        if self._compiler is None:
            with self._workers_lock:
                self._make_compiler()
        assert self._compiler is not None
        return self._compiler

    def _make_compiler(self) -> None:
        """Under `_workers_lock`: the tokenizer loads once; a model without one refuses
        every grammar."""
        if self._compiler is not None:
            return
        load = self._load_tokenizer
        tokenizer, stop_token_ids = (None, ()) if load is None else load()
        if tokenizer is None:
            self._load_tokenizer = None  # loaded once: the answer does not change
            raise ValueError("structured output needs a tokenizer, and this model has none")
        self._compiler = GrammarCompiler(
            tokenizer, self.vocab_size, stop_token_ids, cache_limit_bytes=self.cache_limit_bytes
        )

    def _start_workers(self) -> CompileWorkers:
        with self._workers_lock:
            if self._workers is None:
                import xgrammar as xgr

                self._make_compiler()
                assert self._compiler is not None
                workers = CompileWorkers(
                    self._compiler.tokenizer_info,
                    num_workers=self.config.structured_outputs_compile_workers,
                    timeout=self.config.structured_outputs_compile_timeout,
                    cache_limit_bytes=self.cache_limit_bytes // 4,
                )
                # The workers stop with the manager (or at exit, or with the process).
                weakref.finalize(self, workers.shutdown)
                self._bitmask = xgr.allocate_token_bitmask(self.max_num_seqs, self.vocab_size)
                self._ws_cap = WhitespaceCap(
                    self._compiler.tokenizer_info.decoded_vocab,
                    self.vocab_size,
                    MAX_JSON_WHITESPACE,
                    MAX_JSON_NEWLINES,
                )
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
        json = key[0].partition(":")[0] in ("json", "json_object")
        ws_run = (0, 0) if json else None
        self._requests[request_id] = _Constrained(
            entry.future, key, reasoning_end=reasoning_end, ws_run=ws_run
        )

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
            import xgrammar as xgr

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
        return self.grammar_bitmasks(req_ids)[0]

    def grammar_bitmasks(
        self,
        req_ids: Sequence[str],
        spec_indices: Sequence[int] = (),
        spec_drafts: Sequence[Sequence[int]] = (),
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The masks of a step's rows: one per `req_ids` entry, and one per draft row of
        the requests verifying drafts (`spec_indices[m]` into `req_ids` has the drafts
        `spec_drafts[m]`; their rows follow each other in that order).

        A verified position must be sampled from the distribution an ordinary step would
        use there, and that one is masked by the grammar's state after the tokens before
        it: draft row j gets the state after drafts 0..j-1, and the request's own row (the
        bonus row, after the last draft) the state after all of them. The matcher walks
        the drafts to fill them and is rolled back: it only ever moves by tokens the step
        actually emits (`accept_tokens`). A draft the grammar rejects gets a row that
        bans it, so verification stops there; the rows after it are never read and copy
        its mask. None for a tensor with no constrained row.
        """
        requests = self._requests
        if not requests or self._bitmask is None:  # no bitmask yet: no grammar is in either
            return None, None
        rows = [(i, requests[r]) for i, r in enumerate(req_ids) if r in requests]
        if not rows:
            return None, None
        bitmask = self._bitmask[: len(req_ids)]
        if len(rows) < len(req_ids):
            bitmask.fill_(-1)
        drafts_of: dict[int, tuple[int, Sequence[int]]] = {}
        offset = 0
        for i, drafts in zip(spec_indices, spec_drafts):
            drafts_of[i] = (offset, drafts)
            offset += len(drafts)
        draft_mask: torch.Tensor | None = None
        if any(i in drafts_of for i, _ in rows):
            draft_mask = self._draft_rows(offset)
        for i, state in rows:
            matcher = state.matcher
            if matcher is None:  # not admitted yet: cannot be sampled this step
                continue
            reasoning = state.reasoning_end
            ws = _WsRun(self._ws_cap, state.ws_run)
            spec = drafts_of.get(i)
            advanced = 0
            if spec is not None:
                assert draft_mask is not None
                start, drafts = spec
                advanced, reasoning = _fill_draft_rows(
                    matcher, reasoning, ws, drafts, draft_mask, start
                )
                if advanced < 0:  # a draft was rejected: the bonus row is never read
                    bitmask[i].copy_(draft_mask[start + len(drafts) - 1])
                    if advanced < -1:
                        matcher.rollback(-advanced - 1)
                    continue
            _fill_row(matcher, reasoning, ws, bitmask, i)
            if advanced:
                matcher.rollback(advanced)
        return bitmask, draft_mask

    def _draft_rows(self, n: int) -> torch.Tensor:
        """n all-ones rows (unconstrained draft rows stay so) in a buffer kept across steps."""
        import xgrammar as xgr

        buf = self._draft_bitmask
        if buf is None or buf.shape[0] < n:
            buf = self._draft_bitmask = xgr.allocate_token_bitmask(
                max(n, 2 * (0 if buf is None else buf.shape[0])), self.vocab_size
            )
        rows = buf[:n]
        rows.fill_(-1)
        return rows

    def validate_drafts(self, drafts: dict[str, list[int]]) -> dict[str, list[int]]:
        """Each constrained request's drafts cut before the first token its grammar would
        reject (or that would follow the grammar's end): such a draft could never be
        accepted, so verifying it and what follows it would be wasted work. The matchers
        are left as they were. Unconstrained requests' drafts pass unchanged; a request
        left with no draft is dropped."""
        requests = self._requests
        out: dict[str, list[int]] = {}
        for rid, tokens in drafts.items():
            state = requests.get(rid)
            if state is None:
                out[rid] = tokens
                continue
            matcher = state.matcher
            if matcher is None:
                continue
            reasoning = state.reasoning_end
            ws = _WsRun(self._ws_cap, state.ws_run)
            keep = advanced = 0
            for token in tokens:
                if reasoning:
                    if token in reasoning:
                        reasoning = frozenset()
                elif (
                    matcher.is_terminated()
                    or not ws.allows(token)
                    or not matcher.accept_token(token)
                ):
                    break
                else:
                    advanced += 1
                    ws.advance(token)
                keep += 1
            if advanced:
                matcher.rollback(advanced)
            if keep:
                out[rid] = tokens[:keep]
        return out

    def accept_tokens(self, sampled: Mapping[str, int | Sequence[int]]) -> dict[str, int]:
        """Advance each constrained request's matcher by its emitted tokens (one, or a
        verified step's accepted drafts and the token after them), in order.

        Returns the requests whose grammar is now finished, each with how many of its
        tokens it took up to the one that finished it (later ones are not its output):
        terminated (a stop token was taken after the grammar completed) or stuck on a
        token it rejects (possible only when another rule, such as min_tokens banning
        EOS, empties the allowed set).
        """
        done: dict[str, int] = {}
        for rid, state in self._requests.items():
            tokens = sampled.get(rid)
            matcher = state.matcher
            if tokens is None or matcher is None:
                continue
            if isinstance(tokens, int):
                tokens = (tokens,)
            for n, token in enumerate(tokens, 1):
                if state.reasoning_end:
                    if token in state.reasoning_end:
                        state.reasoning_end = frozenset()  # the answer, constrained, starts now
                    continue
                if matcher.is_terminated():
                    done[rid] = n
                elif not matcher.accept_token(token):
                    state.rejected = True
                    logger.warning(
                        "request %s: the grammar rejected token %d; ending it", rid, token
                    )
                    done[rid] = n
                elif matcher.is_terminated():
                    done[rid] = n
                if state.ws_run is not None and self._ws_cap is not None:
                    state.ws_run = self._ws_cap.advance(state.ws_run, token)
                if rid in done:
                    break
        return done

    def shutdown(self) -> None:
        if self._workers is not None:
            self._workers.shutdown()


class _WsRun:
    """A request's whitespace run (`WhitespaceCap`) as a walk through drafts moves it,
    without touching the request's own count."""

    __slots__ = ("cap", "run")

    def __init__(self, cap: WhitespaceCap | None, run: Run | None) -> None:
        self.cap = cap if run is not None else None
        self.run = run or (0, 0)

    def allows(self, token: int) -> bool:
        return self.cap is None or self.cap.allows(self.run, token)

    def advance(self, token: int) -> None:
        if self.cap is not None:
            self.run = self.cap.advance(self.run, token)

    def restrict(self, bitmask: torch.Tensor, row: int) -> None:
        mask = None if self.cap is None else self.cap.mask(self.run)
        if mask is not None:
            bitmask[row].bitwise_and_(mask)


def _fill_row(
    matcher: xgr.GrammarMatcher,
    reasoning: frozenset[int],
    ws: _WsRun,
    bitmask: torch.Tensor,
    row: int,
) -> None:
    """The mask of the next token in the matcher's current state."""
    if reasoning:
        bitmask[row].fill_(-1)  # still reasoning: the grammar has not started
    elif matcher.is_terminated():
        bitmask[row].fill_(-1)  # the request ends with the token that terminated it
    else:
        matcher.fill_next_token_bitmask(bitmask, row)
        ws.restrict(bitmask, row)


def _fill_draft_rows(
    matcher: xgr.GrammarMatcher,
    reasoning: frozenset[int],
    ws: _WsRun,
    drafts: Sequence[int],
    bitmask: torch.Tensor,
    start: int,
) -> tuple[int, frozenset[int]]:
    """Fill rows start.. (one per draft) while walking the matcher through the drafts.

    Returns how many tokens the matcher advanced and whether it is still reasoning after
    the last draft; the count is -(advanced + 1) when a draft was rejected (its row bans
    it, the rows after it copy that row)."""
    advanced = 0
    for j, token in enumerate(drafts):
        row = start + j
        _fill_row(matcher, reasoning, ws, bitmask, row)
        if reasoning:
            if token in reasoning:
                reasoning = frozenset()
            continue
        if matcher.is_terminated() or not ws.allows(token) or not matcher.accept_token(token):
            bitmask[row + 1 : start + len(drafts)] = bitmask[row]
            return -(advanced + 1), reasoning
        advanced += 1
        ws.advance(token)
    return advanced, reasoning
