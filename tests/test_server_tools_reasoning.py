"""Tool calls and reasoning through the server, against the official `openai` client.

A tiny random Llama cannot choose to call a tool, so its text is forced: a
`structured_outputs.choice` makes it write exactly one Hermes-format answer, which the
server's tool parser then reads as any model's ("auto"). "required" is forced by the
server's own grammar. For reasoning, the model's `</think>` token is wired to win wherever
one chosen token would (its output row copies that token's, slightly larger), so a greedy
answer thinks freely for a few tokens, ends its reasoning, and then answers under the
request's grammar: the gate that keeps a structured-output constraint off the reasoning.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import server_helpers

from pagemill.runtime import LLMEngine
from pagemill.server import AsyncEngine, ServerThread, build_app

MODEL = "tiny-tools"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think>{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "enum": [1, 2, 3]},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
HERMES_ANSWER = (
    "Let me check both.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
    "</tool_call>\n"
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)
MESSAGES = [{"role": "user", "content": "weather in paris and the time"}]


REASONING_STEPS = 4  # greedy decoding writes `</think>` as its fifth token


def greedy_ids(model: Any, prompt: list[int], n: int) -> list[int]:
    import torch

    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None
    )
    return out[0, len(prompt) :].tolist()


def chat_prompt(tok: Any) -> list[int]:
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return list(tok.encode(text, add_special_tokens=False))


def build_model(folder: Path) -> None:
    """A tiny Llama whose tokenizer has `<think>`/`</think>` as (non-special) tokens, and
    whose greedy answer to MESSAGES writes `</think>` after REASONING_STEPS tokens: the
    output row of `</think>` copies (slightly enlarged) the row of the token greedy
    decoding writes at that step, so `</think>` wins there."""
    import torch
    import transformers

    server_helpers.build_tiny_llama(folder, 2048, extra_special=(), chat_template=CHAT_TEMPLATE)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    tok.add_tokens(["<think>", "</think>"])
    tok.save_pretrained(str(folder))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    end = tok.convert_tokens_to_ids("</think>")
    prompt = chat_prompt(tok)
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        ref = greedy_ids(model, prompt, REASONING_STEPS + 1)
        head[end] = head[ref[REASONING_STEPS]] * 1.05
        got = greedy_ids(model, prompt, REASONING_STEPS + 1)
    assert got == [*ref[:REASONING_STEPS], end], (ref, got)
    model.save_pretrained(str(folder))


def make_engine(folder: Path) -> LLMEngine:
    return LLMEngine(
        model=str(folder),
        device="cpu",
        dtype="float32",
        block_size=16,
        kv_cache_memory_bytes=320 * 16 * 2 * 2 * 2 * 16 * 4,
        max_num_batched_tokens=2048,
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-tools")
    build_model(folder)
    return folder


@pytest.fixture(scope="module")
def client(model_dir: Path) -> Iterator[openai.OpenAI]:
    engine = AsyncEngine(make_engine(model_dir))
    app = build_app(engine, MODEL)
    with ServerThread(app) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=120, max_retries=0)
    engine.shutdown()


def collect(stream: Any) -> tuple[str, dict[int, dict[str, Any]], Any]:
    """(content, calls by index with their argument pieces, finish_reason) of a stream."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"pieces": [], "name": None, "id": None})
                if tc.id:
                    call["id"] = tc.id
                if tc.function and tc.function.name:
                    assert call["name"] is None, "the name is sent once"
                    call["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    call["pieces"].append(tc.function.arguments)
            finish = choice.finish_reason or finish
    return content, calls, finish


def forced(answer: str, **kw: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "temperature": 0.0,
        "max_tokens": 400,
        "extra_body": {"structured_outputs": {"choice": [answer]}},
        **kw,
    }


def test_auto_calls_whole_and_streamed(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(**forced(HERMES_ANSWER))
    msg = whole.choices[0].message
    assert msg.content == "Let me check both."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("get_time", {"zone": "CET"}),
    ]
    assert whole.choices[0].finish_reason == "tool_calls"

    streamed = client.chat.completions.create(**forced(HERMES_ANSWER), stream=True)
    content, calls, finish = collect(streamed)
    assert content.strip() == "Let me check both."
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_time"]
    for i, c in enumerate(msg.tool_calls):
        assert "".join(calls[i]["pieces"]) == c.function.arguments
        assert len(calls[i]["pieces"]) > 1, calls[i]  # incremental, not one chunk at the end
    assert finish == "tool_calls"


def test_auto_without_parallel_calls_keeps_the_first(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(**forced(HERMES_ANSWER, parallel_tool_calls=False))
    assert [c.function.name for c in whole.choices[0].message.tool_calls] == ["get_weather"]
    _, calls, _ = collect(
        client.chat.completions.create(
            **forced(HERMES_ANSWER, parallel_tool_calls=False), stream=True
        )
    )
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"


def required(**kw: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "temperature": 0.0,
        **kw,
    }


def test_required_streams_arguments_and_equals_whole(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(**required(max_tokens=300, logprobs=True))
    calls = whole.choices[0].message.tool_calls
    assert calls and all(c.function.name in ("get_weather", "get_time") for c in calls)
    stream = client.chat.completions.create(**required(max_tokens=300), stream=True)
    _, streamed, _ = collect(stream)
    assert ["".join(streamed[i]["pieces"]) for i in sorted(streamed)] == [
        c.function.arguments for c in calls
    ]
    assert all(len(streamed[i]["pieces"]) > 1 for i in streamed)


def test_required_cut_short_returns_its_complete_calls(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(**required(max_tokens=300, logprobs=True))
    calls = whole.choices[0].message.tool_calls
    tokens = [t.token for t in whole.choices[0].logprobs.content]
    # Cut right after the token that completes the first call object.
    text, cut = "", None
    for i, token in enumerate(tokens):
        text += token
        start = text.find("{")
        if start >= 0:
            try:
                json.JSONDecoder().raw_decode(text, start)
            except ValueError:
                continue
            cut = i + 1
            break
    assert cut is not None and cut < len(tokens)
    short = client.chat.completions.create(**required(max_tokens=cut))
    assert short.choices[0].finish_reason == "length"
    got = short.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in got] == [
        (calls[0].function.name, calls[0].function.arguments)
    ]
    assert short.choices[0].message.content is None


@pytest.fixture(scope="module")
def thinking(model_dir: Path) -> Iterator[openai.OpenAI]:
    engine = AsyncEngine(make_engine(model_dir))
    app = build_app(engine, MODEL, reasoning_parser="deepseek_r1")
    with ServerThread(app) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=120, max_retries=0)
    engine.shutdown()


def reference_text(model_dir: Path, n: int) -> tuple[str, str]:
    """(the reasoning, all the text) of the greedy answer, from transformers."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    prompt = chat_prompt(tok)
    ids = greedy_ids(model, prompt, n)
    return tok.decode(ids[:REASONING_STEPS]), tok.decode(ids)


def test_reasoning_split_whole_and_streamed(thinking: openai.OpenAI, model_dir: Path) -> None:
    n = REASONING_STEPS + 6
    reasoning, text = reference_text(model_dir, n)
    ask = {"model": MODEL, "messages": MESSAGES, "temperature": 0.0, "max_tokens": n}
    whole = thinking.chat.completions.create(**ask, extra_body={"ignore_eos": True})
    msg = whole.choices[0].message
    assert msg.reasoning_content == reasoning and msg.reasoning == reasoning
    assert reasoning + "</think>" + msg.content == text
    stream = thinking.chat.completions.create(**ask, stream=True, extra_body={"ignore_eos": True})
    pieces, content = [], ""
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            if getattr(delta, "reasoning_content", None):
                assert delta.reasoning == delta.reasoning_content
                pieces.append(delta.reasoning_content)
            content += delta.content or ""
    assert "".join(pieces) == reasoning and len(pieces) > 1
    assert content == whole.choices[0].message.content


def test_include_reasoning_false_leaves_it_out(thinking: openai.OpenAI, model_dir: Path) -> None:
    """vLLM's include_reasoning=false: the same answer, no reasoning in it, whole or streamed."""
    n = REASONING_STEPS + 6
    reasoning, text = reference_text(model_dir, n)
    ask = {"model": MODEL, "messages": MESSAGES, "temperature": 0.0, "max_tokens": n}
    body = {"ignore_eos": True, "include_reasoning": False}
    msg = thinking.chat.completions.create(**ask, extra_body=body).choices[0].message
    assert getattr(msg, "reasoning_content", None) is None and msg.reasoning is None
    assert reasoning + "</think>" + msg.content == text
    content = ""
    for chunk in thinking.chat.completions.create(**ask, stream=True, extra_body=body):
        for choice in chunk.choices:
            assert not getattr(choice.delta, "reasoning_content", None)
            content += choice.delta.content or ""
    assert content == msg.content


def test_structured_output_starts_after_the_reasoning(
    thinking: openai.OpenAI, model_dir: Path
) -> None:
    """The grammar leaves the reasoning free (it matches the unconstrained greedy answer,
    `</think>` included) and constrains the answer after it."""
    reasoning, _ = reference_text(model_dir, REASONING_STEPS + 1)
    answer = thinking.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0.0,
        max_tokens=40,
        extra_body={"structured_outputs": {"choice": ["sunny", "rainy"]}},
    )
    msg = answer.choices[0].message
    assert msg.reasoning_content == reasoning
    assert msg.content in ("sunny", "rainy")
    assert answer.choices[0].finish_reason == "stop"


def test_required_without_parallel_calls_makes_one(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(**required(max_tokens=300, parallel_tool_calls=False))
    assert len(whole.choices[0].message.tool_calls) == 1


@pytest.fixture(scope="module")
def llama_json(model_dir: Path) -> Iterator[openai.OpenAI]:
    engine = AsyncEngine(make_engine(model_dir))
    app = build_app(engine, MODEL, tool_call_parser="llama3_json")
    with ServerThread(app) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=120, max_retries=0)
    engine.shutdown()


def test_parser_whose_markers_are_special_tokens(llama_json: openai.OpenAI) -> None:
    """llama3_json's `<|python_tag|>` is a special token, so "auto" answers are decoded
    with special tokens kept; the end-of-turn token that then ends the text is cut off
    again, or the call would not parse."""
    answer = '{"name": "get_time", "parameters": {"zone": "UTC"}}'
    whole = llama_json.chat.completions.create(**forced(answer))
    (call,) = whole.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_time",
        {"zone": "UTC"},
    )
    assert whole.choices[0].message.content is None
    _, calls, finish = collect(llama_json.chat.completions.create(**forced(answer), stream=True))
    assert "".join(calls[0]["pieces"]) == call.function.arguments and finish == "tool_calls"
    # A plain answer keeps its text, without the end-of-turn token.
    plain = llama_json.chat.completions.create(**forced("It is noon."))
    assert plain.choices[0].message.content == "It is noon."
