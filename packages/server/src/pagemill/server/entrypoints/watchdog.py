"""Is the engine healthy: dead, stalled in one step, or fine — and when to give up.

A step that hangs (a deadlocked kernel, a device that stopped answering) leaves every
stream silent while the process looks alive. The engine client records when the running
step started (in-process: on its thread; engine process: in shared memory, so a hung
process is seen without asking it). A step older than `step_timeout` makes /health answer
503, so a load balancer stops sending traffic; if it is still running `grace` seconds
later, the server exits non-zero so a supervisor restarts it. A dead engine (an error no
request could be blamed for, or an engine process that exited) exits the same way at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

DEFAULT_STEP_TIMEOUT = 300.0
DEFAULT_STEP_GRACE = 30.0


@dataclass(frozen=True)
class Verdict:
    healthy: bool
    fatal: bool
    reason: str | None = None


class Watchdog:
    def __init__(
        self,
        client: Any,
        step_timeout: float | None = DEFAULT_STEP_TIMEOUT,
        grace: float = DEFAULT_STEP_GRACE,
    ) -> None:
        if step_timeout is not None and not step_timeout > 0:
            raise ValueError(f"step_timeout must be > 0 seconds (or None), got {step_timeout}")
        if not grace >= 0:
            raise ValueError(f"grace must be >= 0 seconds, got {grace}")
        self.client = client
        self.step_timeout = step_timeout
        self.grace = grace

    def check(self, now: float | None = None) -> Verdict:
        client = self.client
        if client.is_dead:
            return Verdict(False, True, "the engine has stopped")
        started = getattr(client, "step_started_at", None)
        if self.step_timeout is None or started is None:
            return Verdict(True, False)
        running = (time.monotonic() if now is None else now) - started
        if running <= self.step_timeout:
            return Verdict(True, False)
        reason = (
            f"the engine is stalled: one step has run for {running:.0f} s "
            f"(step timeout {self.step_timeout:g} s)"
        )
        return Verdict(False, running > self.step_timeout + self.grace, reason)
