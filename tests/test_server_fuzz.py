"""Schemathesis over the server's own /openapi.json: no generated request may get a 5xx.

Issue 15 ("fuzzing in CI"). The short run is bounded (`FUZZ_EXAMPLES` per operation,
with a tiny model and a 64-token context so a fuzzed max_tokens stays cheap); the long run
takes 300 per operation. Both are `slow` (run them with `-m slow`): on the shared 2-core
box even the short one took ~3 minutes, over the default suite's budget. Every operation is
fuzzed, with and without the API key.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from server_helpers import build_tiny_llama, engine_kwargs

from pagemill.runtime import LLMEngine
from pagemill.server import AsyncEngine, ServerThread, build_app

KEY = "sk-fuzz"
FUZZ_EXAMPLES = int(os.environ.get("PAGEMILL_FUZZ_EXAMPLES", "12"))


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    folder = tmp_path_factory.mktemp("fuzz-llama")
    build_tiny_llama(folder)
    engine = LLMEngine(**engine_kwargs(folder, num_blocks=64, max_model_len=64))
    client = AsyncEngine(engine, max_pending=64)
    app = build_app(client, "tiny", api_key=KEY, max_body_bytes=256 * 1024)
    with ServerThread(app) as url:
        yield url, client
    client.shutdown()


def fuzz(url: str, examples: int) -> dict[str, Any]:
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    seen: dict[str, Any] = {"cases": 0, "statuses": {}}
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy())
        def run(case: Any) -> None:
            for headers in ({"Authorization": f"Bearer {KEY}"}, {}):
                response = case.call(headers=headers, timeout=120)
                seen["cases"] += 1
                seen["statuses"][response.status_code] = (
                    seen["statuses"].get(response.status_code, 0) + 1
                )
                assert response.status_code < 500, (
                    f"{case.method} {case.path} -> {response.status_code}: "
                    f"{response.text[:500]}\nbody: {str(case.body)[:500]}"
                )

        run()
    return seen


@pytest.mark.slow  # ~3 min on the shared 2-core CI box: over the default suite's budget
def test_openapi_is_published_and_fuzzing_finds_no_5xx(fuzz_server: tuple[str, Any]) -> None:
    url, client = fuzz_server
    seen = fuzz(url, FUZZ_EXAMPLES)
    print(f"schemathesis: {seen['cases']} calls, statuses {sorted(seen['statuses'].items())}")
    assert seen["cases"] >= FUZZ_EXAMPLES
    assert not client.is_dead


@pytest.mark.slow
def test_long_fuzz_run(fuzz_server: tuple[str, Any]) -> None:
    url, client = fuzz_server
    seen = fuzz(url, 300)
    print(
        f"schemathesis (long): {seen['cases']} calls, statuses {sorted(seen['statuses'].items())}"
    )
    assert not client.is_dead
