"""A smaller model of the same vocabulary drafts the next tokens (vLLM's draft-model method).

The draft runs on its own `ModelRunner` with its own paged KV pool and block manager (as
many blocks as the target's pool, each smaller), so the target's pool and scheduler are
untouched. Each step it first catches up on the tokens its cache lacks (the prompt once,
then the tokens the target emitted), then decodes k tokens by argmax, one batched forward
per draft position. Its drafts are deterministic, which the rejection sampler relies on (a
one-hot draft distribution). After verification its cache stays valid up to the first draft
the target did not keep; the rest is recomputed over (slots rolled back, blocks kept).

Limits, said plainly: the draft always runs eagerly (no compiled step, no CUDA graphs), and a
request whose catch-up does not fit the draft's per-step token budget drafts nothing until it
has caught up; when the draft's pool is full the request drafts nothing that step.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pagemill.blockpool import KVCacheManager
from pagemill.runtime.model_config import ModelConfig
from pagemill.runtime.sampling_params import SamplingParams
from pagemill.scheduler import Request, ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:
    from pagemill.runtime.spec_decode.proposer import ProposerSetup
    from pagemill.runtime.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0.0)


@dataclass
class _DraftState:
    shadow: Request  # the draft cache's view: tokens whose KV it holds, and its progress
    new: bool = True  # its block table has not reached the runner yet
    # Leading tokens that are the request's own (not drafts): they never change.
    num_real: int = 0


def check_same_vocabulary(
    target_path: Path, target: ModelConfig, draft_path: Path, draft: ModelConfig
) -> None:
    """A draft must speak the target's token ids: refuse any other pairing at start-up."""
    from pagemill.runtime.model_executor.loader import load_tokenizer

    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft's vocabulary ({draft.vocab_size} ids) "
            f"differs from the target's ({target.vocab_size}); a draft model needs the "
            "target's tokenizer"
        )
    ours, theirs = load_tokenizer(str(target_path)), load_tokenizer(str(draft_path))
    if ours is not None and theirs is not None and ours.get_vocab() != theirs.get_vocab():
        raise ValueError(
            "speculative_config.model: the draft's tokenizer maps tokens to other ids than "
            "the target's; a draft model needs the target's tokenizer"
        )


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, num_blocks: int, k: int, max_model_len: int) -> None:
        self.runner = runner
        self.k = k
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(num_blocks, runner.block_size, enable_caching=False)
        self.budget = runner.max_num_batched_tokens
        self.states: dict[str, _DraftState] = {}
        self._finished: list[str] = []

    @classmethod
    def load(
        cls, setup: ProposerSetup, *, target_path: Path, load_format: str, seed: int
    ) -> DraftModelProposer:
        from pagemill.runtime.model_executor.loader import load_model, resolve_model_path
        from pagemill.runtime.worker.model_runner import ModelRunner

        folder = resolve_model_path(setup.model, None)
        config = ModelConfig.from_pretrained(folder)
        check_same_vocabulary(target_path, setup.target_config, folder, config)
        max_model_len = setup.max_model_len
        if config.max_model_len_limit < max_model_len:
            raise ValueError(
                f"speculative_config.model: the draft's context ({config.max_model_len_limit}) "
                f"is shorter than max_model_len={max_model_len}"
            )
        s = setup
        model = load_model(folder, config, s.dtype, s.device, max_model_len, load_format, seed)
        runner = ModelRunner(
            model,
            config,
            s.device,
            s.dtype,
            s.block_size,
            s.max_num_seqs,
            s.runner_budget,
            max_model_len,
        )
        runner.init_kv_cache(s.num_blocks, prefault=False)  # SpecDecoding.start_prefault
        logger.info("draft model %s: %d KV blocks of its own", folder, s.num_blocks)
        return cls(runner, s.num_blocks, s.num_speculative_tokens, max_model_len)

    # ---------------------------------------------------------------- per step

    def propose_requests(
        self, requests: Sequence[Request], rooms: Sequence[int], live: Collection[str]
    ) -> dict[str, list[int]]:
        for rid in [r for r in self.states if r not in live]:
            self._drop(rid)
        # Catch up (and predict the first draft) in one forward.
        budget = self.budget
        steps: list[ScheduledRequest] = []
        rooms_of: dict[str, int] = {}
        for req, room in zip(requests, rooms):
            room = min(room, self.max_model_len - req.num_tokens)
            if room <= 0 or budget <= 0:
                continue
            step = self._catch_up(req, budget)
            if step is None:
                continue
            budget -= step.num_tokens
            steps.append(step)
            if step.sample:
                rooms_of[req.request_id] = room
        drafts: dict[str, list[int]] = {rid: [] for rid in rooms_of}
        while steps:
            tokens = self._forward(steps)
            steps = []
            for rid, token in tokens.items():
                if rid not in rooms_of:
                    continue
                drafts[rid].append(token)
                if len(drafts[rid]) < rooms_of[rid]:
                    step = self._extend(rid, token)
                    if step is not None:
                        steps.append(step)
        return {rid: d for rid, d in drafts.items() if d}

    def _catch_up(self, req: Request, budget: int) -> ScheduledRequest | None:
        """The step that writes the draft cache up to the request's last token (a part of
        it when the budget is short: then it does not sample)."""
        rid = req.request_id
        tokens = req.all_token_ids
        state = self.states.get(rid)
        if state is None:
            shadow = Request(rid, tokens[:1], sampling_params=_GREEDY)
            state = self.states[rid] = _DraftState(shadow)
        shadow = state.shadow
        # Valid cache: the longest prefix its tokens share with the request's.
        have = shadow.all_token_ids
        valid = min(shadow.num_computed_tokens, len(tokens))
        for i in range(min(state.num_real, valid), valid):
            if have[i] != tokens[i]:
                valid = i
                break
        shadow.all_token_ids = list(tokens)
        state.num_real = len(tokens)
        shadow.num_computed_tokens = valid
        n = min(len(tokens) - valid, budget)
        if n <= 0:  # everything but nothing is cached: recompute the last token
            valid -= 1
            shadow.num_computed_tokens = valid
            n = 1
        return self._schedule(state, valid, tokens[valid : valid + n], valid + n == len(tokens))

    def _extend(self, rid: str, token: int) -> ScheduledRequest | None:
        state = self.states[rid]
        shadow = state.shadow
        shadow.all_token_ids.append(token)
        start = shadow.num_computed_tokens
        return self._schedule(state, start, [token], True)

    def _schedule(
        self, state: _DraftState, start: int, token_ids: list[int], sample: bool
    ) -> ScheduledRequest | None:
        shadow = state.shadow
        blocks = self.kv.allocate_slots(shadow, len(token_ids))
        if blocks is None:
            return None  # the draft pool is full: no drafts this step
        if state.new:
            new_ids = self.kv.get_block_ids(shadow.request_id)
        else:
            new_ids = [b.block_id for b in blocks]
        step = ScheduledRequest(
            shadow.request_id,
            token_ids,
            start,
            len(token_ids),
            new_ids,
            sample,
            state.new,
            shadow,
        )
        state.new = False
        shadow.num_computed_tokens = start + len(token_ids)
        return step

    def _forward(self, steps: list[ScheduledRequest]) -> dict[str, int]:
        out = SchedulerOutput(steps, sum(s.num_tokens for s in steps), [], self._finished)
        self._finished = []
        result = self.runner.execute_model(out)
        if not result.req_ids:
            return {}
        argmax = result.logits[: len(result.req_ids)].argmax(dim=-1).tolist()
        return dict(zip(result.req_ids, argmax))

    def _drop(self, rid: str) -> None:
        del self.states[rid]
        if self.kv.has_request(rid):  # none when its first allocation failed
            self.kv.free(rid)
        self._finished.append(rid)
