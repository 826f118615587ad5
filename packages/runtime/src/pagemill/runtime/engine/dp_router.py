"""Which engine (a data-parallel core, or a Ray Serve replica) should take a request.

One policy object serves both `DPClient` (N cores behind one API server) and the Ray
Serve request router (N replicas behind a proxy), so the two route alike:

- round_robin: in turn.
- least_loaded: fewest requests in flight (routed there, not finished), then lowest KV use.
- prefix: the engine whose prefix cache holds the longest leading run of the prompt's
  block hashes, minus a load penalty. What an engine holds is known from its KV events
  (`apply_events`: one hash set per engine) and, until those arrive, from what was routed
  there (`route` counts each in-flight prompt's hashes as held: a request holds its blocks
  while it runs, and its prefill is not finished, so not yet announced, when the next user
  of the same document arrives; without this the first users of each prefix scatter over
  every engine and each engine ends up caching every prefix). Affinity only holds while
  that engine is within `PREFIX_LOAD_MARGIN` requests of the least loaded one, and each
  request in flight costs `PREFIX_LOAD_PENALTY` blocks of match: without that, one popular
  prefix would pin all traffic on one engine (the failure SGLang's and vLLM's router issues
  describe), and the others would only warm up once it was saturated.

Prompts are hashed with the engines' own hash function and block size, so a hash here is
the hash in their events. Not thread-safe: the caller serializes calls.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from pagemill.blockpool import hash_block_chain
from pagemill.blockpool.hashing import BlockHash, get_hash_fn
from pagemill.runtime.engine.core_client import EngineDeadError
from pagemill.runtime.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from pagemill.runtime.engine.protocol import EngineCoreRequest

ROUTING_POLICIES = ("round_robin", "least_loaded", "prefix")
PREFIX_LOAD_MARGIN = 4
PREFIX_LOAD_PENALTY = 1.0


class DPRouter:
    """Picks an engine for each request and keeps the figures it picks by (see the module
    docstring). `route`/`finish` bracket a request's life; `apply_events` feeds an engine's
    KV events; `kv_usage` and `alive` are set by the owner."""

    def __init__(
        self, policy: str, num_cores: int, block_size: int, hash_algo: str = "sha256"
    ) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {ROUTING_POLICIES}, got {policy!r}")
        self.policy = policy
        self.num_cores = num_cores
        self.block_size = block_size
        self.hash_fn = get_hash_fn(hash_algo)
        self.inflight = [0] * num_cores
        self.kv_usage = [0.0] * num_cores
        self.alive = [True] * num_cores
        self.cached: list[set[BlockHash]] = [set() for _ in range(num_cores)]
        # Hashes of the prompts in flight on each engine (a count per hash).
        self.pending: list[Counter[BlockHash]] = [Counter() for _ in range(num_cores)]
        self.routed = [0] * num_cores
        self._assigned: dict[str, tuple[int, list[BlockHash]]] = {}
        self._next = 0
        # Each engine's matched blocks at the last `prefix` pick (for the routing log).
        self.last_matched: list[int] = []

    def add_engine(self) -> int:
        """One more engine (a Ray Serve replica that came up); returns its index."""
        self.num_cores += 1
        self.inflight.append(0)
        self.kv_usage.append(0.0)
        self.alive.append(True)
        self.cached.append(set())
        self.pending.append(Counter())
        self.routed.append(0)
        return self.num_cores - 1

    # ------------------------------------------------------------ what engines hold

    def apply_events(self, core: int, events: Sequence[Any]) -> None:
        index = self.cached[core]
        for ev in events:
            if isinstance(ev, BlockStored):
                index.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                index.difference_update(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                index.clear()

    def hash_prompt(
        self, token_ids: Sequence[int], cache_salt: str | None = None
    ) -> list[BlockHash]:
        return hash_block_chain(
            self.hash_fn, token_ids, self.block_size, () if cache_salt is None else (cache_salt,)
        )

    def prompt_hashes(self, request: EngineCoreRequest) -> list[BlockHash]:
        return self.hash_prompt(request.prompt_token_ids, request.cache_salt)

    def matched_blocks(self, core: int, hashes: Sequence[BlockHash]) -> int:
        index, pending = self.cached[core], self.pending[core]
        n = 0
        for h in hashes:
            if h not in index and h not in pending:
                break
            n += 1
        return n

    # ------------------------------------------------------------ a request's life

    def route(
        self, request_id: str, token_ids: Sequence[int], cache_salt: str | None = None
    ) -> int:
        """Pick an engine for the request and count it there until `finish`."""
        hashes = self.hash_prompt(token_ids, cache_salt) if self.policy == "prefix" else []
        k = self._pick(hashes)
        self.inflight[k] += 1
        self.routed[k] += 1
        self._assigned[request_id] = (k, hashes)
        self.pending[k].update(hashes)
        return k

    def finish(self, request_id: str, assume_cached: bool = False) -> int | None:
        """The request ended (or was aborted): the engine it was on, None if unknown.
        `assume_cached`: count its prompt as cached there until the engine's next account
        (for an owner that learns by polling, not from every step's events)."""
        entry = self._assigned.pop(request_id, None)
        if entry is None:
            return None
        k, hashes = entry
        if assume_cached:
            self.cached[k].update(hashes)
        self.inflight[k] -= 1
        pending = self.pending[k]
        pending.subtract(hashes)
        for h in hashes:
            if pending[h] <= 0:
                del pending[h]
        return k

    def move(self, request_id: str, core: int) -> None:
        """The request ran on `core` after all (the chosen engine turned it away)."""
        entry = self._assigned.get(request_id)
        if entry is None or entry[0] == core:
            return
        hashes = entry[1]
        self.finish(request_id)
        self.routed[entry[0]] -= 1
        self.inflight[core] += 1
        self.routed[core] += 1
        self._assigned[request_id] = (core, hashes)
        self.pending[core].update(hashes)

    def finish_all(self) -> None:
        for rid in list(self._assigned):
            self.finish(rid)

    def where(self, request_id: str) -> int | None:
        entry = self._assigned.get(request_id)
        return None if entry is None else entry[0]

    def assigned(self, request_id: str) -> tuple[int, list[BlockHash]] | None:
        """The engine a request in flight is counted on and its prompt's hashes."""
        entry = self._assigned.get(request_id)
        return None if entry is None else (entry[0], list(entry[1]))

    def engine_stopped(self, core: int) -> list[str]:
        """Forget a stopped engine; returns the ids of the requests it held."""
        self.alive[core] = False
        lost = [rid for rid, (k, _) in self._assigned.items() if k == core]
        for rid in lost:
            del self._assigned[rid]
        self.inflight[core] = 0
        self.cached[core].clear()
        self.pending[core].clear()
        return lost

    # ------------------------------------------------------------ the policies

    def choose(self, request: EngineCoreRequest) -> int:
        """The engine `route` would pick, without counting the request anywhere."""
        return self._pick(self.prompt_hashes(request) if self.policy == "prefix" else [])

    def _pick(self, hashes: Sequence[BlockHash]) -> int:
        live = [k for k in range(self.num_cores) if self.alive[k]]
        if not live:
            raise EngineDeadError("every data-parallel engine core has stopped")
        if self.policy == "round_robin":
            for _ in range(self.num_cores):
                k = self._next % self.num_cores
                self._next += 1
                if self.alive[k]:
                    return k
        least = self._least_loaded(live)
        if self.policy == "least_loaded":
            return least
        floor = self.inflight[least]
        best, best_score = least, 0.0
        self.last_matched = [
            self.matched_blocks(k, hashes) if self.alive[k] else 0 for k in range(self.num_cores)
        ]
        for k in live:
            if self.inflight[k] > floor + PREFIX_LOAD_MARGIN:
                continue
            matched = self.last_matched[k]
            if not matched:
                continue
            score = matched - PREFIX_LOAD_PENALTY * (self.inflight[k] - floor)
            if score > best_score:
                best, best_score = k, score
        return best

    def _least_loaded(self, live: list[int]) -> int:
        # Ties go to the engine after the last one picked, so equal engines take turns.
        start = self._next
        self._next += 1
        order = [live[(start + i) % len(live)] for i in range(len(live))]
        return min(order, key=lambda k: (self.inflight[k], self.kv_usage[k]))
