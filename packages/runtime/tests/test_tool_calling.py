"""Tool calling without a model: parsers, the prompt rewrite, the forcing schemas."""

from __future__ import annotations

import json

import jsonschema
import pytest
from transformers import PreTrainedTokenizerFast

from pagemill.runtime.tool_calling import (
    calls_from_required,
    get_tool_parser,
    named_function_schema,
    parser_for_template,
    render_chat,
    required_schema,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {}}}


def test_hermes_parser_splits_content_and_calls() -> None:
    p = get_tool_parser("hermes")
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    found = p.extract(text)
    assert found.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in found.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert found.tool_calls[0].id != found.tool_calls[1].id
    # Unclosed last block (cut at the end of the call) still parses; broken JSON is text.
    assert p.extract('<tool_call>{"name": "f", "arguments": {"a": 1}}').tool_calls[0].name == "f"
    broken = p.extract("<tool_call>{not json</tool_call>")
    assert not broken.tools_called and broken.content == "<tool_call>{not json</tool_call>"
    assert p.extract("no calls here").content == "no calls here"


def test_hermes_streaming_holds_back_a_possible_marker() -> None:
    p = get_tool_parser("hermes")
    assert p.parse("Hello").content == "Hello"
    assert p.parse("Hello <tool").content == "Hello "
    started = p.parse("Hello <tool_call>{")
    assert started.content == "Hello " and all(c.name is None for c in started.calls)
    assert p.parse("a < b").content == "a < b"


def test_llama3_json_parser() -> None:
    p = get_tool_parser("llama3_json")
    found = p.extract(
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
        '{"name": "get_time", "parameters": {}}'
    )
    assert [(c.name, json.loads(c.arguments)) for c in found.tool_calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    assert found.content is None
    assert not p.extract("The weather is fine.").tools_called
    assert not p.extract('{"no_name": 1}').tools_called
    assert p.parse("The answer").content == "The answer"
    assert p.parse(' {"name"').content == ""
    assert p.parse("<|python").content == ""
    with pytest.raises(ValueError, match="unknown tool call parser"):
        get_tool_parser("nope")
    assert parser_for_template("... <|python_tag|> ...") == "llama3_json"
    assert parser_for_template("{{ '<tool_call>' }}") == "hermes"


def test_forcing_schemas_accept_exactly_valid_calls() -> None:
    tools = [WEATHER, TIME]
    schema = required_schema(tools)
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Rome"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "arguments": {}}], schema)
    assert required_schema(tools, parallel=False)["maxItems"] == 1
    assert named_function_schema(tools, "get_weather") == WEATHER["function"]["parameters"]
    assert named_function_schema(tools, "get_time") == {"type": "object"}
    with pytest.raises(ValueError, match="not among the tools"):
        named_function_schema(tools, "launch")
    calls = calls_from_required('[{"name": "get_time", "arguments": {}}]')
    assert [(c.name, c.arguments) for c in calls] == [("get_time", "{}")]
    assert calls_from_required('[{"name": "get_ti') == []
    # Cut short by max_tokens: the calls it completed are still calls.
    cut = (
        '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": '
        '{"city": "Paris"}},\n {"name": "get_wea'
    )
    assert [(c.name, c.arguments) for c in calls_from_required(cut)] == [
        ("get_time", "{}"),
        ("get_weather", '{"city": "Paris"}'),
    ]


@pytest.fixture(scope="module")
def plain_tokenizer(tiny_llama) -> PreTrainedTokenizerFast:
    folder, _ = tiny_llama
    return PreTrainedTokenizerFast.from_pretrained(str(folder))


def test_template_without_tools_gets_the_hermes_format(plain_tokenizer) -> None:
    messages = [
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    text = render_chat(plain_tokenizer, messages, True, [WEATHER])
    assert text.startswith("<|system|>You are a function calling AI model.")
    assert json.dumps(WEATHER) in text
    assert (
        '<|assistant|><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        "\n</tool_call>" in text
    )
    assert "<|user|><tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert text.endswith("<|assistant|>")
    # Without tools nothing changes.
    assert render_chat(plain_tokenizer, messages[:1]) == "<|user|>weather in Paris?\n<|assistant|>"


def test_template_with_tools_gets_them_natively(plain_tokenizer) -> None:
    tok = plain_tokenizer
    saved = tok.chat_template
    tok.chat_template = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}\n"
        "{% endif %}{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
        "{% if m.tool_calls %}{% for c in m.tool_calls %}[{{ c['function']['name'] }} "
        "{{ c['function']['arguments'] | tojson }}]{% endfor %}{% endif %}\n{% endfor %}"
    )
    try:
        text = render_chat(
            tok,
            [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'},
                        }
                    ],
                },
                {"role": "tool", "content": "12:00"},
            ],
            False,
            [WEATHER, TIME],
        )
    finally:
        tok.chat_template = saved
    # (transformers renders with trim_blocks: a newline after a block tag is dropped)
    assert text == 'TOOLS:get_weather;get_time;user:hiassistant:[get_time {"tz": "UTC"}]tool:12:00'
