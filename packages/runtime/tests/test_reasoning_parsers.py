"""Reasoning parsers without a model: the split of whole answers and of streams.

Outputs follow each family's documented shape: DeepSeek-R1's template opens `<think>` in
the prompt, so its output begins inside the reasoning and only `</think>` appears; Qwen3
writes `<think>` itself (older templates) or not (newer ones); with
`enable_thinking: false` Qwen3's template writes an empty `<think>\\n\\n</think>\\n\\n` into
the prompt.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest

from pagemill.runtime.reasoning import REASONING_PARSER_NAMES, get_reasoning_parser

VOCAB = {"<think>": 7, "</think>": 8, "a": 1, "b": 2}
TOKENIZER = SimpleNamespace(get_vocab=lambda: VOCAB)


def make(name: str, **kwargs: Any) -> Any:
    return get_reasoning_parser(name)(TOKENIZER, kwargs or None)


def streamed(parser: Any, text: str) -> tuple[str, str, int]:
    """(reasoning, content, reasoning pieces) from feeding `text` a few characters at a time."""
    reasoning, content, pieces, seen = "", "", 0, ""
    for part in [*re.findall(r".{1,3}", text, re.DOTALL), None]:
        seen += part or ""
        r, c = parser.split(seen, part is None)
        assert r.startswith(reasoning) and c.startswith(content), "a split only grows"
        pieces += len(r) > len(reasoning)
        reasoning, content = r, c
    return reasoning, content, pieces


CASES = [
    # (output, reasoning, content)
    ("Okay, 2+2 is 4.\n</think>\n\nThe answer is 4.", "Okay, 2+2 is 4.\n", "\n\nThe answer is 4."),
    ("<think>\nLet me see.\n</think>\n\n4", "\nLet me see.\n", "\n\n4"),
    ("Still thinking when cut off", "Still thinking when cut off", ""),
    ("</think>Direct answer.", "", "Direct answer."),
]


@pytest.mark.parametrize("name", REASONING_PARSER_NAMES)
@pytest.mark.parametrize(("text", "reasoning", "content"), CASES)
def test_split_whole_and_streamed(name: str, text: str, reasoning: str, content: str) -> None:
    parser = make(name)
    assert parser.split(text, final=True) == (reasoning, content)
    got_r, got_c, pieces = streamed(parser, text)
    assert (got_r, got_c) == (reasoning, content)
    if len(reasoning) > 6:
        assert pieces > 1


def test_a_marker_split_across_tokens_is_held_back() -> None:
    parser = make("deepseek_r1")
    assert parser.split("abc</thi") == ("abc", "")
    assert parser.split("<thi") == ("", "")
    assert parser.split("abc</think>x") == ("abc", "x")


def test_qwen3_enable_thinking_false() -> None:
    on, off = make("qwen3"), make("qwen3", enable_thinking=False)
    assert on.thinking_enabled and not off.thinking_enabled
    # DeepSeek-R1 has no such switch.
    assert make("deepseek_r1", enable_thinking=False).thinking_enabled


def test_prompt_that_closed_the_reasoning() -> None:
    parser = make("qwen3")
    assert parser.prompt_ends_reasoning([1, 7, 2, 8, 2])  # <think>\n\n</think>\n\n
    assert not parser.prompt_ends_reasoning([1, 7, 2])  # the template opened <think>
    assert not parser.prompt_ends_reasoning([1, 7, 8, 2, 7])  # a past turn, then a new one
    assert parser.end_token_ids == [8]


def test_text_fallback_without_single_tokens() -> None:
    tok = SimpleNamespace(get_vocab=lambda: {}, decode=lambda ids, **kw: "".join(map(str, ids)))
    parser = get_reasoning_parser("deepseek_r1")(tok)
    assert parser.end_token_ids is None
    assert not parser.prompt_ends_reasoning([1, 2])


def test_unknown_parser() -> None:
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        get_reasoning_parser("nope")


@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        (
            "I need the weather.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
            "Paris\n</parameter>\n</function>\n</tool_call>",
            "I need the weather.\n",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "</function>\n</tool_call>",
        ),
        (
            "The format is <tool_call> then JSON; no call yet.",
            "The format is <tool_call> then JSON; no call yet.",
            "",
        ),
    ],
)
def test_qwen3_tool_call_inside_thinking_ends_it(text: str, reasoning: str, content: str) -> None:
    parser = make("qwen3")
    assert parser.split(text, final=True) == (reasoning, content)
    assert streamed(parser, text)[:2] == (reasoning, content)
    # DeepSeek-R1 has no such rule: all of it is reasoning.
    assert make("deepseek_r1").split(text, final=True) == (text, "")
