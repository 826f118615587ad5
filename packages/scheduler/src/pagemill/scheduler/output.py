"""What one schedule() hands the model runner, and what update_from_output hands back.

The runner builds its batch from these objects alone: per request the input ids of this
step, the position of the first one, what changed in its block table, and the
request record itself for whatever per-request state it mirrors (sampling parameters,
output tokens); it never reads scheduler internals. Slotted dataclasses keep 256 of them
per step cheap to build.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagemill.scheduler.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step.

    `token_ids` is a fresh slice (`all_token_ids[start_pos:start_pos + num_tokens]`), the
    runner may keep it. The block table itself is the KV cache manager's
    (`KVCacheManager.get_block_ids`); the step carries only what changed in it:
    `new_block_ids` (a fresh list the runner may keep) is the whole table when `is_new`, and
    otherwise the block ids this step appended (usually none), so a runner that mirrors
    tables appends instead of rewriting the row. `is_new` marks the first step after an
    admission or a re-admission after preemption: the table and the computed prefix start
    over, so a runner that keeps per-request state must (re)build it from `request` rather
    than patch what it had. `request` is read-only to the runner.

    `group_block_ids` is set when the KV cache manager keeps one table per KV cache group
    (`pagemill.blockpool.HybridKVCacheManager`): the same change for every group's table,
    in group order (`new_block_ids` is then group 0's); None when it has one table, or
    when no group's table changed.

    `spec_token_ids` are the draft tokens (speculative decoding) this step verifies: they
    are the last `len(spec_token_ids)` entries of `token_ids`, past the request's own
    tokens, and a request with drafts samples at each of them and after the last.

    `num_kept_blocks` is set on the first step after the request's table lost its tail
    (blocks that held only rejected drafts went back to the pool): a runner that mirrors
    the table cuts it to this many entries (in every group) before appending
    `new_block_ids`. None when the table only grew.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    num_tokens: int
    new_block_ids: list[int]
    sample: bool
    is_new: bool
    request: Request
    group_block_ids: tuple[list[int], ...] | None = None
    spec_token_ids: Sequence[int] = ()
    num_kept_blocks: int | None = None

    @property
    def num_new_blocks(self) -> int:
        """Entries this step added to the request's table (the whole table when is_new)."""
        return len(self.new_block_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """A step's batch; requests appear in the order the runner should lay them out."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    preempted_req_ids: list[str] = field(default_factory=list)
    # Finished (stopped, capped, aborted, ignored) since the previous schedule(): the runner
    # can drop any state it keeps for them.
    finished_req_ids: list[str] = field(default_factory=list)

    @property
    def num_scheduled_requests(self) -> int:
        return len(self.scheduled)

    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class RequestUpdate:
    """New tokens and, when it ended, why; `stop_reason` is the stop token id that ended it,
    or for an ignored request a sentence saying why it could never run."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None = None
