"""Structured output and tool calling on SmolLM2-135M through the official openai client.

One live server on 127.0.0.1 serves the default model. Every JSON output must parse and
validate against its schema with `jsonschema`, at temperature 0 and above; forced tool
calls must carry arguments that validate against the function's parameters. Requests of a
test go out concurrently, so they share engine steps (and the test's time).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from pagemill.runtime import DEFAULT_MODEL, LLMEngine
from pagemill.server import ServerThread, build_app

MODEL = "smollm2"


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    # These tests judge what the grammars let through, not how fast they compile: the
    # deadline (10 s of the worker's CPU by default, its own tests elsewhere) is raised so a
    # busy 2-core CI box compiling the first grammar never fails a schema here.
    engine = LLMEngine(
        model=DEFAULT_MODEL,
        max_model_len=1024,
        kv_cache_memory_bytes=96 << 20,
        max_num_seqs=32,
        structured_outputs_compile_timeout=60.0,
    )
    with ServerThread(build_app(engine, MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="none", timeout=300, max_retries=0)


def concurrently(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    with ThreadPoolExecutor(max_workers=max(1, len(items))) as pool:
        return list(pool.map(fn, items))


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "employed"],
}
ORDER = {
    "type": "object",
    "properties": {
        "size": {"type": "string", "enum": ["small", "medium", "large"]},
        "toppings": {
            "type": "array",
            "items": {"type": "string", "enum": ["cheese", "ham", "olives"]},
            "minItems": 1,
            "maxItems": 3,
        },
        "price": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["size", "toppings", "price"],
}
NESTED = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "location": {
            "type": "object",
            "properties": {
                "lat": {"type": "integer", "minimum": -90, "maximum": 90},
                "lon": {"type": "integer", "minimum": -180, "maximum": 180},
            },
            "required": ["lat", "lon"],
        },
        "capital": {"type": "boolean"},
    },
    "required": ["city", "location", "capital"],
}
SCORES = {
    "type": "object",
    "properties": {
        "scores": {
            "type": "array",
            "items": {"type": "integer", "minimum": 1, "maximum": 10},
            "minItems": 2,
            "maxItems": 4,
        },
        "passed": {"type": "boolean"},
    },
    "required": ["scores", "passed"],
}
BOOK = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "authors": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 30},
                    "role": {"enum": ["author", "editor"]},
                },
                "required": ["name", "role"],
            },
            "minItems": 1,
            "maxItems": 2,
        },
        "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
        "in_print": {"type": "boolean"},
    },
    "required": ["title", "authors", "year", "in_print"],
}
EVENT = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["meeting", "call", "lunch"]},
        "attendees": {"type": "integer", "minimum": 1, "maximum": 20},
        "remote": {"type": "boolean"},
        "agenda": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
    },
    "required": ["kind", "attendees", "remote", "agenda"],
}
PRODUCT = {
    "type": "object",
    "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "stock": {"type": "integer", "minimum": 0, "maximum": 1000},
        "tags": {
            "type": "array",
            "items": {"enum": ["new", "sale", "eco"]},
            "minItems": 0,
            "maxItems": 3,
        },
        "dimensions": {
            "type": "object",
            "properties": {"w": {"type": "number"}, "h": {"type": "number"}},
            "required": ["w", "h"],
        },
    },
    "required": ["sku", "stock", "tags", "dimensions"],
}
FLAGS = {
    "type": "object",
    "properties": {
        "a": {"type": "boolean"},
        "b": {"type": "boolean"},
        "c": {"type": "null"},
        "mode": {"enum": ["on", "off", 3]},
    },
    "required": ["a", "b", "c", "mode"],
}

SCHEMAS = {
    "person": PERSON,
    "order": ORDER,
    "nested": NESTED,
    "scores": SCORES,
    "book": BOOK,
    "event": EVENT,
    "product": PRODUCT,
    "flags": FLAGS,
}
PROMPTS = {
    "person": "Describe a person.",
    "order": "Order a pizza.",
    "nested": "Describe a city and where it is.",
    "scores": "Grade an exam.",
    "book": "Describe a famous book.",
    "event": "Plan an event.",
    "product": "Describe a product in a shop.",
    "flags": "Set some flags.",
}


def ask_json(
    client: openai.OpenAI, name: str, temperature: float, seed: int = 0, max_tokens: int = 200
) -> tuple[str, str | None]:
    r = client.chat.completions.create(
        model=MODEL,
        temperature=temperature,
        seed=seed,
        max_tokens=max_tokens,
        messages=[{"role": "user", "content": PROMPTS[name] + " Answer in JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True},
        },
    )
    return r.choices[0].message.content or "", r.choices[0].finish_reason


def check_json_schemas(
    client: openai.OpenAI,
    cases: list[tuple[str, float, int]],
    one_at_a_time: bool = False,
    max_tokens: int = 200,
) -> None:
    def ask(case: tuple[str, float, int]) -> tuple[str, str | None]:
        return ask_json(client, *case, max_tokens=max_tokens)

    results = [ask(c) for c in cases] if one_at_a_time else concurrently(ask, cases)
    for (name, temperature, seed), (text, reason) in zip(cases, results):
        assert reason == "stop", (name, temperature, seed, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_json_schemas_validate_at_temperature_0_and_above(client: openai.OpenAI) -> None:
    check_json_schemas(client, [("person", 0.0, 0), ("order", 0.8, 1)])


@pytest.mark.slow
def test_many_json_schemas_validate(client: openai.OpenAI) -> None:
    """Every schema at three temperatures, one request at a time, each with room for the
    longest answer its grammar allows.

    One at a time: sent together, the 24 answers share steps whose row counts depend on
    when each arrives, and a packed layer's kernel (so its rounding) depends on the row
    count: each sampled answer was a draw of its own. Room: the grammar caps free
    whitespace at `MAX_JSON_WHITESPACE` in a row, and a small model at T=0.7-1 may spend
    most of every gap's allowance (newline after newline) — within the schema, but past a
    200-token limit. These schemas bound every value's length (product's two numbers
    aside), so an answer still unfinished at 600 tokens is one the grammar failed to
    bound."""
    cases = [(name, t, seed) for name in SCHEMAS for t, seed in ((0.0, 0), (0.7, 1), (1.0, 2))]
    check_json_schemas(client, cases, one_at_a_time=True, max_tokens=600)


@pytest.mark.slow
def test_structured_outputs_on_completions_and_chat(client: openai.OpenAI) -> None:
    def choice(_: Any) -> str:
        r = client.completions.create(
            model=MODEL,
            prompt="Is the sky blue? Answer:",
            max_tokens=10,
            temperature=0,
            extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
        )
        return r.choices[0].text

    def regex(_: Any) -> str:
        r = client.chat.completions.create(
            model=MODEL,
            max_tokens=20,
            temperature=0.7,
            seed=3,
            messages=[{"role": "user", "content": "Give me a phone number."}],
            extra_body={"structured_outputs": {"regex": r"\(\d{3}\) \d{3}-\d{4}"}},
        )
        return r.choices[0].message.content or ""

    def json_object(_: Any) -> str:
        r = client.chat.completions.create(
            model=MODEL,
            max_tokens=300,
            temperature=0,
            messages=[{"role": "user", "content": "Describe a cat in JSON."}],
            response_format={"type": "json_object"},
        )
        assert r.choices[0].finish_reason in ("stop", "length")
        text = r.choices[0].message.content or ""
        # Cut by max_tokens, the object is unfinished; it must still begin as one.
        return text if r.choices[0].finish_reason == "stop" else "{}" if text[:1] == "{" else text

    c, rx, obj = concurrently(lambda f: f(None), [choice, regex, json_object])
    assert c in ("yes", "no")
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", rx)
    assert isinstance(json.loads(obj), dict)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
FLIGHT = {
    "type": "function",
    "function": {
        "name": "book_flight",
        "description": "Book a flight",
        "parameters": {
            "type": "object",
            "properties": {
                "origin": {"type": "string", "maxLength": 30},
                "destination": {"type": "string", "maxLength": 30},
                "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["origin", "destination", "passengers"],
        },
    },
}
TOOLS = [WEATHER, FLIGHT]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def test_required_named_and_streamed_tool_calls(client: openai.OpenAI) -> None:
    def required(temperature: float) -> Any:
        return client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=120,
            temperature=temperature,
            seed=4,
            parallel_tool_calls=False,
        )

    def named_streamed(_: Any) -> list[Any]:
        return list(
            client.chat.completions.create(
                model=MODEL,
                messages=ASK,
                tools=TOOLS,
                max_tokens=120,
                temperature=0,
                stream=True,
                tool_choice={"type": "function", "function": {"name": "book_flight"}},
            )
        )

    r0, r1, chunks = concurrently(
        lambda f: f[0](f[1]), [(required, 0.0), (required, 0.8), (named_streamed, None)]
    )
    for r in (r0, r1):
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    # Streamed: the first tool-call delta names the function, the rest carry arguments.
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert calls[0].function.name == "book_flight" and calls[0].id
    assert all(c.index == 0 for c in calls) and len(calls) > 2
    arguments = "".join(c.function.arguments or "" for c in calls)
    jsonschema.validate(json.loads(arguments), PARAMS["book_flight"])
    assert chunks[-1].choices[0].finish_reason == "stop"  # a forced named call, as OpenAI


def test_tool_result_round_trip(client: openai.OpenAI, server: str) -> None:
    first = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        max_tokens=120,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": json.dumps({"temperature": 21, "sky": "sunny"}),
        },
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=40, temperature=0
    )
    assert second.choices[0].message.content
    assert second.choices[0].message.tool_calls == []
    # The call and its result went into the prompt, in the Hermes format.
    tokens = httpx.post(
        server + "/tokenize", json={"messages": history, "tools": TOOLS}, timeout=60
    ).json()["tokens"]
    text = httpx.post(server + "/detokenize", json={"tokens": tokens}, timeout=60).json()["prompt"]
    assert "<tool_call>" in text and call.function.arguments.replace(" ", "") in text.replace(
        " ", ""
    )
    assert '<tool_response>\n{"temperature": 21, "sky": "sunny"}\n</tool_response>' in text
    assert second.usage.prompt_tokens < len(tokens)  # tool_choice none: no tool list


@pytest.mark.slow
def test_streamed_required_and_auto_tool_calls(client: openai.OpenAI) -> None:
    # One call (this small model repeats a call until max_tokens when it may make several).
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=120,
            temperature=0,
            stream=True,
            parallel_tool_calls=False,
        )
    )
    # Calls stream incrementally: each call's name once, then its argument pieces.
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    pieces = 0
    for c in chunks:
        for part in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            if part.function and part.function.name:
                names[part.index] = part.function.name
            if part.function and part.function.arguments:
                arguments[part.index] = arguments.get(part.index, "") + part.function.arguments
                pieces += 1
    assert names and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert len(names) == 1 and pieces > 1  # parallel_tool_calls=False; streamed in pieces
    for index, name in names.items():
        jsonschema.validate(json.loads(arguments[index]), PARAMS[name])
    auto = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0
    )
    message = auto.choices[0].message
    assert message.content or message.tool_calls


def test_logit_bias_tokenize_detokenize_openapi(client: openai.OpenAI, server: str) -> None:
    tok = httpx.post(
        server + "/tokenize", json={"prompt": " banana", "return_token_strs": True}, timeout=60
    ).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 1024
    assert "".join(tok["token_strs"]).replace("Ġ", " ") == " banana"
    target = tok["tokens"][0]
    r = client.completions.create(
        model=MODEL,
        prompt="My favourite fruit is",
        max_tokens=3,
        temperature=0,
        logit_bias={str(target): 100},
        extra_body={"ignore_eos": True},
    )
    assert (
        r.choices[0].text
        == httpx.post(server + "/detokenize", json={"tokens": [target] * 3}, timeout=60).json()[
            "prompt"
        ]
    )
    spec = httpx.get(server + "/openapi.json", timeout=60).json()
    assert {"/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"} <= set(
        spec["paths"]
    )


@pytest.mark.parametrize(
    "body, match",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "Unsupported type",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
        ({"structured_outputs": {"regex": "(("}}, "regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "send only one",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}},
            "'launch', which is not among the tools",
        ),
        ({"tool_choice": "required"}, "tool_choice needs 'tools'"),
        ({"logit_bias": {"49152": 1}}, "outside the vocabulary"),
        ({"logit_bias": {"12": 101}}, "logit_bias"),
    ],
)
def test_bad_input_is_a_400(server: str, body: dict, match: str) -> None:
    r = httpx.post(
        server + "/v1/chat/completions",
        timeout=60,
        json={"model": MODEL, "messages": ASK, "max_tokens": 5, **body},
    )
    assert r.status_code == 400, r.text
    assert match in r.json()["error"]["message"]
