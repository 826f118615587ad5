"""Server pieces that need no model: request validation, deltas, the CLI, the engine thread.

The engine-thread tests drive the real front end (`AsyncEngine`: input and output
processing) over a scripted engine core on its own thread (`ThreadedClient`): it makes
failures (a core that raises, a shutdown mid-request) easy to provoke and exact to check.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from typing import Any

import pytest
from pydantic import ValidationError
from server_helpers import CoreDouble, front_end

from pagemill.runtime import SamplingParams
from pagemill.runtime.engine.detokenizer import IncrementalDetokenizer
from pagemill.runtime.engine.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from pagemill.server import AsyncEngine, EngineDeadError, QueueFullError
from pagemill.server.cli import build_parser, parse_size
from pagemill.server.entrypoints.openai.errors import error_body
from pagemill.server.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagemill.server.entrypoints.openai.serving_base import split_logprobs
from pagemill.server.metrics import EngineMetrics

# ---------------------------------------------------------------- protocol


def test_prompt_forms() -> None:
    assert CompletionRequest(prompt="hi").prompts() == ["hi"]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": []},
        {"prompt": [[]]},
        {"prompt": [-1]},
        {"prompt": 5},
        {"prompt": "x", "n": 0},
        {"prompt": "x", "temperature": 3},
        {"prompt": "x", "top_p": 0},
        {"prompt": "x", "stop": [""]},
        {"prompt": "x", "logit_bias": {"1": "much"}},
        {"prompt": "x", "best_of": 3},
        {"prompt": "x", "top_k": -2},
        {"prompt": "x", "min_p": 2},
        {"prompt": "x", "presence_penalty": 5},
        {"prompt": "x", "stop_token_ids": [-1]},
        {"prompt": "x", "cache_salt": ""},
    ],
)
def test_completion_request_rejects(body: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate(body)


def test_chat_request_rules() -> None:
    req = ChatCompletionRequest(
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ],
        max_tokens=5,
        max_completion_tokens=7,
        logprobs=True,
    )
    assert req.messages[0].text() == "ab"
    assert req.effective_max_tokens == 7  # the newer field wins
    assert req.num_logprobs == 0
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]).num_logprobs is None
    for bad in (
        {"messages": []},
        {"messages": [{"role": "user", "content": "x"}], "tools": [{}]},
        {"messages": [{"role": "user"}], "response_format": {"type": "json_schema"}},
        {"messages": [{"role": "user"}], "response_format": {"type": "yaml"}},
        {"messages": [{"role": "user"}], "tool_choice": "sometimes"},
    ):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate(bad)
    # Fields OpenAI clients send that we do not use are ignored, not refused.
    ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "store": False, "metadata": {"a": "b"}}
    )


def test_error_body_shape() -> None:
    body = error_body(429, "busy")
    assert body == {
        "error": {"message": "busy", "type": "rate_limit_error", "param": None, "code": 429}
    }


# ---------------------------------------------------------------- deltas


class _Chars:
    """A tokenizer whose ids are single characters (0 = EOS), to place boundaries exactly."""

    def __init__(self, text: str) -> None:
        self.alphabet = ["</s>", *sorted(set(text))]

    def ids(self, text: str) -> list[int]:
        return [self.alphabet.index(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.alphabet[i] for i in ids if not (skip_special_tokens and i == 0))


def test_stream_text_is_held_back_once_and_only_for_a_possible_stop() -> None:
    """Streams forward the detokenizer's deltas: the only hold-back is a real stop prefix.

    The server used to hold back max_stop_len - 1 characters on top of the detokenizer's
    own hold-back, so "abcE" released only "ab" although "c" can never start "END".
    """
    tok = _Chars("abcENDx")
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["END"]))
    deltas = []
    for i in tok.ids("abcENx"):
        d.update([i])
        deltas.append(d.get_delta())
    assert deltas == ["a", "b", "c", "", "", "ENx"]  # "E", "EN" wait; "ENx" is no stop
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["END"]))
    for i in tok.ids("abEND"):
        d.update([i])
    assert d.get_delta() == "ab" and d.output_text == "ab"  # the cut stop string never leaks
    assert d.get_delta(finished=True) == ""


def test_split_logprobs() -> None:
    sampled, top = split_logprobs({5: -2.0, 1: -0.1, 2: -0.5}, 2)
    assert sampled == -2.0 and top == [(1, -0.1), (2, -0.5)]
    assert split_logprobs({5: -2.0}, 0) == (-2.0, [])


# ---------------------------------------------------------------- CLI


def test_parse_size() -> None:
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("4GiB") == 4 * 2**30
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("1048576") == 1048576
    for bad in ("lots", "-5MB", "0", "3 parsecs"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)


def test_serve_defaults_bind_loopback() -> None:
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.model, args.api_key) == ("127.0.0.1", 8000, None, None)
    assert args.max_body_size == 4 * 2**20 and not args.no_prefix_caching
    args = build_parser().parse_args(
        [
            "serve",
            "/models/x",
            "--dtype",
            "bfloat16",
            "--block-size",
            "32",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "512",
            "--kv-cache-memory",
            "1GiB",
            "--no-prefix-caching",
            "--scheduling-policy",
            "priority",
            "--seed",
            "3",
            "--host",
            "0.0.0.0",
            "--port",
            "9000",
            "--api-key",
            "k",
            "--max-queue-len",
            "10",
        ]
    )
    from pagemill.server.cli import engine_kwargs

    kw = engine_kwargs(args)
    assert kw["model"] == "/models/x" and kw["dtype"] == "bfloat16" and kw["block_size"] == 32
    assert kw["kv_cache_memory_bytes"] == 2**30 and kw["enable_prefix_caching"] is False
    assert kw["scheduling_policy"] == "priority" and kw["seed"] == 3
    assert (args.host, args.port, args.api_key, args.max_queue_len) == ("0.0.0.0", 9000, "k", 10)


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--port", "0"],
        ["serve", "--block-size", "x"],
        ["serve", "--scheduling-policy", "lifo"],
        ["generate"],
        ["bench", "serve", "--concurrency", "0,4"],
        [],
    ],
)
def test_cli_rejects(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_cli_help_lists_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    for cmd in ("serve", "generate", "download", "bench"):
        assert cmd in out


# ---------------------------------------------------------------- engine thread


class ScriptedCore(CoreDouble):
    """An engine core that emits one token per step per request (ids 0, 1, 2, ...) until
    max_tokens; can be told to fail. The front end over it is the server's real one."""

    max_model_len = 10**7

    def __init__(self) -> None:
        self.requests: dict[str, tuple[EngineCoreRequest, list[int]]] = {}
        self.fail_next_step = False
        self.steps = 0
        self.step_threads: set[str] = set()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.requests[request.request_id] = (request, [])

    def abort_requests(self, request_ids: Any, reason: FinishReason = FinishReason.ABORT) -> None:
        for rid in request_ids:
            self.requests.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> EngineCoreOutputs:
        self.steps += 1
        self.step_threads.add(threading.current_thread().name)
        if self.fail_next_step:
            raise RuntimeError("device lost")
        outs = []
        for rid, (request, toks) in list(self.requests.items()):
            toks.append(len(toks))
            done = len(toks) >= request.max_tokens
            outs.append(EngineCoreOutput(rid, [toks[-1]], FinishReason.LENGTH if done else None))
            if done:
                del self.requests[rid]
        return EngineCoreOutputs(outs, num_scheduled_tokens=len(outs))

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(num_running=len(self.requests), num_blocks=1, block_size=16)


