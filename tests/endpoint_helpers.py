"""Shared by the Responses, Anthropic and Ollama endpoint tests: one tiny-model server per
test module, and the same request through /v1/chat/completions as the reference.

The reference is the server's own chat endpoint, whose output the chat tests check
against a directly driven engine: the other APIs translate onto it, so greedy answers
must agree token for token.
"""

from __future__ import annotations

import contextlib
import time
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
    def __init__(self, url: str, engine: AsyncEngine) -> None:
        self.url = url
        self.engine = engine

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=API_KEY, timeout=120, max_retries=0)

    def chat(self, messages: list[dict[str, Any]], **kw: Any) -> Any:
        """The reference: the same turn through /v1/chat/completions, greedy."""
        kw.setdefault("temperature", 0.0)
        return self.openai().chat.completions.create(model=MODEL, messages=messages, **kw)

    def running(self) -> int:
        return int(self.engine.submit(lambda e: e.get_stats()).result(timeout=30).num_running)

    def hang_up_releases(self, path: str, body: dict[str, Any], lines: int = 3) -> None:
        """Read a few lines of a stream, hang up: the engine request must end at once."""
        h = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.stream("POST", self.url + path, json=body, headers=h, timeout=60) as r:
            assert r.status_code == 200
            it = r.iter_lines()
            for _ in range(lines):
                next(it)
            assert self.running() == 1
        deadline = time.monotonic() + 10
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.running() == 0

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
            yield Live(url, client)
    finally:
        client.shutdown()
