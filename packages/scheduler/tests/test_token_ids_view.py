"""TokenIdsView behaves like a read-only sequence over a window of one list."""

from __future__ import annotations

import operator

import pytest

from pagemill.scheduler import TokenIdsView


def test_fixed_window() -> None:
    tokens = [10, 11, 12, 13, 14]
    v = TokenIdsView(tokens, 1, 4)
    assert len(v) == 3 and list(v) == [11, 12, 13]
    assert (v[0], v[-1], v[2]) == (11, 13, 13)
    with pytest.raises(IndexError):
        v[3]
    with pytest.raises(IndexError):
        v[-4]
    assert v[1:] == [12, 13] and type(v[1:]) is list
    assert v[::-1] == [13, 12, 11] and v[::2] == [11, 13] and v[5:9] == []
    assert v.index(12) == 1 and 13 in v and 14 not in v
    tokens.append(15)  # outside the window
    assert len(v) == 3
    assert repr(v) == "TokenIdsView([11, 12, 13])"


def test_open_window_follows_the_list() -> None:
    tokens = [1, 2, 3]
    v = TokenIdsView(tokens, 3)
    assert len(v) == 0 and v == [] and list(v) == []
    tokens += [7, 8]
    assert len(v) == 2 and v == [7, 8] and v[-1] == 8 and v[:] == [7, 8]


def test_equality_with_any_sequence_of_ints() -> None:
    v = TokenIdsView([1, 2, 3], 0, 2)
    assert v == [1, 2] and v == (1, 2) and v == TokenIdsView([0, 1, 2], 1)
    assert operator.eq([1, 2], v)  # list.__eq__ gives up, the view's reflected one answers
    assert v != [1, 2, 3] and v != [1, 3] and v != "ab" and v != 12
    with pytest.raises(TypeError):
        hash(v)
