"""A scripted engine for the dashboard tests: the real scheduler and block pool, no model.

`ScriptedEngine` satisfies what `AsyncEngine`, `build_app` and the dashboard read of an
engine (`scheduler`, `get_stats`, `iteration_stats`, `step`, ...). Its steps schedule for
real and "sample" a fixed token per request (as `pagemill simulate` does), so the pool holds
exactly the blocks a real engine would. While `paused` it reports nothing to run, so the
engine thread sleeps on its command queue and a test can set up a pool state through
`client.submit(...)` and look at it.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from pagemill.blockpool import KVCacheManager
from pagemill.scheduler import Request, RequestStatus, Scheduler
from pagemill.scheduler.config import SchedulerConfig
from pagemill.server.dashboard.series import TokenClock

BLOCK_SIZE = 16


class ScriptedEngine:
    def __init__(self, num_blocks: int = 64, *, max_num_seqs: int = 8, step_delay: float = 0.0,
                 max_model_len: int = 1024) -> None:
        self.kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching=True)
        self.scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=256,
                                                   max_num_seqs=max_num_seqs,
                                                   max_model_len=max_model_len), self.kv)
        self.max_model_len = max_model_len
        self.tokenizer = None
        self.model_config = None
        self.paused = True
        self.step_delay = step_delay
        self.iteration_stats: Any = None
        self._tokens = TokenClock()

    # ---- what AsyncEngine drives
    def add_request(self, request_id: str, prompt: Any, params: Any, **kwargs: Any) -> None:
        raise NotImplementedError("add requests with add() through client.submit")

    def abort_request(self, request_ids: Any) -> None:
        self.scheduler.abort_requests(list(request_ids))

    def has_unfinished_requests(self) -> bool:
        return not self.paused and self.scheduler.has_unfinished_requests()

    def get_stats(self) -> Any:
        return self.scheduler.get_stats()

    def step(self) -> list[Any]:
        if self.step_delay:
            time.sleep(self.step_delay)
        out = self.scheduler.schedule()
        now = time.monotonic()
        sampled = {s.request_id: 7 for s in out.scheduled if s.sample}
        updates = self.scheduler.update_from_output(out, sampled)
        prompt, gen, ttft, itl = self._tokens.observe(now, updates, self.scheduler)
        self.iteration_stats = SimpleNamespace(
            num_prompt_tokens=prompt, num_generation_tokens=gen, time_to_first_tokens=ttft,
            inter_token_latencies=itl, finished_requests=[])
        return []

    # ---- scripting (call through client.submit, on the engine thread)
    def add(self, request_id: str, prompt: list[int], max_tokens: int = 8) -> None:
        self.scheduler.add_request(Request(request_id, prompt, max_tokens=max_tokens,
                                           ignore_eos=True))

    def schedule_once(self) -> None:
        """One step's scheduling and a token for each sampling request, regardless of pause."""
        out = self.scheduler.schedule()
        self.scheduler.update_from_output(out, {s.request_id: 7 for s in out.scheduled
                                                if s.sample})

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
