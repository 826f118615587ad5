"""check_stop on its own: the token stop rules, their order, and what they record."""

from __future__ import annotations

import pytest

from pagemill.scheduler import Request, RequestStatus, check_stop

STOPPED = RequestStatus.FINISHED_STOPPED
CAPPED = RequestStatus.FINISHED_LENGTH_CAPPED


def after(outputs: list[int], prompt_len: int = 4, **kw) -> Request:
    r = Request("r", [9] * prompt_len, eos_token_id=2, **kw)
    for t in outputs:
        r.append_output_token(t)
    return r


@pytest.mark.parametrize(
    ("outputs", "kw", "status", "stop_reason"),
    [
        ([5], {}, None, None),
        ([2], {}, STOPPED, None),  # EOS: no stop_reason, the finish reason says it all
        ([2], {"ignore_eos": True}, None, None),
        ([2], {"min_tokens": 2}, None, None),  # too early to stop
        ([5, 2], {"min_tokens": 2}, STOPPED, None),
        ([42], {"stop_token_ids": [42, 43]}, STOPPED, 42),
        ([42], {"stop_token_ids": [42], "min_tokens": 2}, None, None),
        ([5, 6], {"max_tokens": 2}, CAPPED, None),
        ([5, 2], {"max_tokens": 2}, STOPPED, None),  # a natural stop wins over the cap
        ([5, 43], {"max_tokens": 2, "stop_token_ids": [43]}, STOPPED, 43),
        ([2, 2], {"ignore_eos": True, "max_tokens": 2}, CAPPED, None),
    ],
)
def test_rules(outputs, kw, status, stop_reason) -> None:
    r = after(outputs, **kw)
    assert check_stop(r, max_model_len=100, pool_capacity_tokens=100) == status
    assert r.stop_reason == stop_reason


def test_length_limits_of_the_model_and_of_the_pool() -> None:
    r = after([5, 6])  # 6 tokens
    assert check_stop(r, max_model_len=6, pool_capacity_tokens=100) == CAPPED
    assert check_stop(r, max_model_len=7, pool_capacity_tokens=100) is None
    # The pool holds 5 slots: the 6th token's KV could never be computed.
    assert check_stop(r, max_model_len=100, pool_capacity_tokens=5) == CAPPED
    assert check_stop(r, max_model_len=100, pool_capacity_tokens=6) is None


def test_check_stop_does_not_change_the_status() -> None:
    r = after([2])
    assert check_stop(r, 100, 100) == STOPPED and r.status == RequestStatus.WAITING
