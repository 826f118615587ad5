"""Stop strings: found across token boundaries, cut (or kept), and never streamed early.

A minimal byte-level tokenizer (each id is a byte string; decoding joins and decodes UTF-8)
lets each test choose exactly where token boundaries fall, including inside a character.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from pagemill.runtime.engine.detokenizer import IncrementalDetokenizer
from pagemill.runtime.sampling_params import SamplingParams

EOS = 0


class BytesTokenizer:
    def __init__(self) -> None:
        self.pieces: list[bytes] = [b"</s>"]
        self.index: dict[bytes, int] = {b"</s>": EOS}

    def ids(self, *pieces: str | bytes) -> list[int]:
        out = []
        for p in pieces:
            b = p.encode() if isinstance(p, str) else p
            if b not in self.index:
                self.index[b] = len(self.pieces)
                self.pieces.append(b)
            out.append(self.index[b])
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        parts = [self.pieces[i] for i in ids if not (skip_special_tokens and i == EOS)]
        return b"".join(parts).decode("utf-8", errors="replace")


@pytest.fixture
def tok() -> BytesTokenizer:
    return BytesTokenizer()


def _run(
    tok: BytesTokenizer, ids: list[int], **params: object
) -> tuple[IncrementalDetokenizer, list[str | None], list[str]]:
    d = IncrementalDetokenizer(tok, [], SamplingParams(**params))
    hits, deltas = [], []
    for i in ids:
        hits.append(d.update([i]))
        deltas.append(d.get_delta())
    return d, hits, deltas


def test_stop_string_spanning_three_tokens(tok: BytesTokenizer) -> None:
    ids = tok.ids("Hello", " wo", "rl", "d!", " more")
    d, hits, _ = _run(tok, ids, stop=["world"])
    assert hits == [None, None, None, "world", None]
    assert d.output_text == "Hello "
    assert d.stop_reason == "world"


def test_include_stop_string_in_output(tok: BytesTokenizer) -> None:
    ids = tok.ids("Hello", " wo", "rl", "d!", " more")
    d, hits, _ = _run(tok, ids, stop=["world"], include_stop_str_in_output=True)
    assert hits[3] == "world"
    assert d.output_text == "Hello world"


def test_text_after_stop_in_the_same_token_is_cut(tok: BytesTokenizer) -> None:
    ids = tok.ids("a", "bSTOPcd")
    d, hits, _ = _run(tok, ids, stop="STOP")
    assert hits == [None, "STOP"]
    assert d.output_text == "ab"
    d2, _, _ = _run(tok, ids, stop="STOP", include_stop_str_in_output=True)
    assert d2.output_text == "abSTOP"


def test_earliest_of_several_stop_strings_wins(tok: BytesTokenizer) -> None:
    ids = tok.ids("x", "yz", "-END-", "###")
    d, hits, _ = _run(tok, ids, stop=["###", "z-E", "END"])
    assert hits[2] == "z-E"
    assert d.output_text == "xy"


def test_stop_string_made_of_split_multibyte_characters(tok: BytesTokenizer) -> None:
    # "世界" = e4 b8 96 e7 95 8c, split inside both characters
    ids = tok.ids("hi ", b"\xe4", b"\xb8\x96\xe7", b"\x95", b"\x8c!", "tail")
    d, hits, deltas = _run(tok, ids, stop=["界!"])
    assert hits == [None, None, None, None, "界!", None]
    assert d.output_text == "hi 世"
    assert "".join(deltas) == "hi 世"
    assert all("\ufffd" not in x for x in deltas)


def test_delta_holds_back_a_possible_stop_prefix(tok: BytesTokenizer) -> None:
    ids = tok.ids("ab", "c<", "|e", "nd", "x")
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["<|end|>"]))
    d.update(ids[:1])
    assert d.get_delta() == "ab"
    d.update(ids[1:2])
    assert d.get_delta() == "c"  # "<" could start the stop string
    d.update(ids[2:3])
    assert d.get_delta() == ""  # "<|e" still could
    d.update(ids[3:4])
    assert d.get_delta() == ""  # "<|end"
    d.update(ids[4:5])
    assert d.get_delta() == "<|endx"  # resolved: not a stop after all
    assert d.output_text == "abc<|endx"


def test_delta_never_contains_text_that_is_later_cut(tok: BytesTokenizer) -> None:
    ids = tok.ids("one <", "|", "end", "|>", " two")
    d, hits, deltas = _run(tok, ids, stop=["<|end|>"])
    assert hits[3] == "<|end|>"
    assert "".join(deltas) == d.output_text == "one "


def test_finished_releases_the_held_tail(tok: BytesTokenizer) -> None:
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["STOP"]))
    d.update(tok.ids("go ST"))
    assert d.get_delta() == "go "
    assert d.get_delta(finished=True) == "ST"
    assert d.get_delta(finished=True) == ""


def test_updates_after_a_stop_change_nothing(tok: BytesTokenizer) -> None:
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["."]))
    assert d.update(tok.ids("end.")) == "."
    assert d.update(tok.ids("more text")) is None
    assert d.output_text == "end"


def test_stop_strings_wait_for_min_tokens(tok: BytesTokenizer) -> None:
    ids = tok.ids("a.", "b", "c.", "d")
    d, hits, _ = _run(tok, ids, stop=["."], min_tokens=3)
    assert hits == [None, None, ".", None]
    assert d.output_text == "a.bc"


def test_no_stop_strings_streams_everything(tok: BytesTokenizer) -> None:
    ids = tok.ids("a", "<", "|")
    _, hits, deltas = _run(tok, ids)
    assert hits == [None] * 3
    assert deltas == ["a", "<", "|"]


def test_only_new_text_is_searched(tok: BytesTokenizer) -> None:
    # a stop string present in the prompt context must not fire on output
    prompt = tok.ids("STOP", "x")
    d = IncrementalDetokenizer(tok, prompt, SamplingParams(stop=["STOP"]))
    assert d.update(tok.ids("y")) is None
    assert d.output_text == "y"