async def _collect(client: AsyncEngine, rid: str, n: int) -> list[Any]:
    q = await client.add_request(rid, [1, 2], SamplingParams(max_tokens=n))
    return [out async for out in client.stream(q, [rid])]


def test_engine_thread_streams_and_idles() -> None:
    engine = ScriptedCore()
    metrics = EngineMetrics("m")
    client = front_end(engine, observer=metrics)
    try:
        outs = asyncio.run(_collect(client, "r1", 4))
        assert [o.outputs[0].token_ids for o in outs] == [[0], [1], [2], [3]]  # deltas
        assert outs[-1].finished and client.num_pending == 0
        assert engine.step_threads == {"pagemill-engine"}  # never the event loop's thread
        steps = engine.steps
        time.sleep(0.2)
        assert engine.steps == steps  # idle: blocked on the queue, not spinning
        assert engine.get_stats().num_running == 0
        text = metrics.render().decode()
        assert 'pagemill:generation_tokens_total{model_name="m"} 4.0' in text
        assert 'pagemill:prompt_tokens_total{model_name="m"} 2.0' in text
        assert 'pagemill:request_success_total{finished_reason="length",model_name="m"} 1.0' in text
    finally:
        client.shutdown()


def test_engine_validation_error_reaches_caller() -> None:
    client = front_end(ScriptedCore())
    try:
        with pytest.raises(ValueError, match="empty"):
            asyncio.run(client.add_request("bad", [], SamplingParams()))
        assert client.num_pending == 0 and not client.is_dead
    finally:
        client.shutdown()


def test_queue_limit() -> None:
    engine = ScriptedCore()
    client = front_end(engine, max_pending=1)

    async def main() -> None:
        q = await client.add_request("a", [1], SamplingParams(max_tokens=1000))
        with pytest.raises(QueueFullError):
            await client.add_request("b", [1], SamplingParams(max_tokens=1))
        client.release("a", finished=False)
        await client.add_request("c", [1], SamplingParams(max_tokens=1))
        client.release("c", finished=False)
        del q

    try:
        asyncio.run(main())
        assert client.num_pending == 0
    finally:
        client.shutdown()


