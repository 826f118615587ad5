"""Draft tokens (speculative decoding) in the scheduler: scheduled after the next token with
KV slots for them, the computed count rolled back past rejected drafts, stop rules applied
token by token, drafts dropped on preemption and capped by the budget and max_model_len."""

from __future__ import annotations

import pytest

from pagemill.blockpool import KVCacheManager
from pagemill.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig

EOS = 2


def make(num_blocks: int = 64, **cfg) -> tuple[Scheduler, KVCacheManager]:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=4, enable_caching=True)
    return Scheduler(SchedulerConfig(**cfg), kv), kv


def decode_ready(s: Scheduler, prompt: list[int], **kw) -> Request:
    """A request whose prompt is computed and whose first token is sampled."""
    r = Request("r", prompt, eos_token_id=EOS, **kw)
    s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, {"r": 9})
    return r


def test_drafts_are_scheduled_after_the_next_token_with_slots() -> None:
    s, kv = make()
    r = decode_ready(s, [5, 6, 7])  # 4 tokens, 3 computed
    s.update_draft_token_ids({"r": [11, 12, 13]})
    out = s.schedule()
    (sched,) = out.scheduled
    assert (sched.start_pos, sched.num_tokens, sched.sample) == (3, 4, True)
    assert sched.token_ids == [9, 11, 12, 13]
    assert list(sched.spec_token_ids) == [11, 12, 13]
    assert r.spec_token_ids == []  # consumed
    assert kv.num_request_blocks("r") * 4 >= 7  # slots for every draft
    assert r.num_computed_tokens == 7
    # Two drafts accepted, then the correction token: 3 new tokens, computed rolled back.
    (update,) = s.update_from_output(out, {"r": [11, 12, 40]})
    assert update.new_token_ids == [11, 12, 40]
    assert r.all_token_ids == [5, 6, 7, 9, 11, 12, 40]
    assert r.num_computed_tokens == 6  # all but the newest token
    out = s.schedule()
    assert (out.scheduled[0].start_pos, out.scheduled[0].token_ids) == (6, [40])


def test_all_rejected_keeps_one_token_and_rolls_back_every_draft() -> None:
    s, _ = make()
    r = decode_ready(s, [5, 6, 7])
    s.update_draft_token_ids({"r": [11, 12]})
    out = s.schedule()
    s.update_from_output(out, {"r": [30]})
    assert r.all_token_ids[-2:] == [9, 30]
    assert r.num_computed_tokens == r.num_tokens - 1


def test_stop_inside_the_accepted_tokens_drops_the_rest() -> None:
    s, kv = make()
    r = decode_ready(s, [5, 6, 7], max_tokens=10)
    s.update_draft_token_ids({"r": [11, EOS, 12]})
    out = s.schedule()
    (update,) = s.update_from_output(out, {"r": [11, EOS, 12, 13]})
    assert update.finished and update.finish_reason == "stop"
    assert update.new_token_ids == [11, EOS]
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert not kv.has_request("r")


def test_max_tokens_caps_accepted_tokens() -> None:
    s, _ = make()
    decode_ready(s, [5, 6, 7], max_tokens=3)  # one output so far
    s.update_draft_token_ids({"r": [11, 12, 13]})
    out = s.schedule()
    (update,) = s.update_from_output(out, {"r": [11, 12, 13, 14]})
    assert update.new_token_ids == [11, 12] and update.finish_reason == "length"


def test_budget_and_max_model_len_trim_drafts() -> None:
    s, _ = make(max_num_batched_tokens=3, max_model_len=64)
    decode_ready(s, [5, 6])
    s.update_draft_token_ids({"r": [11, 12, 13, 14]})
    out = s.schedule()
    assert out.scheduled[0].token_ids == [9, 11, 12]
    assert list(out.scheduled[0].spec_token_ids) == [11, 12]
    with pytest.raises(ValueError, match="verified 2 drafts"):
        s.update_from_output(out, {"r": [11, 12, 13, 14]})

    s, _ = make(max_model_len=6)
    decode_ready(s, [5, 6, 7])  # 4 tokens: positions 4 and 5 are left
    s.update_draft_token_ids({"r": [11, 12, 13]})
    out = s.schedule()
    assert list(out.scheduled[0].spec_token_ids) == [11, 12]


def test_preemption_drops_drafts_and_recomputes() -> None:
    # 4 blocks of 4 tokens: two requests of 7 tokens each fill them; drafts need more.
    s, _ = make(num_blocks=5)
    a = Request("a", [1] * 7, eos_token_id=EOS)
    b = Request("b", [3] * 7, eos_token_id=EOS)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    s.update_from_output(out, {"a": 9, "b": 9})
    s.update_draft_token_ids({"a": [4, 4, 4, 4], "b": [4, 4, 4, 4]})
    out = s.schedule()
    assert out.preempted_req_ids == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.spec_token_ids == []
    assert b.num_computed_tokens == 0
    assert [x.request_id for x in out.scheduled] == ["a"]
    s.update_from_output(out, {"a": [4, 8]})
    assert a.num_computed_tokens == a.num_tokens - 1 == 9


def test_drafts_for_requests_not_running_are_ignored() -> None:
    s, _ = make()
    s.add_request(Request("w", [1, 2, 3], eos_token_id=EOS))
    s.update_draft_token_ids({"w": [5], "gone": [6]})
    assert s.get_request("w").spec_token_ids == []
