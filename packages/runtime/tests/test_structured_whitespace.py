"""`WhitespaceCap` against the text it lets through, and its bitmasks against xgrammar's."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagemill.runtime.sample.structured_output.whitespace import WhitespaceCap, pack_bitmask

xgr = pytest.importorskip("xgrammar")

tokens = st.binary(min_size=0, max_size=6).map(
    lambda b: bytes(b" \n\ta"[x % 4] for x in b)  # mostly whitespace, some text
)


def fits(text: bytes, cap: int, newline_cap: int) -> bool:
    """Every whitespace run within both caps."""
    runs = re.findall(rb"[ \t\n\r]+", text)
    return all(len(r) <= cap and r.count(b"\n") <= newline_cap for r in runs)


def trailing(text: bytes) -> tuple[int, int]:
    tail = text[len(text.rstrip(b" \t\n\r")) :]
    return len(tail), tail.count(b"\n")


@settings(max_examples=200, deadline=None)
@given(
    vocab=st.lists(tokens, min_size=1, max_size=24),
    cap=st.integers(0, 5),
    newline_cap=st.integers(0, 3),
    picks=st.lists(st.integers(0, 10**6), max_size=40),
)
def test_no_run_past_the_caps_and_nothing_else_banned(vocab, cap, newline_cap, picks) -> None:
    vocab = [*vocab, b"a"]  # a token that always fits, as JSON always has one
    ws = WhitespaceCap(vocab, len(vocab), cap, newline_cap)
    text, run = b"", (0, 0)
    for pick in picks:
        allowed = [t for t in range(len(vocab)) if ws.allows(run, t)]
        # The mask says the same as allows(), bit for bit.
        mask = ws.mask(run)
        bits = torch.ones(len(vocab), dtype=torch.bool) if mask is None else unpack(mask, vocab)
        assert bits.tolist() == [ws.allows(run, t) for t in range(len(vocab))]
        # Exactly the tokens that keep every run within the cap are allowed.
        for t in range(len(vocab)):
            assert ws.allows(run, t) == fits(text + vocab[t], cap, newline_cap), (text, t)
        token = allowed[pick % len(allowed)]
        text += vocab[token]
        run = ws.advance(run, token)
        assert run == trailing(text)
        assert fits(text, cap, newline_cap)


def unpack(mask: torch.Tensor, vocab: list[bytes]) -> torch.Tensor:
    """The mask through xgrammar's own kernel: banned tokens' logits become -inf."""
    logits = torch.zeros(1, len(vocab))
    xgr.apply_token_bitmask_inplace(logits, mask.view(1, -1), vocab_size=len(vocab))
    return torch.isfinite(logits[0])


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 320])
def test_pack_bitmask_is_xgrammars_layout(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    allowed = torch.rand(vocab, generator=g) < 0.5
    allowed[-1] = True  # the sign bit of a last full word
    got = unpack(pack_bitmask(allowed), [b""] * vocab)
    assert torch.equal(got, allowed)
