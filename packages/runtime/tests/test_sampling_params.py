"""SamplingParams: every bad field is refused at construction, naming the field."""

import pytest

from pagemill.runtime.sampling_params import RequestOutputKind, SamplingParams, SamplingType

BAD_FIELDS = [
    ("n", 0),
    ("n", 1.5),
    ("n", True),
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("temperature", "hot"),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_k", -2),
    ("top_k", 2.5),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("seed", 1.0),
    ("seed", "42"),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("min_tokens", -1),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", ["ok", 3]),
    ("stop", 7),
    ("stop_token_ids", [1, -2]),
    ("stop_token_ids", "abc"),
    ("stop_token_ids", [1.5]),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("frequency_penalty", 3),
    ("frequency_penalty", -3),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", 2.0),
    ("include_stop_str_in_output", 1),
    ("ignore_eos", "yes"),
    ("skip_special_tokens", None),
]


@pytest.mark.parametrize(("name", "value"), BAD_FIELDS)
def test_bad_field_raises_naming_it(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{name}\b"):
        SamplingParams(**{name: value})


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)
    SamplingParams(min_tokens=10, max_tokens=None)  # no cap: any min is fine


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0.0},
        {"top_p": 1.0, "top_k": -1, "min_p": 1.0},
        {"top_k": 1, "min_p": 0.0},
        {"max_tokens": None},
        {"presence_penalty": -2, "frequency_penalty": 2},
        {"repetition_penalty": 0.5},
        {"logprobs": 0},
        {"logprobs": 20},
        {"seed": 0},
        {"stop": ["a", "bc"], "stop_token_ids": (5, 6)},
    ],
)
def test_good_values_accepted(kwargs: dict) -> None:
    p = SamplingParams(**kwargs)
    # Accepted means kept: every given value survives (up to the documented normalisation).
    normalised = {"top_k": {-1: 0}, "stop_token_ids": {(5, 6): [5, 6]}}
    for name, value in kwargs.items():
        expected = (
            normalised.get(name, {}).get(value, value) if isinstance(value, int | tuple) else value
        )
        assert getattr(p, name) == expected, name
    assert p.output_kind == RequestOutputKind.DELTA


def test_output_kind_is_checked() -> None:
    assert (
        SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY).output_kind.value == "final_only"
    )
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")  # type: ignore[arg-type]


def test_normalisation() -> None:
    p = SamplingParams(stop="###", stop_token_ids=(3, 4), top_k=-1, temperature=1)
    assert p.stop == ["###"]
    assert p.stop_strings == ["###"]
    assert p.stop_token_ids == [3, 4]
    assert p.top_k == 0
    assert isinstance(p.temperature, float)
    assert SamplingParams().stop == []
    assert SamplingParams(stop=None, stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(stop=("a", "bcd")).max_stop_len == 3


def test_defaults_match_the_contract() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.seed, p.max_tokens, p.min_tokens, p.logprobs) == (None, 16, 0, None)
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output


def test_sampling_type() -> None:
    assert SamplingParams(temperature=0.0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=0.0, seed=3).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=0.8).sampling_type == SamplingType.RANDOM
    assert SamplingParams(temperature=0.8, seed=3).sampling_type == SamplingType.RANDOM_SEED
    assert not SamplingParams(temperature=0.8).is_greedy


def test_child_params_get_distinct_seeds() -> None:
    p = SamplingParams(n=3, seed=10, temperature=0.7)
    children = [p.child_params(i) for i in range(3)]
    assert [c.seed for c in children] == [10, 11, 12]
    assert all(c.n == 1 and c.temperature == 0.7 for c in children)
    assert SamplingParams(n=2).child_params(1).seed is None
