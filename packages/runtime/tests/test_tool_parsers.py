"""Each tool-call format, whole and streamed piece by piece.

The model outputs are written the way each family's documentation and chat template
show them (Hermes/Qwen 2.5 `<tool_call>` blocks, Llama 3.1 JSON with `<|python_tag|>`,
Mistral's `[TOOL_CALLS]` before and after tokenizer v11, Llama 3.2/4 pythonic lists,
Qwen3-Coder's XML, Granite 3's `<|tool_call|>` array, Phi-4-mini's `functools[...]`).
A stream must send each call's name once and argument pieces whose concatenation is
exactly the whole answer's arguments.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from pagemill.runtime.tool_calling import (
    RequiredCallsParser,
    ToolCallStreamer,
    ToolParser,
    get_tool_parser,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "filters": {"type": "object"}},
            },
        },
    },
]

PARIS = {"city": 'Paris, "FR"', "days": 3, "metric": True}
SEARCH = {"query": "été {x} [1]", "filters": {"year": [2023, 2024], "lang": None}}
EXPECTED = [("get_weather", PARIS), ("search", SEARCH)]


def j(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


CASES: dict[str, tuple[str, str, str | None]] = {
    # parser name: (model output, content before the calls, expected content of the answer)
    "hermes": (
        "Let me look that up.\n"
        f'<tool_call>\n{{"name": "get_weather", "arguments": {j(PARIS)}}}\n</tool_call>\n'
        f'<tool_call>\n{{"name": "search", "arguments": {j(SEARCH)}}}\n</tool_call>',
        "Let me look that up.\n",
        "Let me look that up.",
    ),
    "llama3_json": (
        f'<|python_tag|>{{"name": "get_weather", "parameters": {j(PARIS)}}}; '
        f'{{"name": "search", "parameters": {j(SEARCH)}}}',
        "",
        None,
    ),
    "mistral": (
        f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {j(PARIS)}}}, '
        f'{{"name": "search", "arguments": {j(SEARCH)}}}]',
        "",
        None,
    ),
    "pythonic": (
        "[get_weather(city='Paris, \"FR\"', days=3, metric=True), "
        "search(query='été {x} [1]', filters={'year': [2023, 2024], 'lang': None})]",
        "",
        None,
    ),
    "qwen3_xml": (
        'I\'ll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis, "FR"\n'
        "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n"
        "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=search>\n"
        "<parameter=query>\nété {x} [1]\n</parameter>\n<parameter=filters>\n"
        '{"year": [2023, 2024], "lang": null}\n</parameter>\n</function>\n</tool_call>',
        "I'll check.\n",
        "I'll check.",
    ),
    "granite": (
        f'<|tool_call|>[{{"name": "get_weather", "arguments": {j(PARIS)}}}, '
        f'{{"name": "search", "arguments": {j(SEARCH)}}}]',
        "",
        None,
    ),
    "phi4_mini_json": (
        f'functools[{{"name": "get_weather", "arguments": {j(PARIS)}}}, '
        f'{{"name": "search", "arguments": {j(SEARCH)}}}]',
        "",
        None,
    ),
}


def pieces(text: str) -> list[str]:
    """Token-like pieces: words, runs of punctuation, single spaces/newlines, and every
    marker split in two (a marker arriving across tokens is the hard case)."""
    return re.findall(r"\w{1,3}|[^\w\s]|\s", text)


def stream(
    parser: ToolParser, text: str, parts: list[str] | None = None, **kw: Any
) -> tuple[str, dict[int, dict[str, Any]], int, ToolCallStreamer]:
    """(content, per-call {id, name, arguments, n_pieces}, deltas seen, streamer)."""
    streamer = ToolCallStreamer(parser, TOOLS, **kw)
    deltas: list[dict[str, Any]] = []
    for piece in parts if parts is not None else pieces(text):
        deltas += streamer.feed(piece)
    deltas += streamer.finish()
    content = ""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            call = calls.setdefault(tc["index"], {"arguments": "", "pieces": 0})
            if "id" in tc:
                assert "name" not in call, "a call's header is sent once"
                call.update(id=tc["id"], name=tc["function"]["name"])
            assert "name" in call, "arguments before the call's name"
            args = tc.get("function", {}).get("arguments", "")
            call["arguments"] += args
            call["pieces"] += bool(args)
    return content, calls, len(deltas), streamer


@pytest.mark.parametrize("name", sorted(CASES))
def test_whole_answer(name: str) -> None:
    text, _, content = CASES[name]
    found = get_tool_parser(name).extract(text, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in found.tool_calls] == EXPECTED
    assert found.content == content
    assert len({c.id for c in found.tool_calls}) == 2


@pytest.mark.parametrize("name", sorted(CASES))
def test_streamed_equals_whole(name: str) -> None:
    text, before, _ = CASES[name]
    parser = get_tool_parser(name)
    whole = parser.extract(text, TOOLS)
    content, calls, _, streamer = stream(parser, text)
    assert content == before
    assert [calls[i]["name"] for i in sorted(calls)] == [c.name for c in whole.tool_calls]
    assert [calls[i]["arguments"] for i in sorted(calls)] == [c.arguments for c in whole.tool_calls]
    assert [c.id for c in streamer.calls] == [calls[i]["id"] for i in sorted(calls)]
    # Incremental: the arguments come in more than one piece.
    assert all(calls[i]["pieces"] > 1 for i in calls), calls


@pytest.mark.parametrize("name", sorted(CASES))
def test_plain_answer_streams_as_content(name: str) -> None:
    parser = get_tool_parser(name)
    text = "The weather in Paris is sunny, about 21 °C."
    assert parser.extract(text, TOOLS).tool_calls == []
    assert parser.extract(text, TOOLS).content == text
    content, calls, n, _ = stream(parser, text)
    assert content == text and not calls
    assert n > 5  # as it comes, not at the end


@pytest.mark.parametrize("name", sorted(CASES))
def test_streamed_one_character_at_a_time(name: str) -> None:
    text = CASES[name][0]
    parser = get_tool_parser(name)
    _, calls, _, _ = stream(parser, text, list(text))
    whole = parser.extract(text, TOOLS)
    assert [calls[i]["arguments"] for i in sorted(calls)] == [c.arguments for c in whole.tool_calls]


def test_parallel_tool_calls_false_keeps_the_first() -> None:
    text = CASES["hermes"][0]
    _, calls, _, streamer = stream(get_tool_parser("hermes"), text, max_calls=1)
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"
    assert [c.name for c in streamer.calls] == ["get_weather"]


def test_mistral_v11_name_then_arguments() -> None:
    text = f"[TOOL_CALLS]get_weather{j(PARIS)}[TOOL_CALLS]search[ARGS]{j(SEARCH)}"
    parser = get_tool_parser("mistral")
    found = parser.extract(text, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in found.tool_calls] == EXPECTED
    # Mistral's templates take back only 9-character alphanumeric ids.
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in found.tool_calls)
    _, calls, _, _ = stream(parser, text)
    assert [calls[i]["arguments"] for i in sorted(calls)] == [c.arguments for c in found.tool_calls]


def test_llama4_pythonic_wrapped_in_python_tags() -> None:
    text = "<|python_start|>[get_weather(city='Oslo')]<|python_end|>"
    found = get_tool_parser("pythonic").extract(text)
    assert [(c.name, json.loads(c.arguments)) for c in found.tool_calls] == [
        ("get_weather", {"city": "Oslo"})
    ]


def test_qwen3_xml_types_follow_the_schema() -> None:
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
        "<parameter=days>\nnull\n</parameter>\n<parameter=extra>\nkept as text\n"
        "</parameter>\n</function>\n</tool_call>"
    )
    (call,) = get_tool_parser("qwen3_coder").extract(text, TOOLS).tool_calls
    # "42" stays a string (the schema says string); unknown parameters stay text.
    assert json.loads(call.arguments) == {"city": "42", "days": None, "extra": "kept as text"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_malformed_call_is_content(name: str) -> None:
    text = {
        "hermes": "<tool_call>{not json}</tool_call>",
        "llama3_json": '{"no_name": 1}',
        "mistral": "[TOOL_CALLS] not a call",
        "pythonic": "[1, 2, 3] are the numbers",
        "qwen3_xml": "<tool_call>\n</tool_call>",
        "granite": "<|tool_call|>oops",
        "phi4_mini_json": "functools[oops]",
    }[name]
    found = get_tool_parser(name).extract(text, TOOLS)
    assert found.tool_calls == [] and found.content == text


def test_required_array_cut_short_keeps_its_complete_calls() -> None:
    whole = f'[{{"name": "get_weather", "arguments": {j(PARIS)}}}, {{"name": "search", "arg'
    parser = RequiredCallsParser()
    found = parser.extract(whole)
    assert [(c.name, json.loads(c.arguments)) for c in found.tool_calls] == [("get_weather", PARIS)]
    _, calls, _, streamer = stream(parser, whole)
    assert calls[0]["arguments"] == j(PARIS) and calls[0]["pieces"] > 1
    assert [c.name for c in streamer.calls] == ["get_weather"]


def test_qwen3_xml_streams_text_parameters_as_written() -> None:
    code = "def add(a, b):\n    return a + b\n"
    text = (
        "<tool_call>\n<function=write_file>\n<parameter=path>\nadd.py\n</parameter>\n"
        f"<parameter=content>\n{code}\n</parameter>\n<parameter=mode>\nnull\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    parser = get_tool_parser("qwen3_xml")
    (call,) = parser.extract(text).tool_calls
    assert json.loads(call.arguments) == {"path": "add.py", "content": code, "mode": None}
    _, calls, _, _ = stream(parser, text, list(text))
    assert calls[0]["arguments"] == call.arguments
    # The code arrives piece by piece, not once its parameter closes.
    assert calls[0]["pieces"] > len(code) // 2


def test_tool_parser_names_match_the_registry() -> None:
    from pagemill.runtime.tool_calling.parser import TOOL_PARSER_NAMES, _registry

    assert set(TOOL_PARSER_NAMES) == set(_registry())


@pytest.mark.parametrize(
    ("snippet", "parser"),
    [
        ("{{ '<tool_call>\\n' }}{{ tool_call | tojson }}", "hermes"),
        ("<function={{ name }}>\n<parameter={{ p }}>", "qwen3_xml"),
        ("[TOOL_CALLS]{{ calls }}", "mistral"),
        ("<|python_start|>{{ code }}<|python_end|>", "pythonic"),
        ("<|start_header_id|>ipython<|end_header_id|>", "llama3_json"),
        ("<|tool_call|>{{ calls }}", "granite"),
        (None, "hermes"),
    ],
)
def test_parser_guessed_from_the_template(snippet: str | None, parser: str) -> None:
    from pagemill.runtime.tool_calling import parser_for_template

    assert parser_for_template(snippet) == parser
