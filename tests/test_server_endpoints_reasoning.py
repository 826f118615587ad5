"""Reasoning through the Responses, Anthropic and Ollama APIs (`--reasoning-parser`).

The model is test_server_tools_reasoning's: a tiny Llama wired so that its greedy answer
writes `</think>` after a few free tokens. Each API must return the same split as
/v1/chat/completions (reasoning_content / content): a reasoning item, a thinking block,
Ollama's `thinking`, whole and streamed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import ollama
import openai
import pytest
from test_server_tools_reasoning import MESSAGES, MODEL, REASONING_STEPS, build_model, make_engine

from pagemill.server import AsyncEngine, ServerThread, build_app

N = REASONING_STEPS + 6
PROMPT = MESSAGES[0]["content"]


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder: Path = tmp_path_factory.mktemp("endpoints-thinking")
    build_model(folder)
    engine = AsyncEngine(make_engine(folder))
    app = build_app(engine, MODEL, reasoning_parser="deepseek_r1")
    with ServerThread(app) as base:
        yield base
    engine.shutdown()


@pytest.fixture(scope="module")
def ref(url: str) -> tuple[str, str]:
    """(reasoning, answer) of the same turn through /v1/chat/completions."""
    chat = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    r = chat.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=N, temperature=0)
    message = r.choices[0].message
    reasoning = message.reasoning_content  # type: ignore[attr-defined]
    assert reasoning, "the model should think first"
    return reasoning, message.content or ""


def test_responses_reasoning_item(url: str, ref: tuple[str, str]) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    ask: dict[str, Any] = {
        "model": MODEL,
        "input": PROMPT,
        "max_output_tokens": N,
        "temperature": 0.0,
        "reasoning": {"effort": "low"},
    }
    r = client.responses.create(**ask)
    kinds = [item.type for item in r.output]
    assert kinds[0] == "reasoning"
    assert r.output[0].content is not None and r.output[0].content[0].text == ref[0]
    assert r.output_text == ref[1]
    assert r.usage is not None and r.usage.output_tokens_details.reasoning_tokens > 0

    events = list(client.responses.create(**ask, stream=True))
    thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thinking, text) == ref
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == kinds


def test_anthropic_thinking_block(url: str, ref: tuple[str, str]) -> None:
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    ask: dict[str, Any] = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": N,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "extra_body": {"temperature": 0.0},
    }
    m = client.messages.create(**ask)
    assert m.content[0].type == "thinking" and m.content[0].thinking == ref[0]
    assert "".join(b.text for b in m.content if b.type == "text") == ref[1]
    with client.messages.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [
        e.delta.thinking
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "thinking_delta"
    ]  # type: ignore[union-attr]
    assert "".join(deltas) == ref[0]
    assert final.content[0].type == "thinking" and final.content[0].thinking == ref[0]


def test_ollama_thinking(url: str, ref: tuple[str, str]) -> None:
    client = ollama.Client(host=url)
    options = {"temperature": 0, "num_predict": N}
    r = client.chat(model=MODEL, messages=MESSAGES, options=options, think=True)
    assert (r.message.thinking, r.message.content) == ref
    parts = list(client.chat(model=MODEL, messages=MESSAGES, options=options, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == ref[0]
    assert "".join(p.message.content or "" for p in parts) == ref[1]
    off = client.chat(model=MODEL, messages=MESSAGES, options=options, think=False)
    assert not off.message.thinking
