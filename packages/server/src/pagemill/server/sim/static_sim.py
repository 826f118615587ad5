"""The pre-2023 baseline: static batching with a contiguous max-length KV reservation.

A batch is formed from the queue when the GPU is idle; every member reserves ``max_model_len``
tokens of contiguous KV up front (the allocator cannot know how long it will generate), so the
batch size is ``pool tokens // max_model_len``; the batch prefills all its prompts in one step,
then decodes until its longest member finishes, and nobody joins mid-batch.

The baseline is simulated generously, with the same roofline cost model as the paged system:
prompts are not padded to the longest one and members that finished stop computing (they only
keep their reservation). Whatever gap remains comes from scheduling and memory reservation
alone, not from a handicapped cost model.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from pagemill.server.sim.cost_model import RooflineCostModel
from pagemill.server.sim.hardware import Deployment
from pagemill.server.sim.metrics import RunRecorder, RunResult
from pagemill.server.sim.workload import SimRequest


class StaticBatchSimulator:
    def __init__(self, deployment: Deployment, *, name: str = "static") -> None:
        self.deployment = deployment
        self.name = name
        slots = deployment.kv_token_capacity // deployment.max_model_len
        self.batch_slots = min(deployment.max_num_seqs, slots)
        if self.batch_slots <= 0:
            raise ValueError(
                f"static batching needs {deployment.max_model_len} contiguous KV tokens per "
                f"sequence but the pool holds {deployment.kv_token_capacity}"
            )

    def run(self, requests: Sequence[SimRequest]) -> RunResult:
        cost = self.deployment.cost_model
        max_len = self.deployment.max_model_len
        rec = RunRecorder(self.name)
        reqs = sorted(requests, key=lambda r: (r.arrival_time, r.index))
        queue: deque[SimRequest] = deque()
        clock = 0.0
        nxt = 0
        while nxt < len(reqs) or queue:
            while nxt < len(reqs) and reqs[nxt].arrival_time <= clock:
                rec.arrive(reqs[nxt].request_id, reqs[nxt].arrival_time, reqs[nxt].prompt_len)
                queue.append(reqs[nxt])
                nxt += 1
            if not queue:
                clock = reqs[nxt].arrival_time
                continue
            batch = [queue.popleft() for _ in range(min(self.batch_slots, len(queue)))]
            clock = self._run_batch(batch, clock, rec, cost, max_len)
        return rec.result()

    @staticmethod
    def _run_batch(
        batch: list[SimRequest],
        clock: float,
        rec: RunRecorder,
        cost: RooflineCostModel,
        max_len: int,
    ) -> float:
        reserved = len(batch) * max_len
        # Prefill: every prompt in one step, each member samples its first token.
        prompt_tokens = sum(r.prompt_len for r in batch)
        dt = cost.step_time([(r.prompt_len, r.prompt_len) for r in batch])
        clock += dt
        rec.step(clock, dt, len(batch), prompt_tokens, prompt_tokens, reserved, prompt_tokens)
        generated = [1] * len(batch)
        for r in batch:
            rec.token(r.request_id, clock)
            if r.output_len == 1:
                rec.finish(r.request_id, clock)
        # Decode until the longest member is done; the reservation is held throughout.
        while True:
            active = [i for i, r in enumerate(batch) if generated[i] < r.output_len]
            if not active:
                break
            dt = cost.step_time([(1, batch[i].prompt_len + generated[i]) for i in active])
            clock += dt
            # KV stored after this step: each member's prompt plus every token fed back so far
            # (a finished member's last sampled token was never fed back).
            stored = sum(
                r.prompt_len + min(generated[i], r.output_len - 1) for i, r in enumerate(batch)
            )
            rec.step(clock, dt, len(active), len(active), 0, reserved, stored)
            for i in active:
                generated[i] += 1
                r = batch[i]
                rec.token(r.request_id, clock)
                if generated[i] == r.output_len:
                    rec.finish(r.request_id, clock)
        return clock
