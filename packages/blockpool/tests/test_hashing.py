"""Block hashing: determinism, salt isolation, chain equality <=> prefix equality."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagemill.blockpool import get_hash_fn, hash_block_chain, hash_block_tokens
from pagemill.blockpool.hashing import serialize_block


@pytest.mark.parametrize(("algo", "size"), [("sha256", 32), ("xxh3_128", 16)])
def test_hash_fns_are_deterministic_digests(algo: str, size: int) -> None:
    fn = get_hash_fn(algo)
    h1 = hash_block_tokens(fn, None, [1, 2, 3], ("salt",))
    h2 = hash_block_tokens(fn, None, [1, 2, 3], ("salt",))
    assert isinstance(h1, bytes) and len(h1) == size and h1 == h2


def test_sha256_is_over_the_documented_serialization() -> None:
    fn = get_hash_fn()
    data = serialize_block(b"p", [7, 8], ("s",))
    assert hash_block_tokens(fn, b"p", [7, 8], ("s",)) == hashlib.sha256(data).digest()


def test_unknown_algorithm_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown hash algorithm 'md5'"):
        get_hash_fn("md5")


def test_serialization_is_unambiguous() -> None:
    # Inputs that a naive concatenation would confuse.
    cases = [
        (None, [1, 2], ()),
        (None, [1, 2], ("",)),
        (None, [1, 2], (None,)),
        (None, [1, 2], ("ab",)),
        (None, [1, 2], ("a", "b")),
        (None, [1, 2], (1,)),
        (None, [1, 2], ("1",)),
        (None, [1, 2], (b"1",)),
        (None, [1, 2], (True,)),
        (None, [1, 2], (("a",), "b")),
        (b"", [1, 2], ()),
        (None, [1], (2,)),
        (None, [1, 2, 0], ()),
    ]
    blobs = [serialize_block(*c) for c in cases]
    assert len(set(blobs)) == len(blobs)


def test_unhashable_extra_key_type_is_rejected() -> None:
    with pytest.raises(TypeError, match="float"):
        serialize_block(None, [1], (1.5,))


def test_chain_covers_full_blocks_only_and_chains_parents() -> None:
    fn = get_hash_fn()
    toks = list(range(11))
    chain = hash_block_chain(fn, toks, 4)
    assert len(chain) == 2
    assert chain[0] == hash_block_tokens(fn, None, toks[:4])
    assert chain[1] == hash_block_tokens(fn, chain[0], toks[4:8])
    assert hash_block_chain(fn, toks[:3], 4) == []
    # Continuing from a parent equals hashing the whole sequence at once.
    assert hash_block_chain(fn, toks[4:8], 4, parent=chain[0]) == chain[1:]
    with pytest.raises(ValueError, match="block_size"):
        hash_block_chain(fn, toks, 0)


@pytest.mark.parametrize("algo", ["sha256", "xxh3_128"])
def test_different_salts_never_share_blocks(algo: str) -> None:
    fn = get_hash_fn(algo)
    toks = list(range(64))
    plain = hash_block_chain(fn, toks, 16)
    a = hash_block_chain(fn, toks, 16, ("tenant-a",))
    b = hash_block_chain(fn, toks, 16, ("tenant-b",))
    assert not set(plain) & set(a) and not set(a) & set(b) and not set(plain) & set(b)
    assert a == hash_block_chain(fn, toks, 16, ("tenant-a",))


tokens = st.lists(st.integers(0, 3), max_size=24)
salts = st.sampled_from([(), ("x",), ("y",)])


@settings(max_examples=150, deadline=None)
@given(t1=tokens, t2=tokens, s1=salts, s2=salts, algo=st.sampled_from(["sha256", "xxh3_128"]))
def test_chain_equality_iff_prefix_and_salt_equality(
    t1: list[int], t2: list[int], s1: tuple, s2: tuple, algo: str
) -> None:
    fn = get_hash_fn(algo)
    bs = 3
    c1 = hash_block_chain(fn, t1, bs, s1)
    c2 = hash_block_chain(fn, t2, bs, s2)
    for i in range(min(len(c1), len(c2))):
        same_prefix = t1[: (i + 1) * bs] == t2[: (i + 1) * bs] and s1 == s2
        assert (c1[i] == c2[i]) == same_prefix
    # A hash never appears at two different depths either.
    if c1 and c2:
        assert (c1[-1] in set(c2)) == (len(c1) <= len(c2) and c1[-1] == c2[len(c1) - 1])


def test_lora_id_and_salt_keys_never_collide() -> None:
    """A LoRA id (int) and a salt (str) of the same spelling are different extra keys."""
    fn = get_hash_fn()
    assert hash_block_tokens(fn, None, [1, 2], (1,)) != hash_block_tokens(fn, None, [1, 2], ("1",))
    assert hash_block_tokens(fn, None, [1, 2], ("s", 1)) != hash_block_tokens(
        fn, None, [1, 2], ("s",)
    )
