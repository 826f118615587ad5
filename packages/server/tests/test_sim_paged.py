"""The simulator on the real scheduler and block pool: determinism, no leaks, the claims."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from pagemill.server.sim import (
    Deployment,
    LengthDist,
    PagedSimulator,
    StaticBatchSimulator,
    WorkloadSpec,
    generate_workload,
    load_gpu,
    load_model,
    prefix_caching,
    static_vs_paged,
    token_budget,
)


def small_deployment(**changes: object) -> Deployment:
    base = Deployment(
        load_model("smollm2-135m"),
        load_gpu("rtx-4090"),
        max_model_len=512,
        max_num_seqs=32,
        max_num_batched_tokens=256,
        num_blocks=256,
    )
    return replace(base, **changes)


WORKLOAD = WorkloadSpec(
    num_requests=40,
    prompt_len=LengthDist(48),
    output_len=LengthDist(24),
    request_rate=400.0,
    seed=7,
)


def assert_pool_empty(sim: PagedSimulator) -> None:
    kv = sim.kv_cache_manager
    assert kv.get_num_free_blocks() == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert not sim.scheduler.has_unfinished_requests()


def test_same_seed_same_results() -> None:
    d = small_deployment()
    requests = generate_workload(WORKLOAD, d.max_model_len)
    assert requests == generate_workload(WORKLOAD, d.max_model_len)
    a = PagedSimulator(d).run(requests)
    b = PagedSimulator(d).run(generate_workload(WORKLOAD, d.max_model_len))
    assert a == b  # every field, the timelines and latency samples included
    other = PagedSimulator(d).run(generate_workload(replace(WORKLOAD, seed=8), d.max_model_len))
    assert other.ttfts != a.ttfts


def test_run_finishes_every_request_and_leaks_no_block() -> None:
    d = small_deployment()
    requests = generate_workload(WORKLOAD, d.max_model_len)
    sim = PagedSimulator(d)
    result = sim.run(requests)
    assert result.num_finished == len(requests) and result.num_ignored == 0
    assert result.output_tokens == sum(r.output_len for r in requests)
    assert result.prompt_tokens_computed == sum(r.prompt_len for r in requests)
    assert 0 < result.kv_utilization <= 1
    assert result.duration_s > 0 and result.throughput_tok_s > 0
    assert_pool_empty(sim)


def test_memory_pressure_preempts_and_still_leaks_nothing() -> None:
    # 24 blocks of 16 tokens for 40 requests of ~72 tokens: the scheduler must preempt.
    d = small_deployment(num_blocks=24)
    requests = generate_workload(replace(WORKLOAD, request_rate=math.inf), d.max_model_len)
    sim = PagedSimulator(d)
    result = sim.run(requests)
    assert result.num_preemptions > 0
    assert result.num_finished == len(requests)
    assert result.output_tokens == sum(r.output_len for r in requests)
    # Recompute after preemption shows up as extra computed tokens.
    assert result.computed_tokens > sum(r.prompt_len + r.output_len - 1 for r in requests)
    assert_pool_empty(sim)


def test_prompt_too_long_for_the_pool_is_ignored_not_hung() -> None:
    d = small_deployment(num_blocks=4)  # 64 tokens of KV
    spec = replace(WORKLOAD, num_requests=6, prompt_len=LengthDist(100, kind="fixed"))
    sim = PagedSimulator(d)
    result = sim.run(generate_workload(spec, d.max_model_len))
    assert result.num_ignored == 6 and result.num_finished == 0
    assert_pool_empty(sim)


def test_static_batching_wastes_most_reserved_kv() -> None:
    d = small_deployment(num_blocks=512)  # 8192 tokens: 16 static slots of 512
    comparison = static_vs_paged(d, WORKLOAD)
    static_sat, paged_sat, static_rate, paged_rate = comparison.runs
    assert StaticBatchSimulator(d).batch_slots == 16
    for static, paged in ((static_sat, paged_sat), (static_rate, paged_rate)):
        assert static.num_finished == paged.num_finished == WORKLOAD.num_requests
        assert static.output_tokens == paged.output_tokens
        assert static.kv_utilization < 0.4
        assert paged.kv_utilization > 0.8
        assert static.kv_utilization < paged.kv_utilization / 2
    # Saturated, continuous batching keeps more sequences in flight and finishes sooner.
    assert paged_sat.mean_batch_size > static_sat.mean_batch_size
    assert paged_sat.throughput_tok_s > static_sat.throughput_tok_s
    assert paged_rate.ttft_mean_s < static_rate.ttft_mean_s


def test_prefix_caching_cuts_prefill_and_ttft_for_a_shared_system_prompt() -> None:
    d = small_deployment(num_blocks=512, max_num_batched_tokens=128)
    spec = replace(WORKLOAD, system_prompt_len=256, prompt_len=LengthDist(32))
    comparison = prefix_caching(d, spec)
    off, on = comparison.runs
    assert off.num_finished == on.num_finished == spec.num_requests
    assert on.prompt_tokens_computed < off.prompt_tokens_computed / 2
    assert on.ttft_mean_s < off.ttft_mean_s
    assert on.prefix_cache_hit_rate > 0.5 and math.isnan(off.prefix_cache_hit_rate)
    with pytest.raises(ValueError, match="system prompt"):
        prefix_caching(d, WORKLOAD)


def test_smaller_token_budget_lowers_itl_spikes() -> None:
    d = small_deployment(num_blocks=1024, max_model_len=1024)
    spec = replace(
        WORKLOAD, prompt_len=LengthDist(600, kind="uniform", spread=0.3), request_rate=100.0
    )
    comparison = token_budget(d, spec, budgets=(64, 1024))
    small, big, unchunked = comparison.runs
    assert [r.num_finished for r in comparison.runs] == [spec.num_requests] * 3
    assert small.itl_p99_s < big.itl_p99_s
    assert small.itl_max_s < unchunked.itl_max_s
    assert unchunked.name.startswith("unchunked")


def test_kv_utilization_is_measured_exactly() -> None:
    # Every prompt is 24 tokens and generates one token; a budget of 8 prompts per step means
    # no chunking: each step holds 8 prompts of 2 blocks (32 slots) with 24 real tokens each.
    # Static batching reserves 512 slots per prompt.
    d = small_deployment(max_num_batched_tokens=8 * 24)
    spec = replace(
        WORKLOAD,
        prompt_len=LengthDist(24, kind="fixed"),
        output_len=LengthDist(1, kind="fixed"),
        request_rate=math.inf,
    )
    requests = generate_workload(spec, d.max_model_len)
    paged = PagedSimulator(d, enable_prefix_caching=False).run(requests)
    static = StaticBatchSimulator(d).run(requests)
    assert paged.kv_utilization == pytest.approx(24 / 32)
    assert static.kv_utilization == pytest.approx(24 / 512)
    assert paged.num_steps == 40 // 8
