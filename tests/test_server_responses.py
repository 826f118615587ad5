"""POST /v1/responses against the official `openai` client (`client.responses`).

Answers are compared with the same turn through /v1/chat/completions (greedy, same
tokens); shapes and event order are the SDK's own types and OpenAI's documented order.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
from endpoint_helpers import ANSWER_SCHEMA, API_KEY, MODEL, WEATHER_SCHEMA, Live, build_model
from endpoint_helpers import live_server as start

CHAT_WEATHER = {"name": "get_weather", "parameters": WEATHER_SCHEMA}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    folder: Path = tmp_path_factory.mktemp("responses")
    build_model(folder)
    with start(folder) as server:
        yield server


def test_text_matches_chat(live: Live) -> None:
    r = live.openai().responses.create(
        model=MODEL,
        instructions="answer briefly",
        input="hello world, the quick",
        max_output_tokens=12,
        temperature=0.0,
    )
    ref = live.chat(
        [
            {"role": "system", "content": "answer briefly"},
            {"role": "user", "content": "hello world, the quick"},
        ],
        max_completion_tokens=12,
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == ref.choices[0].message.content
    assert [item.type for item in r.output] == ["message"]
    assert r.output[0].content[0].type == "output_text"
    assert r.usage is not None
    assert r.usage.input_tokens == ref.usage.prompt_tokens
    assert r.usage.output_tokens == ref.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens >= 0
    cut = ref.choices[0].finish_reason == "length"
    assert r.status == ("incomplete" if cut else "completed")
    if cut:
        assert r.incomplete_details is not None
        assert r.incomplete_details.reason == "max_output_tokens"


def test_input_items_match_chat(live: Live) -> None:
    """Messages with parts, a function call and its output: the chat turns they stand for."""
    items: list[Any] = [
        {"role": "system", "content": "you are terse"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
        {"role": "user", "content": "weather in paris?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris", "days": 1}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    r = live.openai().responses.create(
        model=MODEL,
        input=items,
        max_output_tokens=10,
        temperature=0.0,
        tools=[WEATHER_TOOL],
        tool_choice="none",
    )
    ref = live.chat(
        [
            {"role": "system", "content": "you are terse"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "weather in paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": '{"city": "Paris", "days": 1}',
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        max_completion_tokens=10,
        tools=[{"type": "function", "function": CHAT_WEATHER}],
        tool_choice="none",
    )
    assert r.output_text == ref.choices[0].message.content
    assert r.usage is not None and r.usage.input_tokens == ref.usage.prompt_tokens


def test_stream_event_order(live: Live) -> None:
    whole = live.openai().responses.create(
        model=MODEL, input="streaming tokens", max_output_tokens=10, temperature=0.0
    )
    events = list(
        live.openai().responses.create(
            model=MODEL,
            input="streaming tokens",
            max_output_tokens=10,
            temperature=0.0,
            stream=True,
        )
    )
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas
    final = whole.status
    expected = [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{final}",
    ]
    assert types == expected
    text = "".join(d.delta for d in deltas)
    assert text == whole.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text
    last = events[-1].response
    assert last.output_text == text
    assert last.usage is not None and last.usage.output_tokens == whole.usage.output_tokens
    assert last.usage.input_tokens == whole.usage.input_tokens
    item_ids = {e.item_id for e in deltas}
    assert item_ids == {last.output[0].id}


def test_required_function_call(live: Live) -> None:
    r = live.openai().responses.create(
        model=MODEL,
        input="weather in paris",
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0.0,
        max_output_tokens=100,
    )
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1
    assert calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_SCHEMA)

    events = list(
        live.openai().responses.create(
            model=MODEL,
            input="weather in paris",
            tools=[WEATHER_TOOL],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0.0,
            max_output_tokens=100,
            stream=True,
        )
    )
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == "".join(pieces) == calls[0].arguments
    assert len(pieces) > 1  # arguments arrive as they are written
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [a.type for a in added] == ["function_call"] and added[0].name == "get_weather"
    assert events[-1].type == "response.completed"


def test_named_function_choice(live: Live) -> None:
    r = live.openai().responses.create(
        model=MODEL,
        input="weather",
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0.0,
        max_output_tokens=100,
    )
    (call,) = [item for item in r.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)


def test_text_format_json_schema(live: Live) -> None:
    r = live.openai().responses.create(
        model=MODEL,
        input="yes or no?",
        text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA}},
        temperature=0.0,
        max_output_tokens=300,  # the random model pads with the whitespace JSON allows
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), ANSWER_SCHEMA)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}
    ref = live.chat(
        [{"role": "user", "content": "yes or no?"}], max_tokens=300, response_format=fmt
    )
    assert r.output_text == ref.choices[0].message.content
    assert r.text is not None and r.text.format.type == "json_schema"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
        ({"temperature": 5}, "temperature"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
    ],
)
def test_refusals_name_the_field(live: Live, extra: dict[str, Any], param: str) -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as info:
        live.openai().responses.create(**body)
    assert info.value.status_code == 400
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == param, error
    assert param in error["message"] or extra.get("temperature") is not None


def test_store_false_accepted_and_unknown_model_404(live: Live) -> None:
    r = live.openai().responses.create(
        model=MODEL, input="hi", max_output_tokens=2, store=False, temperature=0.0
    )
    assert r.status in ("completed", "incomplete")
    with pytest.raises(openai.NotFoundError):
        live.openai().responses.create(model="nope", input="hi", max_output_tokens=2)


def test_key_required(live: Live) -> None:
    r = httpx.post(live.url + "/v1/responses", json={"model": MODEL, "input": "hi"})
    assert r.status_code == 401
    ok = httpx.post(
        live.url + "/v1/responses",
        json={"model": MODEL, "input": "hi", "max_output_tokens": 2},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text


class YesNo(pydantic.BaseModel):
    answer: Literal["yes", "no"]


def test_sdk_helpers_parse_and_stream(live: Live) -> None:
    """The SDK's own helpers: `parse` (a pydantic text_format) and `stream` (which rebuilds
    the response from the events and checks their order)."""
    parsed = live.openai().responses.parse(
        model=MODEL, input="yes or no?", text_format=YesNo, max_output_tokens=200, temperature=0.0
    )
    assert isinstance(parsed.output_parsed, YesNo)
    with live.openai().responses.stream(
        model=MODEL,
        input="weather",
        tools=[WEATHER_TOOL],
        tool_choice="required",
        max_output_tokens=100,
        temperature=0.0,
    ) as stream:
        final = stream.get_final_response()
    (call,) = [item for item in final.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)


def test_hang_up_aborts(live: Live) -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 1500, "stream": True}
    live.hang_up_releases("/v1/responses", body | {"temperature": 0.0}, lines=9)
