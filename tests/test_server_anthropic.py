"""POST /v1/messages against the official `anthropic` client.

Answers are compared with the same turn through /v1/chat/completions (greedy, same
tokens); shapes are the SDK's own types (it sends the key as `x-api-key`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from endpoint_helpers import API_KEY, MODEL, WEATHER_SCHEMA, Live, build_model
from endpoint_helpers import live_server as start

# This SDK no longer spells the sampling fields; the API still takes them.
GREEDY = {"temperature": 0.0}
TOOL = {"name": "get_weather", "description": "the weather", "input_schema": WEATHER_SCHEMA}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    folder: Path = tmp_path_factory.mktemp("anthropic")
    build_model(folder)
    with start(folder) as server:
        yield server


def client(live: Live, key: str = API_KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.url, api_key=key, timeout=120, max_retries=0)


def text_of(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_system_and_text_match_chat(live: Live) -> None:
    m = client(live).messages.create(
        model=MODEL,
        system="answer briefly",
        messages=[{"role": "user", "content": "hello world, the quick"}],
        max_tokens=12,
        extra_body=GREEDY,
    )
    ref = live.chat(
        [
            {"role": "system", "content": "answer briefly"},
            {"role": "user", "content": "hello world, the quick"},
        ],
        max_tokens=12,
    )
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert text_of(m) == ref.choices[0].message.content
    assert m.usage.input_tokens == ref.usage.prompt_tokens
    assert m.usage.output_tokens == ref.usage.completion_tokens
    assert m.usage.cache_read_input_tokens is not None
    expected = "max_tokens" if ref.choices[0].finish_reason == "length" else "end_turn"
    assert m.stop_reason == expected


def test_system_blocks_and_stop_sequences(live: Live) -> None:
    messages = [{"role": "user", "content": "streaming tokens to"}]
    ref = (
        live.chat([{"role": "system", "content": "be kind"}, *messages], max_tokens=20)
        .choices[0]
        .message.content
    )
    stop = ref[6:9]
    assert stop.strip(), ref
    m = client(live).messages.create(
        model=MODEL,
        system=[{"type": "text", "text": "be "}, {"type": "text", "text": "kind"}],
        messages=messages,
        max_tokens=20,
        extra_body=GREEDY,
        stop_sequences=["zzzz-never", stop],
    )
    assert m.stop_reason == "stop_sequence"
    assert m.stop_sequence == stop
    assert text_of(m) == ref[: ref.index(stop)]


def test_stream_matches_whole(live: Live) -> None:
    kw: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "the lazy dog"}],
        "max_tokens": 10,
        "extra_body": GREEDY,
    }
    whole = client(live).messages.create(**kw)
    with client(live).messages.stream(**kw) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == text_of(whole) == text_of(final)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens

    raw = client(live).messages.create(**kw, stream=True)
    types = [e.type for e in raw]
    n = types.count("content_block_delta")
    assert types == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * n,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]  # the SDK reads `ping` without yielding it


def test_tool_use_block(live: Live) -> None:
    kw: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "weather in paris"}],
        "tools": [TOOL],
        "max_tokens": 100,
        "extra_body": GREEDY,
    }
    m = client(live).messages.create(**kw, tool_choice={"type": "tool", "name": "get_weather"})
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER_SCHEMA)
    assert m.stop_reason == "tool_use"

    with client(live).messages.stream(
        **kw, tool_choice={"type": "any", "disable_parallel_tool_use": True}
    ) as stream:
        final = stream.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER_SCHEMA)
    assert final.stop_reason == "tool_use"


def test_tool_result_turn_matches_chat(live: Live) -> None:
    arguments = {"city": "Paris", "days": 1}
    m = client(live).messages.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "weather in paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "checking"},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": arguments,
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                    {"type": "text", "text": "thanks"},
                ],
            },
        ],
        tools=[TOOL],
        tool_choice={"type": "none"},
        max_tokens=10,
        extra_body=GREEDY,
    )
    call = {
        "id": "toolu_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps(arguments)},
    }
    ref = live.chat(
        [
            {"role": "user", "content": "weather in paris?"},
            {"role": "assistant", "content": "checking", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
            {"role": "user", "content": "thanks"},
        ],
        tools=[CHAT_TOOL],
        tool_choice="none",
        max_tokens=10,
    )
    assert text_of(m) == ref.choices[0].message.content
    assert m.usage.input_tokens == ref.usage.prompt_tokens


def test_output_config_format(live: Live) -> None:
    schema = {"type": "string", "enum": ["yes", "no"]}
    m = client(live).messages.create(
        model=MODEL,
        messages=[{"role": "user", "content": "yes or no?"}],
        max_tokens=20,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body=GREEDY,
    )
    jsonschema.validate(json.loads(text_of(m)), schema)
    assert m.stop_reason == "end_turn"


def test_count_tokens(live: Live) -> None:
    messages: list[Any] = [{"role": "user", "content": "hello server"}]
    counted = client(live).messages.count_tokens(model=MODEL, system="hi", messages=messages)
    ref = live.chat([{"role": "system", "content": "hi"}, *messages], max_tokens=1)
    assert counted.input_tokens == ref.usage.prompt_tokens


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        (
            {
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "base64", "data": ""}}],
                    }
                ],
            },
            "image",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            "web_search",
        ),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "temperature": 3},
            "temperature",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
                "thinking": {"type": "enabled", "budget_tokens": 1024},
            },
            "reasoning-parser",
        ),
    ],
)
def test_errors_in_anthropic_shape(live: Live, body: dict[str, Any], words: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:  # raw: the SDK would refuse some
        client(live).post("/v1/messages", body={"model": MODEL, **body}, cast_to=httpx.Response)
    error = info.value.body
    assert isinstance(error, dict) and error["type"] == "error", error
    assert error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"], error


def test_unknown_model_and_bad_key(live: Live) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        client(live).messages.create(
            model="claude-nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert info.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.AuthenticationError) as auth:
        client(live, key="wrong").messages.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert auth.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    # x-api-key and Bearer both carry the key
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(live.url + "/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=60)
    assert r.status_code == 200, r.text


def test_hang_up_aborts(live: Live) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1500,
        "stream": True,
        "temperature": 0.0,
    }
    live.hang_up_releases("/v1/messages", body)
