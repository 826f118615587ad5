"""Draft tokens (speculative decoding) in the scheduler: scheduled after the next token with
KV slots for them, the computed count rolled back past rejected drafts, stop rules applied
token by token, drafts dropped on preemption and capped by the budget and max_model_len."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def test_rejected_drafts_blocks_return_to_the_pool_in_the_same_step() -> None:
    """Free blocks after a step whose drafts were all rejected equal those after the same
    step without drafts; the table the runner mirrors is cut where the manager's was."""
    with_drafts, kv = make()
    r = decode_ready(with_drafts, [5, 6, 7])  # 4 tokens, 3 computed: one block
    plain, kv_plain = make()
    decode_ready(plain, [5, 6, 7])
    with_drafts.update_draft_token_ids({"r": [11, 12, 13, 14, 15, 16]})
    out = with_drafts.schedule()
    assert kv.num_request_blocks("r") == 3  # slots for 10 tokens
    with_drafts.update_from_output(out, {"r": [30]})
    plain.update_from_output(plain.schedule(), {"r": 30})
    assert kv.get_num_free_blocks() == kv_plain.get_num_free_blocks() == 64 - 1
    assert r.num_computed_tokens == 4 and kv.num_request_blocks("r") == 1
    # The runner hears of it when the request runs next, and the table grows from there.
    (sched,) = with_drafts.schedule().scheduled
    assert sched.num_kept_blocks == 1 and len(sched.new_block_ids) == 1
    assert kv.get_block_ids("r")[1] == sched.new_block_ids[0]
    (sched,) = plain.schedule().scheduled
    assert sched.num_kept_blocks is None


def test_partly_accepted_drafts_keep_the_blocks_of_what_was_accepted() -> None:
    s, kv = make()
    r = decode_ready(s, [5, 6, 7])
    s.update_draft_token_ids({"r": [11, 12, 13, 14, 15, 16, 17, 18]})
    out = s.schedule()  # positions 3..11: three blocks
    s.update_from_output(out, {"r": [11, 12, 13, 40]})  # 3 accepted, 5 rejected
    assert r.num_computed_tokens == 7 and kv.num_request_blocks("r") == 2
    assert kv.get_num_free_blocks() == 64 - 2


def test_drafts_for_requests_not_running_are_ignored() -> None:
    s, _ = make()
    s.add_request(Request("w", [1, 2, 3], eos_token_id=EOS))
    s.update_draft_token_ids({"w": [5], "gone": [6]})
    assert s.get_request("w").spec_token_ids == []


# ---- a property: speculation never changes what plain decoding gives -----------------------

VOCAB = 11


def target_next(tokens: list[int]) -> int:
    """A deterministic stand-in for the model's greedy choice after `tokens`."""
    return (sum(tokens[-3:]) * 7 + len(tokens)) % VOCAB + 3


