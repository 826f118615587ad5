"""Bad configs and requests fail at construction with a message naming the field."""

from __future__ import annotations

import pytest

from pagemill.scheduler import Request, RequestStatus, SchedulerConfig


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        ({"max_num_batched_tokens": 0}, ValueError, "max_num_batched_tokens"),
        ({"max_num_seqs": -1}, ValueError, "max_num_seqs"),
        ({"max_model_len": 1.5}, TypeError, "max_model_len"),
        ({"max_num_seqs": True}, TypeError, "max_num_seqs"),
        ({"long_prefill_token_threshold": -2}, ValueError, "long_prefill_token_threshold"),
        ({"policy": "lifo"}, ValueError, "policy"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 512,
          "max_model_len": 1024}, ValueError, "chunked prefill"),
        ({"enable_chunked_prefill": False, "long_prefill_token_threshold": 8},
         ValueError, "enable_chunked_prefill"),
    ],
)
def test_invalid_config(kw, exc, match) -> None:
    with pytest.raises(exc, match=match):
        SchedulerConfig(**kw)


def test_config_defaults_are_valid_and_frozen() -> None:
    cfg = SchedulerConfig()
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.policy) == (2048, 256, "fcfs")
    with pytest.raises(AttributeError):
        cfg.policy = "priority"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("args", "kw", "exc", "match"),
    [
        (("", [1]), {}, ValueError, "request_id"),
        (("r", []), {}, ValueError, "at least one token"),
        (("r", [1]), {"max_tokens": 0}, ValueError, "max_tokens"),
        (("r", [1]), {"min_tokens": -1}, ValueError, "min_tokens"),
        (("r", [1]), {"min_tokens": 5, "max_tokens": 2}, ValueError, "exceeds max_tokens"),
        (("r", [1]), {"priority": 1.0}, TypeError, "priority"),
        (("r", [1]), {"cache_salt": 3}, TypeError, "cache_salt"),
    ],
)
def test_invalid_request(args, kw, exc, match) -> None:
    with pytest.raises(exc, match=match):
        Request(*args, **kw)


def test_request_token_lists_stay_in_sync() -> None:
    prompt = [1, 2, 3]
    r = Request("r", prompt, stop_token_ids=[9, 9])
    prompt.append(4)  # the caller's list is copied
    r.append_output_token(7)
    assert r.all_token_ids == [1, 2, 3, 7] and r.output_token_ids == [7]
    assert (r.num_tokens, r.num_prompt_tokens, r.num_output_tokens) == (4, 3, 1)
    assert r.stop_token_ids == frozenset({9})
    assert r.status == RequestStatus.WAITING and not r.is_finished()


def test_status_helpers() -> None:
    S = RequestStatus
    assert [S.is_finished(s) for s in S] == [False, False, False, True, True, True, True]
    assert [S.finish_reason(s) for s in S] == [None, None, None, "stop", "length", "abort",
                                               "ignored"]