def test_engine_failure_kills_client_and_fails_requests() -> None:
    engine = ScriptedCore()
    client = front_end(engine)

    async def main() -> None:
        q = await client.add_request("a", [1], SamplingParams(max_tokens=10**6))
        stream = client.stream(q, ["a"])
        await stream.__anext__()
        engine.fail_next_step = True
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await client.add_request("b", [1], SamplingParams())
        with pytest.raises(EngineDeadError):
            await client.call(lambda e: None)

    try:
        asyncio.run(asyncio.wait_for(main(), timeout=30))
        assert client.is_dead and "device lost" in repr(client.dead_error)
    finally:
        client.shutdown()


def test_leaving_a_stream_aborts_the_request() -> None:
    engine = ScriptedCore()
    client = front_end(engine)

    async def main() -> None:
        q = await client.add_request("a", [1], SamplingParams(max_tokens=10**6))
        stream = client.stream(q, ["a"])
        await stream.__anext__()
        await stream.aclose()
        assert client.num_pending == 0
        # The abort is applied by the engine thread before its next step.
        assert await client.call(lambda e: "a" not in e.requests)

    try:
        asyncio.run(asyncio.wait_for(main(), timeout=30))
    finally:
        client.shutdown()


def test_a_blocked_event_loop_does_not_hold_up_the_engine_thread() -> None:
    """The engine thread never waits on the loop: with the loop blocked (here on an event,
    as a handler stuck in a blocking call would be) the engine runs every step, and the
    outputs it delivered meanwhile are all there, in order, once the loop runs again."""
    engine = ScriptedCore()
    all_steps_done = threading.Event()
    original = engine.step
    n = 50
    finished: list[str] = []

    def step() -> EngineCoreOutputs:
        outs = original()
        finished.extend(o.request_id for o in outs.outputs if o.finished)
        if len(finished) == 2:
            all_steps_done.set()
        return outs

    engine.step = step  # type: ignore[method-assign]
    client = front_end(engine)

    async def main() -> list[Any]:
        q1 = await client.add_request("a", [1], SamplingParams(max_tokens=n))
        await client.add_request("b", [2], SamplingParams(max_tokens=n // 2), out_queue=q1)
        # Block the loop thread: nothing below runs any callback until the wait returns.
        finished_while_blocked = all_steps_done.wait(timeout=60)
        assert finished_while_blocked, f"the engine stopped at step {engine.steps}"
        assert not engine.requests and engine.steps >= n  # all done with the loop blocked
        return [out async for out in client.stream(q1, ["a", "b"])]

    try:
        outs = asyncio.run(asyncio.wait_for(main(), timeout=90))
        a = [o.outputs[0].token_ids for o in outs if o.request_id == "a"]
        b = [o.outputs[0].token_ids for o in outs if o.request_id == "b"]
        assert a == [[i] for i in range(n)] and b == [[i] for i in range(n // 2)]
        assert client.num_pending == 0
    finally:
        client.shutdown()


def test_commands_after_shutdown_fail_instead_of_hanging() -> None:
    client = front_end(ScriptedCore())
    client.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        asyncio.run(asyncio.wait_for(client.add_request("a", [1], SamplingParams()), 10))
    with pytest.raises(EngineDeadError):
        client.submit(lambda e: None).result(timeout=10)
    assert not client.is_dead


@pytest.mark.parametrize("warmup", [True, False])
def test_bench_serve_warms_up_on_prompts_it_does_not_measure(
    monkeypatch: pytest.MonkeyPatch, warmup: bool
) -> None:
    """A warm-up on the measured prompts would let the server's prefix cache serve their
    prefill, and the level would report a time to first token no fresh request sees."""
    import asyncio

    import httpx

    from pagemill.server.bench import benchmark

    def models(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"data": [{"id": "m"}]})

    real_client = httpx.AsyncClient

    def client(*args: object, **kwargs: object) -> httpx.AsyncClient:
        return real_client(transport=httpx.MockTransport(models))

    calls: list[tuple[list[list[int]], int]] = []

    async def run_level(
        base_url: str, model: str, prompts: list[list[int]], output_len: int, *rest: object
    ) -> dict[str, object]:
        calls.append((prompts, output_len))
        return {
            "completed": len(prompts),
            "num_requests": len(prompts),
            "output_throughput": 1.0,
            "itl_over_decode_step": 1.0,
            "tpot_over_decode_step": 1.0,
            "server_cpu": None,
        }

    monkeypatch.setattr(httpx, "AsyncClient", client)
    monkeypatch.setattr(benchmark, "run_level", run_level)
    parser = build_parser()
    args = parser.parse_args(
        ["bench", "serve", "--concurrency", "4", "--num-prompts", "10", "--input-len", "8"]
        + ([] if warmup else ["--no-warmup"])
    )
    asyncio.run(benchmark._run_all(args, "http://127.0.0.1:1"))

    measured, out_len = calls[-1]
    assert out_len == args.output_len
    # The measured prompts are the ones the seed always drew.
    assert measured == benchmark.make_prompts(10, 8, args.token_low, args.token_high, args.seed)
    if warmup:
        assert len(calls) == 2
        warm, warm_len = calls[0]
        assert len(warm) == 4 and warm_len == 4
        assert not {tuple(p) for p in warm} & {tuple(p) for p in measured}
    else:
        assert len(calls) == 1