def run(prompts, max_tokens, drafts_of, num_blocks, budget, prefix) -> tuple[dict, int]:
    """Drive the scheduler with a fake runner: KV is written per slot and every context
    read back through the block table the runner mirrors (from `new_block_ids`, `is_new`
    and `num_kept_blocks` alone); drafts are verified against `target_next`. After every
    step a running request holds exactly the blocks of its computed tokens: none is
    left holding only rejected drafts."""
    kv = KVCacheManager(num_blocks=num_blocks, block_size=4, enable_caching=prefix)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_model_len=64), kv)
    for i, p in enumerate(prompts):
        s.add_request(Request(f"r{i}", p, max_tokens=max_tokens[i], eos_token_id=None))
    slots: dict[int, tuple[int, ...]] = {}
    mirror: dict[str, list[int]] = {}
    results: dict[str, list[int]] = {}
    steps = 0
    while s.has_unfinished_requests():
        steps += 1
        assert steps < 2000
        out = s.schedule()
        sampled: dict[str, int | list[int]] = {}
        for x in out.scheduled:
            if x.is_new:
                mirror[x.request_id] = list(x.new_block_ids)
            else:
                if x.num_kept_blocks is not None:
                    del mirror[x.request_id][x.num_kept_blocks :]
                mirror[x.request_id] += x.new_block_ids
            table = mirror[x.request_id]
            assert table == kv.get_block_ids(x.request_id)
            seq = list(x.request.all_token_ids[: x.start_pos]) + list(x.token_ids)
            for p in range(x.start_pos):  # the context this step attends to
                assert slots[table[p // 4] * 4 + p % 4] == tuple(seq[: p + 1])
            for p in range(x.start_pos, x.start_pos + x.num_tokens):
                slots[table[p // 4] * 4 + p % 4] = tuple(seq[: p + 1])
            if not x.sample:
                continue
            base = len(x.request.all_token_ids)
            if not x.spec_token_ids:
                sampled[x.request_id] = target_next(seq[:base])
                continue
            accepted: list[int] = []
            for j, d in enumerate(x.spec_token_ids):
                want = target_next(seq[: base + j])
                if d != want:
                    accepted.append(want)
                    break
                accepted.append(d)
            else:
                accepted.append(target_next(seq))
            sampled[x.request_id] = accepted
        for u in s.update_from_output(out, sampled):
            results.setdefault(u.request_id, []).extend(u.new_token_ids)
        for r in s.running:
            assert kv.num_request_blocks(r.request_id) == -(-r.num_computed_tokens // 4)
        live = {r.request_id: r for r in s.running}
        s.update_draft_token_ids(
            {
                rid: drafts_of(r.all_token_ids)
                for rid, r in live.items()
                if r.num_computed_tokens == r.num_tokens - 1
            }
        )
    assert kv.get_num_free_blocks() == num_blocks
    return results, s.num_preemptions


def plain(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(target_next(tokens))
    return tokens[len(prompt) :]


@settings(max_examples=40, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(3, 13), min_size=1, max_size=20), min_size=1, max_size=4),
    max_tokens=st.lists(st.integers(1, 20), min_size=4, max_size=4),
    k=st.integers(1, 4),
    right=st.floats(0.0, 1.0),
    seed=st.integers(0, 1000),
    num_blocks=st.integers(12, 40),
    budget=st.integers(2, 24),
    prefix=st.booleans(),
)
def test_speculation_matches_plain_decoding(
    prompts, max_tokens, k, right, seed, num_blocks, budget, prefix
) -> None:
    import random

    rng = random.Random(seed)

    def drafts_of(tokens: list[int]) -> list[int]:
        # Right guesses with probability `right` each, else a wrong one.
        out, ctx = [], list(tokens)
        for _ in range(k):
            t = target_next(ctx)
            out.append(t if rng.random() < right else (t + 1 - 3) % VOCAB + 3)
            ctx.append(out[-1])
        return out

    results, _ = run(prompts, max_tokens, drafts_of, num_blocks, budget, prefix)
    for i, p in enumerate(prompts):
        assert results[f"r{i}"] == plain(p, max_tokens[i])


def test_preemption_mid_speculation_matches_plain_decoding() -> None:
    import random

    rng = random.Random(0)

    def drafts_of(tokens: list[int]) -> list[int]:
        out, ctx = [], list(tokens)
        for _ in range(3):
            t = target_next(ctx)
            out.append(t if rng.random() < 0.7 else (t - 2) % VOCAB + 3)
            ctx.append(out[-1])
        return out

    prompts = [[rng.randrange(3, 14) for _ in range(n)] for n in (18, 15, 20, 9)]
    # 14 blocks of 4 tokens for four requests growing to ~40 tokens each.
    results, preemptions = run(prompts, [20] * 4, drafts_of, 14, 10, True)
    assert preemptions > 0
    for i, p in enumerate(prompts):
        assert results[f"r{i}"] == plain(p, 20)
