"""Ollama's /api/* against the official `ollama` Python client.

Answers are compared with the same turn through /v1/chat/completions (and a `raw`
generate with /v1/completions), greedy: same tokens, Ollama's shapes and counts.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import ollama
import pytest
from endpoint_helpers import API_KEY, MODEL, WEATHER_SCHEMA, Live, build_model
from endpoint_helpers import live_server as start

from pagemill.server.entrypoints.ollama.serving import OllamaServing

GREEDY = {"temperature": 0, "num_predict": 12}
# As the ollama client sends it (its Tool model keeps these keys, in this order).
PARAMETERS = {
    "type": "object",
    "required": WEATHER_SCHEMA["required"],
    "properties": WEATHER_SCHEMA["properties"],
}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    folder: Path = tmp_path_factory.mktemp("ollama")
    build_model(folder)
    with start(folder) as server:
        yield server


def client(live: Live) -> ollama.Client:
    return ollama.Client(host=live.url, headers={"Authorization": f"Bearer {API_KEY}"})


def test_chat_matches_chat_completions(live: Live) -> None:
    messages = [
        {"role": "system", "content": "answer briefly"},
        {"role": "user", "content": "hello world, the quick"},
    ]
    r = client(live).chat(model=MODEL, messages=messages, options=GREEDY, stream=False)
    ref = live.chat(messages, max_tokens=12)
    assert r.message.role == "assistant"
    assert r.message.content == ref.choices[0].message.content
    assert r.done is True
    assert r.done_reason == ("length" if ref.choices[0].finish_reason == "length" else "stop")
    assert r.prompt_eval_count == ref.usage.prompt_tokens
    assert r.eval_count == ref.usage.completion_tokens
    assert r.total_duration and r.total_duration > 0
    assert r.eval_duration is not None and r.prompt_eval_duration is not None
    assert r.total_duration >= r.eval_duration + r.prompt_eval_duration
    assert r.model == MODEL and r.created_at

    parts = list(client(live).chat(model=MODEL, messages=messages, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content or "" for p in parts) == r.message.content
    assert parts[-1].eval_count == r.eval_count
    assert parts[-1].prompt_eval_count == r.prompt_eval_count


def test_latest_tag_and_tool_history(live: Live) -> None:
    arguments = {"city": "Paris", "days": 1}
    r = client(live).chat(
        model=MODEL + ":latest",
        messages=[
            {"role": "user", "content": "weather in paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "get_weather", "arguments": arguments}}],
            },
            {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
        ],
        tools=[CHAT_TOOL],
        options=GREEDY,
    )
    call = {
        "id": "call_1_0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps(arguments)},
    }
    ref = live.chat(
        [
            {"role": "user", "content": "weather in paris?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1_0", "content": "sunny", "name": "get_weather"},
        ],
        tools=[CHAT_TOOL],
        max_tokens=12,
    )
    # The model has no reason to call: its answer is the chat endpoint's answer.
    assert r.message.content == ref.choices[0].message.content
    assert r.prompt_eval_count == ref.usage.prompt_tokens


def test_generate_templated_and_raw(live: Live) -> None:
    r = client(live).generate(
        model=MODEL, prompt="the lazy dog", system="be kind", options=GREEDY, stream=False
    )
    ref = live.chat(
        [{"role": "system", "content": "be kind"}, {"role": "user", "content": "the lazy dog"}],
        max_tokens=12,
    )
    assert r.response == ref.choices[0].message.content
    assert r.prompt_eval_count == ref.usage.prompt_tokens

    streamed = list(
        client(live).generate(
            model=MODEL, prompt="the lazy dog", system="be kind", options=GREEDY, stream=True
        )
    )
    assert "".join(p.response for p in streamed) == r.response and streamed[-1].done

    raw = client(live).generate(model=MODEL, prompt="hello world", raw=True, options=GREEDY)
    ref_raw = live.openai().completions.create(
        model=MODEL, prompt="hello world", max_tokens=12, temperature=0.0
    )
    assert raw.response == ref_raw.choices[0].text
    assert raw.prompt_eval_count == ref_raw.usage.prompt_tokens


def test_format_schema(live: Live) -> None:
    schema = {"type": "string", "enum": ["yes", "no"]}
    r = client(live).chat(
        model=MODEL,
        messages=[{"role": "user", "content": "yes or no?"}],
        format=schema,
        options={"temperature": 0, "num_predict": 20},
    )
    jsonschema.validate(json.loads(r.message.content or ""), schema)
    assert r.done_reason == "stop"


def test_list_show_ps_version(live: Live) -> None:
    models = client(live).list().models
    assert [m.model for m in models] == [MODEL]
    assert models[0].size and models[0].size > 0
    shown = client(live).show(MODEL)
    assert shown.modelinfo is not None
    assert shown.modelinfo["llama.context_length"] == 2048
    assert shown.capabilities is not None and "completion" in shown.capabilities
    assert shown.template and "im_start" in shown.template
    assert shown.details is not None and shown.details.family == "llama"
    running = client(live).ps().models
    assert [m.model for m in running] == [MODEL] and running[0].context_length == 2048
    version = httpx.get(live.url + "/api/version", headers={"Authorization": f"Bearer {API_KEY}"})
    assert version.json()["version"]


def test_load_call(live: Live) -> None:
    r = client(live).generate(model=MODEL)  # `ollama run` preloads this way
    assert r.done and r.done_reason == "load" and r.response == ""
    r = client(live).chat(model=MODEL, messages=[], keep_alive=0)
    assert r.done and r.done_reason == "unload"


@pytest.mark.parametrize(
    ("call", "status", "words"),
    [
        (lambda c: c.chat(model="nope", messages=[{"role": "user", "content": "x"}]), 404, "nope"),
        (
            lambda c: c.generate(model=MODEL, prompt="x", options={"typical_p": 0.5}),
            400,
            "typical_p",
        ),
        (lambda c: c.generate(model=MODEL, prompt="x", template="{{ .Prompt }}"), 400, "template"),
        (lambda c: c.generate(model=MODEL, prompt="x", images=[b"\x89PNG"]), 400, "images"),
        (
            lambda c: c.chat(model=MODEL, messages=[{"role": "user", "content": "x"}], think=True),
            400,
            "reasoning-parser",
        ),
        (
            lambda c: c.generate(model=MODEL, prompt="x", options={"temperature": 9}),
            400,
            "temperature",
        ),
    ],
)
def test_errors_in_ollama_shape(live: Live, call: Any, status: int, words: str) -> None:
    with pytest.raises(ollama.ResponseError) as info:
        call(client(live))
    assert info.value.status_code == status
    assert isinstance(info.value.error, str) and words in info.value.error


def test_key_required(live: Live) -> None:
    r = httpx.post(live.url + "/api/chat", json={"model": MODEL, "messages": []})
    assert r.status_code == 401 and "error" in r.json() and isinstance(r.json()["error"], str)


def test_tool_calls_are_sent_whole() -> None:
    """Chat streams a call's arguments in pieces; Ollama sends each call once, complete."""

    async def chunks() -> AsyncIterator[dict[str, Any]]:
        head = {"index": 0, "id": "c0", "type": "function"}
        yield {
            "choices": [
                {
                    "delta": {
                        "tool_calls": [{**head, "function": {"name": "f", "arguments": '{"a"'}}]
                    }
                }
            ]
        }
        yield {
            "choices": [
                {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}}
            ]
        }
        head = {"index": 1, "id": "c1", "type": "function"}
        yield {
            "choices": [
                {"delta": {"tool_calls": [{**head, "function": {"name": "g", "arguments": "{}"}}]}}
            ]
        }
        yield {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]}
        yield {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 9}}

    async def run() -> list[dict[str, Any]]:
        serving = OllamaServing.__new__(OllamaServing)
        stream = serving._parts(MODEL, "message", None, chunks(), 0)  # type: ignore[arg-type]
        return [p async for p in stream]

    parts = asyncio.run(run())
    calls = [c for p in parts for c in p["message"].get("tool_calls", [])]
    assert calls == [
        {"function": {"name": "f", "arguments": {"a": 1}}},
        {"function": {"name": "g", "arguments": {}}},
    ]
    assert parts[-1]["done"] and parts[-1]["eval_count"] == 9
    ollama.ChatResponse.model_validate(parts[0])


def test_hang_up_aborts(live: Live) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "options": {"temperature": 0, "num_predict": 1500},
    }
    live.hang_up_releases("/api/chat", body)
