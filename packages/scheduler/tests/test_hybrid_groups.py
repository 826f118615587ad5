"""Scheduling over a KV cache manager with one table per layer group (full attention and
sliding windows): what each step tells the runner about every group's table rebuilds the
manager's tables, steps and requests stay within what the pool can hold, prefix hits and
preemptions keep the outputs, and the pool is whole at the end."""

from __future__ import annotations

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pagemill.blockpool import HybridKVCacheManager, KVCacheGroupSpec
from pagemill.scheduler import Request, Scheduler, SchedulerConfig

BS = 4


def make(window: int, num_blocks: int, n_windowed: int = 1, **cfg) -> Scheduler:
    groups = [KVCacheGroupSpec((0,))] + [
        KVCacheGroupSpec((i + 1,), window) for i in range(n_windowed)
    ]
    return Scheduler(SchedulerConfig(**cfg), HybridKVCacheManager(num_blocks, BS, groups))


def run(s: Scheduler, max_steps: int = 20_000) -> tuple[int, dict[str, list[int]]]:
    """Drive to completion, mirroring each group's table from the step outputs as a model
    runner does; returns (most requests running at once, outputs)."""
    kv = s.kv_cache_manager
    assert isinstance(kv, HybridKVCacheManager)
    mirror: dict[str, list[list[int]]] = {}
    outputs: dict[str, list[int]] = {}
    peak = 0
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return peak, outputs
        out = s.schedule()
        peak = max(peak, len(s.running))
        for rid in out.preempted_req_ids + out.finished_req_ids:
            mirror.pop(rid, None)
        for x in out.scheduled:
            ids = x.group_block_ids
            if x.is_new:
                assert ids is not None
                mirror[x.request_id] = [list(g) for g in ids]
            elif ids is not None:
                for table, new in zip(mirror[x.request_id], ids):
                    table.extend(new)
            assert x.new_block_ids == (ids[0] if ids is not None else [])
            # Every entry a query of this step may read is the manager's own block.
            got = kv.get_block_ids(x.request_id)
            for g, w in enumerate(kv.windows):
                first = 0 if w is None else max(0, x.start_pos - w + 1) // BS
                assert mirror[x.request_id][g][first:] == got[g][first:]
                kv.slot_mapping(x.request_id, x.start_pos, x.start_pos + x.num_tokens, g)
        sampled = {x.request_id: 5 for x in out.scheduled if x.sample}
        for up in s.update_from_output(out, sampled):
            outputs.setdefault(up.request_id, []).extend(up.new_token_ids)
    raise AssertionError("did not finish")


def test_windowed_groups_let_more_long_requests_run_at_once() -> None:
    """Four requests of 80 tokens: with the windowed group giving back its old blocks they
    need 20 + 3 blocks each and all run at once in 100 blocks; a manager whose second
    group keeps everything (a window as long as the context) cannot hold them all."""
    cfg = dict(max_num_batched_tokens=32, max_model_len=256)
    hybrid = make(8, 101, **cfg)
    for i in range(4):
        hybrid.add_request(Request(f"r{i}", [10 + i] * 40, max_tokens=40, ignore_eos=True))
    peak, outputs = run(hybrid)
    assert peak == 4 and hybrid.num_preemptions == 0
    kv = hybrid.kv_cache_manager
    assert kv.get_num_free_blocks() == kv.num_usable_blocks

    keep = make(256, 101, **cfg)
    for i in range(4):
        keep.add_request(Request(f"r{i}", [10 + i] * 40, max_tokens=40, ignore_eos=True))
    _, outputs_keep = run(keep)
    assert keep.num_preemptions > 0
    assert outputs_keep == outputs


def test_a_request_is_capped_at_what_the_pool_can_hold() -> None:
    """The full group needs every block: a request stops at the pool's capacity (the
    windowed group's blocks taken out) instead of waiting forever."""
    s = make(8, 31, max_num_batched_tokens=16, max_model_len=1000)
    cap = s.pool_capacity_tokens
    assert cap == (30 - 3) * BS
    s.add_request(Request("r", [1] * 20, max_tokens=500, ignore_eos=True))
    _, outputs = run(s)
    # Like a full pool: the last sampled token is never computed, so it may be one past.
    assert len(outputs["r"]) == cap + 1 - 20
    too_long = make(8, 31, max_num_batched_tokens=16, max_model_len=1000)
    too_long.add_request(Request("x", [1] * (cap + 1), max_tokens=1))
    assert too_long.update_from_output(too_long.schedule(), {})[0].finish_reason == "ignored"


@settings(max_examples=25, deadline=None)
@given(
    window=st.sampled_from([1, 5, 12]),
    n_windowed=st.integers(1, 2),
    num_blocks=st.integers(30, 60),
    chunked=st.booleans(),
    prompts=st.lists(
        st.tuples(st.sampled_from([[], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]), st.integers(1, 30)),
        min_size=1,
        max_size=6,
    ),
    max_tokens=st.integers(1, 30),
)
def test_random_workloads_finish_with_the_pool_whole(
    window: int,
    n_windowed: int,
    num_blocks: int,
    chunked: bool,
    prompts: list[tuple[list[int], int]],
    max_tokens: int,
) -> None:
    """Shared prefixes (hits), pools small enough to preempt: every request gets its
    tokens, the outputs do not depend on the pool, and nothing leaks."""
    outs = []
    for blocks in (num_blocks, 400):
        s = make(
            window,
            blocks,
            n_windowed,
            max_num_batched_tokens=80 if not chunked else 8,
            max_model_len=80,
            enable_chunked_prefill=chunked,
        )
        # A request longer than what the small pool holds is capped: not compared.
        longest = max(len(prefix) + tail for prefix, tail in prompts) + max_tokens
        assume(longest <= s.pool_capacity_tokens)
        for i, (prefix, tail) in enumerate(prompts):
            s.add_request(
                Request(f"r{i}", prefix + [i] * tail, max_tokens=max_tokens, ignore_eos=True)
            )
        _, outputs = run(s)
        kv = s.kv_cache_manager
        assert kv.get_num_free_blocks() == kv.num_usable_blocks
        outs.append(outputs)
    assert outs[0] == outs[1]
