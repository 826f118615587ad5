"""Containing a step that raises: find the request that causes it, fail it, keep the rest.

One request can make a whole step fail (a token the model mishandles, parameters that
break the sampler, a bug hit by one shape). Failing every request in the batch would let
any user take down everyone's work, so a failed step is undone instead — every running
request is preempted, which costs a recompute and loses no token — and its requests are
split in halves and run again one group at a time while everything else waits aside. A
group whose step fails again is split again; a group of one is the culprit and finishes
with finish_reason "error"; a group that gets through (recomputed every token it had when
the step failed) is cleared. When no suspect is left, normal scheduling resumes. Finding
the culprit among k requests costs about log2(k) failed steps.

Not containable, and re-raised for the process to exit (a supervisor restarts it): device
errors (CUDA's are sticky: every later kernel launch fails too) and a fault that keeps
striking requests one after another with no good step between — then the engine itself,
not a request, is broken.

`FaultIsolator` is a component beside the scheduler that uses only its public surface:
`undo_step` (forget a step the runner did not compute), `preempt_all_running`,
`restrict_to` (schedule only a subset until lifted), `finish_requests` and `get_request`.
The engine core calls `on_step_failed` when a step raises and `on_step_done` after a good
one. Faults are injected for drills and tests from outside, through the engine core's
public `model_runner` (see `pagemill.runtime.engine.fault_injection`).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING

from pagemill.scheduler import RequestStatus, RequestUpdate

if TYPE_CHECKING:
    from pagemill.scheduler import Scheduler, SchedulerOutput

logger = logging.getLogger(__name__)

# Culprits found in a row, with no successful step between, before the engine gives up.
MAX_CONSECUTIVE_CULPRITS = 8

_DEVICE_ERROR_MARKERS = (
    "CUDA error",
    "CUBLAS_STATUS",
    "CUDNN_STATUS",
    "device-side assert",
    "illegal memory access",
    "NCCL",
    "HIP error",
    "unspecified launch failure",
    "CUDA driver",
)


class EngineFaultError(RuntimeError):
    """A step failure the engine cannot contain; the process should exit."""


def is_unrecoverable(exc: BaseException) -> bool:
    """Device errors leave the device unusable for every request: never retried."""
    if isinstance(exc, EngineFaultError):
        return True
    accel = getattr(__import__("torch"), "AcceleratorError", None)
    if accel is not None and isinstance(exc, accel):
        return True
    text = str(exc)
    return any(marker in text for marker in _DEVICE_ERROR_MARKERS)


class FaultIsolator:
    """The isolation state machine beside one scheduler (the engine core owns both)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._groups: deque[list[str]] = deque()  # suspects still to run, in order
        self._testing: list[str] | None = None
        # Tokens each suspect had when its step failed: it is cleared once recomputed past.
        self._targets: dict[str, int] = {}
        self._culprits_in_a_row = 0
        self.num_failed_steps = 0
        self.num_culprits = 0

    @property
    def active(self) -> bool:
        return self._testing is not None

    @property
    def suspects(self) -> list[str]:
        """The group of suspects the scheduler is restricted to now (empty when inactive)."""
        return list(self._testing or ())

    def on_step_failed(self, output: SchedulerOutput, exc: Exception) -> list[RequestUpdate]:
        """Undo the step and take the next isolation move; returns error updates (if any).

        Re-raises `exc` when it cannot be contained (`is_unrecoverable`), and raises
        EngineFaultError when the engine, not a request, is at fault.
        """
        if is_unrecoverable(exc):
            raise exc
        self.num_failed_steps += 1
        ids = [s.request_id for s in output.scheduled]
        if not ids:
            raise EngineFaultError(f"a step with no request failed: {exc!r}") from exc
        logger.warning(
            "a step over %d request(s) failed (%s: %s); isolating the cause",
            len(ids),
            type(exc).__name__,
            exc,
            exc_info=exc,
        )
        sched = self.scheduler
        for s in output.scheduled:
            self._targets[s.request_id] = max(
                self._targets.get(s.request_id, 0), s.request.num_tokens
            )
        sched.undo_step(output)
        updates: list[RequestUpdate] = []
        if len(ids) == 1:
            self._culprits_in_a_row += 1
            self.num_culprits += 1
            if self._culprits_in_a_row > MAX_CONSECUTIVE_CULPRITS:
                raise EngineFaultError(
                    f"{self._culprits_in_a_row} requests in a row failed alone; the engine, "
                    f"not a request, is at fault: {exc!r}"
                ) from exc
            logger.error(
                "request %s fails every step it is in (%s); finishing it with an error",
                ids[0],
                type(exc).__name__,
            )
            self._targets.pop(ids[0], None)
            updates = self._fail(ids, f"the engine failed on this request ({type(exc).__name__})")
        else:
            half = len(ids) // 2
            self._groups.appendleft(ids[half:])
            self._groups.appendleft(ids[:half])
        self._next_group()
        return updates

    def _fail(self, request_ids: list[str], reason: str) -> list[RequestUpdate]:
        """Finish the culprit(s) with finish_reason "error"; their blocks are freed now."""
        sched = self.scheduler
        ids = [rid for rid in request_ids if sched.get_request(rid) is not None]
        sched.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        return [RequestUpdate(rid, [], True, "error", reason) for rid in ids]

    def on_step_done(self) -> None:
        """After a good step: clear the group under test once it has recomputed everything."""
        self._culprits_in_a_row = 0
        if self._testing is None:
            return
        sched = self.scheduler
        for rid in self._testing:
            req = sched.get_request(rid)
            if req is not None and req.num_computed_tokens < self._targets.get(rid, 0):
                return
        for rid in self._testing:
            self._targets.pop(rid, None)
        self._next_group()

    def _next_group(self) -> None:
        sched = self.scheduler
        sched.preempt_all_running()  # each group runs alone, with the whole pool
        while self._groups:
            group = [rid for rid in self._groups.popleft() if sched.get_request(rid) is not None]
            if group:
                self._testing = group
                sched.restrict_to(group)
                return
        self._testing = None
        self._targets.clear()
        sched.restrict_to(None)
