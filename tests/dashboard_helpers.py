"""A scripted engine core for the dashboard tests: the real scheduler and block pool, no model.

`ScriptedCore` has the `EngineCore` surface a client drives (`add_request`,
`abort_requests`, `step() -> EngineCoreOutputs`, `get_stats`, `ready_message`, ...) and the
`scheduler` the dashboard's pictures read; it runs behind the server's real front end
(`AsyncEngine(client=ThreadedClient(core), ...)`, see `server_helpers.front_end`). Its steps
schedule for real and "sample" a fixed token per request (as `pagemill simulate` does), so
the pool holds exactly the blocks a real engine would. While `paused` it reports nothing
to run, so the core's thread sleeps on its command queue and a test can set up a pool
state through `client.submit(...)` (which runs on that thread) and look at it.
"""

from __future__ import annotations

import os
import time
from typing import Any

from pagemill.blockpool import KVCacheManager
from pagemill.runtime.engine.protocol import (
    FINISH_REASONS,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from pagemill.scheduler import Request, RequestStatus, Scheduler
from pagemill.scheduler.config import SchedulerConfig

BLOCK_SIZE = 16


class ScriptedCore:
    def __init__(
        self,
        num_blocks: int = 64,
        *,
        max_num_seqs: int = 8,
        step_delay: float = 0.0,
        max_model_len: int = 1024,
    ) -> None:
        self.kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching=True)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=256, max_num_seqs=max_num_seqs, max_model_len=max_model_len
            ),
            self.kv,
        )
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.paused = True
        self.step_delay = step_delay

    # ---- what a client drives
    def ready_message(self) -> EngineCoreReady:
        return EngineCoreReady(
            self.max_model_len, self.num_blocks, BLOCK_SIZE, "float32", "cpu", os.getpid()
        )

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(
            Request(
                request.request_id,
                request.prompt_token_ids,
                max_tokens=request.max_tokens,
                ignore_eos=True,
            )
        )

    def abort_requests(self, request_ids: Any, reason: FinishReason = FinishReason.ABORT) -> None:
        self.scheduler.abort_requests(list(request_ids))

    def has_unfinished_requests(self) -> bool:
        return not self.paused and self.scheduler.has_unfinished_requests()

    def get_stats(self) -> SchedulerStats:
        s = self.scheduler.get_stats()
        return SchedulerStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_cache_usage=s.kv_cache_usage,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            num_blocks=self.num_blocks,
            block_size=BLOCK_SIZE,
        )

    def step(self) -> EngineCoreOutputs:
        if self.step_delay:
            time.sleep(self.step_delay)
        out = self.scheduler.schedule()
        sampled = {s.request_id: 7 for s in out.scheduled if s.sample}
        updates = self.scheduler.update_from_output(out, sampled)
        return EngineCoreOutputs(
            [
                EngineCoreOutput(
                    u.request_id,
                    u.new_token_ids,
                    FINISH_REASONS[u.finish_reason] if u.finished else None,
                )
                for u in updates
            ],
            num_scheduled_tokens=out.total_num_scheduled_tokens,
        )

    def on_worker_failure(self, handler: Any) -> None:
        pass

    def shutdown(self) -> None:
        pass

    # ---- scripting (call through client.submit, on the core's thread)
    def add(self, request_id: str, prompt: list[int], max_tokens: int = 8) -> None:
        self.scheduler.add_request(
            Request(request_id, prompt, max_tokens=max_tokens, ignore_eos=True)
        )

    def schedule_once(self) -> None:
        """One step's scheduling and a token for each sampling request, regardless of pause."""
        out = self.scheduler.schedule()
        self.scheduler.update_from_output(out, {s.request_id: 7 for s in out.scheduled if s.sample})

    def finish_all(self) -> None:
        ids = list(self.scheduler.requests)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        self.scheduler.schedule()  # flushes the finished ids; nothing is left to run


def find_chromium() -> str | None:
    """Debian's chromium (or $PAGEMILL_CHROMIUM): Playwright's own download cannot work here."""
    import os
    import shutil

    explicit = os.environ.get("PAGEMILL_CHROMIUM")
    if explicit:
        return explicit if os.path.exists(explicit) else None
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None
