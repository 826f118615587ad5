"""The engine core in its own process (`AsyncEngine.launch`), as `pagemill serve` runs it.

A tiny random-weight Llama with a trained BPE tokenizer, so the engine process runs the real
scheduler, pool, kernels and detokenizer. The checks: the HTTP answers equal an in-process
engine's; the engine steps on while the server's event loop holds the interpreter lock and
never lets go; an engine process that dies is noticed (/health 503, in-flight streams end
with an error); shutdown and start-up failures are clean.
"""

from __future__ import annotations

import asyncio
import operator
import os
import signal
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_helpers import build_tiny_llama

from pagemill.runtime import LLMEngine, SamplingParams
from pagemill.runtime.sampling_params import RequestOutputKind
from pagemill.server import AsyncEngine, EngineDeadError, EngineMetrics, ServerThread, build_app

MODEL = "tiny-llama"


def engine_kwargs(folder: Path) -> dict[str, Any]:
    return {
        "model": str(folder),
        "device": "cpu",
        "dtype": "float32",
        "block_size": 16,
        "kv_cache_memory_bytes": 4 << 20,
        "max_num_batched_tokens": 512,
    }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("engine-process-llama")
    build_tiny_llama(folder)
    return folder


@pytest.fixture(scope="module")
def proc_client(model_dir: Path) -> Iterator[AsyncEngine]:
    client = AsyncEngine.launch(observer=EngineMetrics(MODEL), **engine_kwargs(model_dir))
    yield client
    client.shutdown()


def reference_text(folder: Path, prompt: Any, **params: Any) -> tuple[str, list[int]]:
    engine = LLMEngine(**engine_kwargs(folder))
    engine.add_request(
        "ref", prompt, SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, **params)
    )
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out if out.finished else final
    assert final is not None
    return final.outputs[0].text, list(final.outputs[0].token_ids)


