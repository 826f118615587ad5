"""Synthetic workloads: reproducible, clipped to the context, sharing only the system prompt."""

from __future__ import annotations

import math
import random

import pytest

from pagemill.server.sim import LengthDist, WorkloadSpec, generate_workload, percentile
from pagemill.server.sim.workload import DISTRIBUTIONS


@pytest.mark.parametrize("kind", DISTRIBUTIONS)
def test_length_distributions_have_their_mean(kind: str) -> None:
    dist = LengthDist(200, kind=kind, spread=0.5)
    rng = random.Random(0)
    samples = [dist.sample(rng) for _ in range(4000)]
    assert min(samples) >= 1
    assert sum(samples) / len(samples) == pytest.approx(200, rel=0.08)


def test_length_bounds_and_errors() -> None:
    rng = random.Random(1)
    dist = LengthDist(100, kind="exponential", minimum=10, maximum=150)
    assert all(10 <= dist.sample(rng) <= 150 for _ in range(500))
    with pytest.raises(ValueError, match="distribution"):
        LengthDist(10, kind="zipf")
    with pytest.raises(ValueError, match="request_rate"):
        WorkloadSpec(request_rate=0)


def test_poisson_arrivals_and_clipping() -> None:
    spec = WorkloadSpec(
        num_requests=2000,
        request_rate=50.0,
        prompt_len=LengthDist(300),
        output_len=LengthDist(300),
        seed=3,
    )
    reqs = generate_workload(spec, max_model_len=512)
    times = [r.arrival_time for r in reqs]
    assert times == sorted(times) and times[0] == 0.0
    assert times[-1] / (len(reqs) - 1) == pytest.approx(1 / 50, rel=0.1)
    assert all(r.prompt_len + r.output_len <= 512 and r.output_len >= 1 for r in reqs)
    burst = generate_workload(WorkloadSpec(num_requests=5, request_rate=math.inf), 512)
    assert {r.arrival_time for r in burst} == {0.0}


def test_only_the_system_prompt_is_shared() -> None:
    spec = WorkloadSpec(
        num_requests=50,
        system_prompt_len=64,
        system_prompt_fraction=0.5,
        prompt_len=LengthDist(32),
        seed=5,
    )
    reqs = generate_workload(spec, max_model_len=1024)
    with_system = [r for r in reqs if r.prompt_token_ids[:64] == reqs[0].prompt_token_ids[:64]]
    assert 10 < len(with_system) < 45
    user_parts = {r.prompt_token_ids[64:80] for r in with_system}
    assert len(user_parts) == len(with_system)
    with pytest.raises(ValueError, match="no room"):
        generate_workload(WorkloadSpec(num_requests=1, system_prompt_len=600), max_model_len=512)


def test_percentile() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    assert math.isnan(percentile([], 50))
