"""The input processor's part of vLLM's request fields: truncate_prompt_tokens, bad_words'
token sequences, allowed_token_ids in the vocabulary, chat template arguments; and that the
new SamplingParams fields survive the trip to an engine-core process."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from pagemill.runtime.engine.input_processor import InputProcessor
from pagemill.runtime.engine.protocol import Codec, EngineCoreRequest
from pagemill.runtime.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: tuple[Path, Any]) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_llama[0]))  # this module's own copy


@pytest.fixture(scope="module")
def processor(tokenizer: Any) -> InputProcessor:
    return InputProcessor(tokenizer, len(tokenizer), 64, [tokenizer.eos_token_id])


def _process(processor: InputProcessor, prompt: Any, **params: Any) -> Any:
    return processor.process(
        "r", prompt, SamplingParams(**params), priority=0, cache_salt=None, arrival_time=0.0
    )


def test_truncate_keeps_the_last_tokens(processor: InputProcessor) -> None:
    ids = list(range(5, 45))
    out = _process(processor, ids, truncate_prompt_tokens=7, max_tokens=4)
    assert out.prompt_token_ids == ids[-7:]
    assert out.completions[0].prompt_token_ids == ids[-7:]
    # -1: as much as the context holds with room for one token; a long prompt then fits.
    long = [7] * 100
    out = _process(processor, long, truncate_prompt_tokens=-1, max_tokens=None)
    assert len(out.prompt_token_ids) == 63
    short = _process(processor, "hello world", truncate_prompt_tokens=50)
    assert short.prompt == "hello world"  # nothing cut: the text still says what is read


def test_bad_words_are_tokenized_with_and_without_a_space(
    processor: InputProcessor, tokenizer: Any
) -> None:
    out = _process(processor, "hello", bad_words=["world", "quick brown"])
    seqs = out.completions[0].sampling_params.bad_words_token_ids
    for word in ("world", "quick brown"):
        assert tokenizer.encode(word, add_special_tokens=False) in seqs
    spaced = tokenizer.encode(" world", add_special_tokens=False)
    plain = tokenizer.encode("world", add_special_tokens=False)
    assert (spaced in seqs) == (len(spaced) == len(plain) and spaced[0] != plain[0])
    # Every n > 1 copy carries them.
    many = _process(processor, "hello", n=3, seed=1, bad_words=["world"])
    assert all(c.sampling_params.bad_words_token_ids for c in many.completions)


def test_allowed_token_ids_must_be_in_vocab(processor: InputProcessor) -> None:
    with pytest.raises(ValueError, match="allowed_token_ids"):
        _process(processor, "hello", allowed_token_ids=[1, processor.vocab_size])
    _process(processor, "hello", allowed_token_ids=[1, processor.vocab_size - 1])


def test_template_kwargs_reach_the_template(processor: InputProcessor, tokenizer: Any) -> None:
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
        "{% if flag is defined %}FLAG{% endif %}"
    )
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the"}]
    plain = processor.apply_chat_template(messages)
    flagged = processor.apply_chat_template(messages, template_kwargs={"flag": 1})
    assert tokenizer.decode(flagged) == tokenizer.decode(plain) + "FLAG"
    cont = processor.apply_chat_template(
        messages, False, template_kwargs={"continue_final_message": True}
    )
    assert tokenizer.decode(cont) == "hello|the"


def test_new_fields_cross_the_process_boundary(tmp_path: Path) -> None:
    params = SamplingParams(
        bad_words=["x"],
        bad_words_token_ids=[[3, 4], [5]],
        allowed_token_ids=[1, 2],
        truncate_prompt_tokens=4,
    )
    codec = Codec()
    req = EngineCoreRequest("r", [1, 2], params, 4, None, [], 0.0)
    back = codec.decode(codec.encode(req))
    assert isinstance(back, EngineCoreRequest)
    assert back.sampling_params == params


def test_add_special_tokens(tiny_llama: tuple[Path, Any]) -> None:
    """With a tokenizer that writes a BOS-like token itself, add_special_tokens decides
    whether it is there (completions default to yes, chat to no: the template writes it)."""
    from tokenizers.processors import TemplateProcessing

    tok = AutoTokenizer.from_pretrained(str(tiny_llama[0]))
    eos = tok.eos_token_id
    tok._tokenizer.post_processor = TemplateProcessing(
        single="<eos> $A", special_tokens=[("<eos>", eos)]
    )
    processor = InputProcessor(tok, len(tok), 64, [eos])
    with_special = processor.encode("hello world")
    assert with_special[0] == eos
    assert processor.encode("hello world", add_special_tokens=False) == with_special[1:]
    messages = [{"role": "user", "content": "hello"}]
    chat = processor.apply_chat_template(messages)
    assert chat[0] != eos
    assert processor.apply_chat_template(messages, add_special_tokens=True) == [eos, *chat]


def test_bad_words_end_to_end_through_the_engine(tiny_llama: tuple[Path, Any]) -> None:
    """A two-token word the model generates greedily never appears once banned; the
    tokens before its last one still do (only the completion of the word is banned)."""
    from pagemill.runtime import LLM

    llm = LLM(
        str(tiny_llama[0]),
        dtype="float32",
        max_model_len=128,
        kv_cache_memory_bytes=2 << 20,
        max_num_batched_tokens=64,
    )
    tok = llm.llm_engine.tokenizer
    greedy = dict(temperature=0.0, ignore_eos=True, max_tokens=24)
    (free,) = llm.generate(["hello world"], SamplingParams(**greedy))
    out = free.outputs[0].token_ids
    pairs = [
        (a, b)
        for a, b in itertools.pairwise(out)
        if not tok.decode([a, b]).startswith(" ")
        and tok.encode(tok.decode([a, b]), add_special_tokens=False) == [a, b]
    ]
    if not pairs:
        pytest.skip("the greedy output has no two-token word that re-tokenizes as itself")
    a, b = pairs[0]
    (banned,) = llm.generate(
        ["hello world"], SamplingParams(**greedy, bad_words=[tok.decode([a, b])])
    )
    got = banned.outputs[0].token_ids
    assert (a, b) not in set(itertools.pairwise(got))
    assert got[: out.index(a) + 1] == out[: out.index(a) + 1]