def test_http_through_an_engine_process_equals_the_engine(
    model_dir: Path, proc_client: AsyncEngine
) -> None:
    app = build_app(proc_client, MODEL)
    assert proc_client.engine.max_model_len == 1024 and proc_client.engine.tokenizer is not None
    text, ids = reference_text(
        model_dir, "hello world", max_tokens=12, temperature=0.0, ignore_eos=True
    )
    with ServerThread(app) as url:
        oc = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        whole = oc.completions.create(
            model=MODEL,
            prompt="hello world",
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert whole.choices[0].text == text
        assert whole.usage.completion_tokens == 12
        chunks = list(
            oc.completions.create(
                model=MODEL,
                prompt="hello world",
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
        # The prompt travels with a request's first output only; usage still counts it.
        assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
        ids_whole = oc.completions.create(model=MODEL, prompt=ids[:5], max_tokens=4, temperature=0)
        assert ids_whole.usage.prompt_tokens == 5
        chat = oc.chat.completions.create(
            model=MODEL,
            max_tokens=6,
            temperature=0,
            messages=[{"role": "user", "content": "hello"}],
        )
        assert chat.choices[0].finish_reason in ("stop", "length")
        assert httpx.get(url + "/health").status_code == 200
        metrics = httpx.get(url + "/metrics").text
        assert (
            'pagemill:engine_step_seconds_count{model_name="tiny-llama",phase="decode"}' in metrics
        )
        assert 'pagemill:generation_tokens_total{model_name="tiny-llama"}' in metrics
    # Functions sent to the engine process must pickle by reference to a module that
    # process can import: the standard library's are safe; this test module is not (under
    # `--import-mode=importlib` it is not on the child's path).
    stats = proc_client.submit(operator.methodcaller("get_stats")).result(timeout=30)
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0  # every block back
    assert proc_client.submit(operator.attrgetter("max_model_len")).result(timeout=30) == 1024
    with pytest.raises(TypeError, match="cannot send"):
        proc_client.submit(lambda e: e.get_stats()).result(timeout=30)
    # A function the engine process cannot import fails that call alone.
    local = types.ModuleType("pagemill_only_in_this_process")

    def here_only(engine: Any) -> int:
        return 1

    here_only.__module__ = local.__name__
    here_only.__qualname__ = "here_only"
    local.here_only = here_only  # type: ignore[attr-defined]
    sys.modules[local.__name__] = local
    try:
        with pytest.raises(Exception, match="pagemill_only_in_this_process"):
            proc_client.submit(here_only).result(timeout=30)
    finally:
        del sys.modules[local.__name__]
    assert not proc_client.is_dead
    assert proc_client.submit(operator.attrgetter("max_model_len")).result(timeout=30) == 1024


def test_engine_steps_while_the_event_loop_holds_the_gil(proc_client: AsyncEngine) -> None:
    """The engine process never waits on the event loop.

    The loop thread spins in pure Python with the switch interval raised to 1000 s, so no
    other thread of this process can take the interpreter lock until it stops: an engine
    thread here would make no progress at all. The engine process finishes the whole
    request meanwhile (its step counter lives in shared memory), and the outputs it sent
    all arrive once the loop runs again.
    """
    n = 40

    async def main() -> list[Any]:
        start = proc_client.engine_steps  # before the add: the engine starts at once
        q = await proc_client.add_request(
            "gil", [5, 6, 7, 8], SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
        )
        old = sys.getswitchinterval()
        sys.setswitchinterval(1000.0)
        try:
            deadline = time.monotonic() + 120
            while proc_client.engine_steps < start + n and time.monotonic() < deadline:
                pass  # the loop is stuck; nothing of this process runs but this
            reached = proc_client.engine_steps - start
        finally:
            sys.setswitchinterval(old)
        assert reached >= n, f"the engine ran {reached} of {n} steps while the loop was stuck"
        return [out async for out in proc_client.stream(q, ["gil"])]

    outs = asyncio.run(asyncio.wait_for(main(), timeout=180))
    assert sum(len(o.outputs[0].token_ids) for o in outs) == n
    assert outs[-1].finished and outs[-1].prompt_token_ids == [5, 6, 7, 8]
    assert proc_client.num_pending == 0


def test_a_dead_engine_process_is_noticed(model_dir: Path) -> None:
    client = AsyncEngine.launch(**engine_kwargs(model_dir))
    app = build_app(client, MODEL)
    # Long enough that the engine is still generating when it is killed.
    body = {"prompt": "hello world", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    try:
        with ServerThread(app) as url:
            assert httpx.get(url + "/health").status_code == 200
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
                assert resp.status_code == 200
                lines = resp.iter_lines()
                assert next(line for line in lines if line.startswith("data: {"))
                os.kill(client.engine_pid, signal.SIGKILL)  # an OOM kill, a segfault...
                rest = "\n".join(lines)
            assert '"code": 503' in rest and rest.rstrip().endswith("data: [DONE]")
            assert client.is_dead and "exited unexpectedly" in repr(client.dead_error)
            assert httpx.get(url + "/health").status_code == 503
            after = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
            assert after.status_code == 503
            with pytest.raises(EngineDeadError):
                client.submit(operator.methodcaller("get_stats")).result(timeout=30)
    finally:
        client.shutdown()


def test_shutdown_ends_streams_and_refuses_later_requests(model_dir: Path) -> None:
    client = AsyncEngine.launch(**engine_kwargs(model_dir))

    async def main() -> None:
        q = await client.add_request(
            "a", [1, 2, 3], SamplingParams(max_tokens=1000, ignore_eos=True)
        )
        stream = client.stream(q, ["a"])
        await stream.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, client.shutdown)
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await client.add_request("b", [1], SamplingParams())

    try:
        asyncio.run(asyncio.wait_for(main(), timeout=120))
        assert not client.client.process.is_alive() and not client.is_dead  # the MPClient's
    finally:
        client.shutdown()


def test_an_engine_that_cannot_start_says_why(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="could not start"):
        AsyncEngine.launch(model=str(tmp_path / "missing"), device="cpu", start_timeout=300)


def test_tools_reach_the_prompt_through_the_engine_process(
    model_dir: Path, proc_client: AsyncEngine
) -> None:
    """The engine-process front end renders tools as the in-process engine does (a template
    without tools gets them in the Hermes format, in the system turn)."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "the weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = [{"role": "user", "content": "hello"}]
    ids = proc_client.engine.apply_chat_template(messages, tools=tools)
    reference = LLMEngine(**engine_kwargs(model_dir))
    assert ids == reference.apply_chat_template(messages, tools=tools)
    assert ids != reference.apply_chat_template(messages)
    assert "get_weather" in reference.tokenizer.decode(ids)
