"""Shared by the Responses, Anthropic and Ollama endpoint tests: one tiny-model server per
test module, and the same request through /v1/chat/completions as the reference.

The reference is the server's own chat endpoint, whose output the chat tests check
against a directly driven engine: the other APIs translate onto it, so greedy answers
must agree token for token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import server_helpers

from pagemill.runtime import LLMEngine
from pagemill.server import AsyncEngine, ServerThread, build_app

API_KEY = "sk-endpoints"
MODEL = "tiny-endpoints"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "enum": [1, 2, 3]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no"]},
        "n": {"type": "integer", "enum": [1, 2, 3]},
    },
    "required": ["answer", "n"],
    "additionalProperties": False,
}


def build_model(folder: Path) -> None:
    server_helpers.build_tiny_llama(folder, 2048)


class Live:
    def __init__(self, url: str) -> None:
        self.url = url

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=API_KEY, timeout=120, max_retries=0)

    def chat(self, messages: list[dict[str, Any]], **kw: Any) -> Any:
        """The reference: the same turn through /v1/chat/completions, greedy."""
        kw.setdefault("temperature", 0.0)
        return self.openai().chat.completions.create(model=MODEL, messages=messages, **kw)

    def post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
        h = {"Authorization": f"Bearer {API_KEY}", **(headers or {})}
        return httpx.post(self.url + path, json=body, headers=h, timeout=120)


@contextlib.contextmanager
def live_server(folder: Path, **app_kwargs: Any) -> Iterator[Live]:
    engine = LLMEngine(**server_helpers.engine_kwargs(folder, num_blocks=192, max_model_len=2048))
    client = AsyncEngine(engine)
    app = build_app(client, MODEL, api_key=API_KEY, **app_kwargs)
    try:
        with ServerThread(app) as url:
            yield Live(url)
    finally:
        client.shutdown()
