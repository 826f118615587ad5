"""Bad configs and requests fail at construction with a message naming the field; the
request record's tokens, clocks and hashes."""

from __future__ import annotations

import time

import pytest

from pagemill.blockpool import CacheRequest, KVCacheManager, get_hash_fn, hash_block_chain
from pagemill.scheduler import Request, RequestStatus, SchedulerConfig, TokenIdsView


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        ({"max_num_batched_tokens": 0}, ValueError, "max_num_batched_tokens"),
        ({"max_num_seqs": -1}, ValueError, "max_num_seqs"),
        ({"max_model_len": 1.5}, TypeError, "max_model_len"),
        ({"max_num_seqs": True}, TypeError, "max_num_seqs"),
        ({"long_prefill_token_threshold": -2}, ValueError, "long_prefill_token_threshold"),
        ({"policy": "lifo"}, ValueError, "policy"),
        (
            {"enable_chunked_prefill": False, "max_num_batched_tokens": 512, "max_model_len": 1024},
            ValueError,
            "chunked prefill",
        ),
        (
            {"enable_chunked_prefill": False, "long_prefill_token_threshold": 8},
            ValueError,
            "enable_chunked_prefill",
        ),
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
    assert [S.is_finished(s) for s in S] == [False, False, False, True, True, True, True, True]
    assert [S.finish_reason(s) for s in S] == [
        None,
        None,
        None,
        "stop",
        "length",
        "abort",
        "ignored",
        "error",
    ]


def test_arrival_time_is_monotonic_by_default_and_kept_as_given() -> None:
    before = time.monotonic()
    r = Request("r", [1])
    assert before <= r.arrival_time <= time.monotonic()  # not time.time(): one clock
    assert Request("r", [1], arrival_time=12.5).arrival_time == 12.5
    assert r.first_scheduled_time is None


def test_prompt_and_output_are_views_of_the_one_token_list() -> None:
    r = Request("r", [1, 2, 3])
    prompt, output = r.prompt_token_ids, r.output_token_ids
    assert isinstance(prompt, TokenIdsView) and isinstance(output, TokenIdsView)
    r.append_output_token(7)
    r.all_token_ids.append(8)  # no second list to fall out of sync with
    assert output == [7, 8] and prompt == [1, 2, 3]
    assert r.num_output_tokens == 2 and r.num_tokens == 5
    assert not hasattr(r, "__dict__") and "output_token_ids" not in Request.__slots__


def test_sampling_params_are_carried_untouched() -> None:
    params = object()
    assert Request("r", [1], sampling_params=params).sampling_params is params
    assert Request("r", [1]).sampling_params is None


def test_request_is_a_cache_request_and_hashes_as_it_grows() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=2)
    r = Request("r", [1, 2, 3], cache_salt="s")
    assert isinstance(r, CacheRequest)
    r.append_output_token(4)  # no hasher attached yet: nothing is hashed
    assert r.block_hashes == []
    r.block_hasher = kv.block_hasher
    r.append_output_token(5)
    assert r.block_hashes == []  # 5 tokens: this token filled no block
    r.append_output_token(6)  # fills one, and the hasher catches up on every missing one
    fn = get_hash_fn()
    assert r.block_hashes == hash_block_chain(fn, [1, 2, 3, 4, 5, 6], 2, ("s",))
