"""The server against the official `openai` client, live on 127.0.0.1, real engine.

The engine serves a tiny random-weight Llama (saved with a trained byte-level BPE tokenizer
and a chat template), so every request runs the real scheduler, KV pool, kernels and
detokenizer. Expected outputs come from a second engine on the same weights, driven
directly: the HTTP layer must add and lose nothing. The KV pool is kept small so that the
concurrency test usually goes through preemption too (7 preemptions in a typical run).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import server_helpers
from prometheus_client.parser import text_string_to_metric_families

from pagemill.runtime import LLMEngine, SamplingParams
from pagemill.runtime.sampling_params import RequestOutputKind
from pagemill.server import AsyncEngine, EngineMetrics, ServerThread, build_app

API_KEY = "sk-test-key"
MODEL = "tiny-llama"
MAX_MODEL_LEN = 256
BLOCK_SIZE = 16
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello server, hello paged attention",
    "continuous batching schedules every step, not every batch",
    "streaming tokens to clients over server sent events",
] * 4


def build_tiny_llama(folder: Path) -> None:
    """A 2-layer random Llama plus a trained BPE tokenizer, saved like a real checkpoint."""
    server_helpers.build_tiny_llama(
        folder,
        MAX_MODEL_LEN,
        corpus=CORPUS,
        vocab_size=320,
        extra_special=(),
        chat_template=CHAT_TEMPLATE,
    )


def kv_bytes(num_blocks: int) -> int:
    # 2 (K and V) x 2 layers x 2 KV heads x head_dim 16 x 4 bytes (fp32 on CPU) per token.
    return num_blocks * BLOCK_SIZE * 2 * 2 * 2 * 16 * 4


def make_engine(folder: Path, num_blocks: int = 48) -> LLMEngine:
    return LLMEngine(
        model=str(folder),
        device="cpu",
        dtype="float32",
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=kv_bytes(num_blocks),
        max_num_batched_tokens=512,
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("server-tiny-llama")
    build_tiny_llama(folder)
    return folder


class Live:
    """One running server and handles on its insides (for pool checks)."""

    def __init__(self, url: str, client: AsyncEngine, engine: LLMEngine) -> None:
        self.url = url
        self.client = client
        self.engine = engine

    def openai(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.url + "/v1", api_key=API_KEY, timeout=60, max_retries=0, **kw
        )

    def post(
        self,
        path: str,
        body: Any = None,
        *,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 60,
    ) -> httpx.Response:
        h = {"Authorization": f"Bearer {API_KEY}", **(headers or {})}
        if content is not None:
            h.setdefault("Content-Type", "application/json")
            return httpx.post(self.url + path, content=content, headers=h, timeout=timeout)
        return httpx.post(self.url + path, json=body, headers=h, timeout=timeout)

    def stats(self) -> Any:
        return self.client.submit(lambda e: e.get_stats()).result(timeout=30)

    def wait_idle(self, timeout: float = 30.0) -> Any:
        """Bounded wait until the engine holds no request and no block."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if s.num_running == 0 and s.num_waiting == 0 and s.kv_cache_usage == 0.0:
                return s
            if time.monotonic() > deadline:
                return s
            time.sleep(0.05)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = tuple(
                    sorted((k, v) for k, v in sample.labels.items() if k != "model_name")
                )
                out[(sample.name, labels)] = sample.value
        return out


def wait_for(condition: Any, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture(scope="module")
def live(model_dir: Path) -> Iterator[Live]:
    engine = make_engine(model_dir)
    client = AsyncEngine(engine, observer=EngineMetrics(MODEL))
    app = build_app(client, MODEL, api_key=API_KEY, max_body_bytes=64 * 1024)
    with ServerThread(app) as url:
        yield Live(url, client, engine)
    client.shutdown()


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> LLMEngine:
    """A second engine on the same weights, driven directly, for expected outputs."""
    return make_engine(model_dir, num_blocks=64)


def run_reference(engine: LLMEngine, prompt: str | list[int], **params: Any) -> Any:
    params.setdefault("output_kind", RequestOutputKind.FINAL_ONLY)
    engine.add_request(f"ref-{time.monotonic_ns()}", prompt, SamplingParams(**params))
    final = None
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final = out
    assert final is not None
    return final


def greedy(**extra: Any) -> dict[str, Any]:
    return {"temperature": 0.0, **extra}


# ---------------------------------------------------------------- basics


def test_health_version_models(live: Live) -> None:
    assert httpx.get(live.url + "/health").status_code == 200
    assert httpx.get(live.url + "/version").json()["version"]
    models = live.openai().models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_matches_engine(live: Live, reference: LLMEngine) -> None:
    prompt = "hello world, the quick"
    ref = run_reference(reference, prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
    r = live.openai().completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, extra_body={"ignore_eos": True}, **greedy()
    )
    assert r.choices[0].text == ref.outputs[0].text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(reference.encode(prompt))
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_completion_token_prompt_and_batch(live: Live, reference: LLMEngine) -> None:
    ids = reference.encode("streaming tokens")
    other = reference.encode("hello")
    r = live.openai().completions.create(
        model=MODEL, prompt=[ids, other], max_tokens=5, extra_body={"ignore_eos": True}, **greedy()
    )
    assert [c.index for c in r.choices] == [0, 1]
    ref = run_reference(reference, ids, max_tokens=5, temperature=0.0, ignore_eos=True)
    assert r.choices[0].text == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ids) + len(other)
    assert r.usage.completion_tokens == 10


def test_chat_matches_engine(live: Live, reference: LLMEngine) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello server"},
    ]
    prompt_ids = reference.apply_chat_template(messages)
    ref = run_reference(reference, prompt_ids, max_tokens=10, temperature=0.0, ignore_eos=True)
    r = live.openai().chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=10,
        extra_body={"ignore_eos": True},
        **greedy(),
    )
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == 10


def test_streaming_completion_equals_whole(live: Live) -> None:
    c = live.openai()
    kw = dict(
        model=MODEL,
        prompt="continuous batching",
        max_tokens=20,
        extra_body={"ignore_eos": True},
        **greedy(),
    )
    whole = c.completions.create(**kw)
    chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text_chunks = [ch for ch in chunks if ch.choices]
    assert "".join(ch.choices[0].text for ch in text_chunks) == whole.choices[0].text
    assert [ch.choices[0].finish_reason for ch in text_chunks][-1] == "length"
    assert all(ch.choices[0].finish_reason is None for ch in text_chunks[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, 20)


def test_streaming_raw_sse_ends_with_done(live: Live) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": True}
    lines = []
    with httpx.stream(
        "POST",
        live.url + "/v1/completions",
        json=body,
        timeout=60,
        headers={"Authorization": f"Bearer {API_KEY}"},
    ) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert all(
        "usage" not in json.loads(line[6:]) or json.loads(line[6:])["usage"] is None
        for line in lines[:-1]
    )


def test_streaming_chat(live: Live) -> None:
    c = live.openai()
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "hello world"}],
        max_tokens=15,
        extra_body={"ignore_eos": True},
        **greedy(),
    )
    whole = c.chat.completions.create(**kw)
    chunks = list(
        c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert content == whole.choices[0].message.content
    finals = [
        ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason
    ]
    assert finals == ["length"]
    assert chunks[-1].usage.completion_tokens == 15
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_n_greater_than_one(live: Live) -> None:
    c = live.openai()
    r = c.completions.create(
        model=MODEL,
        prompt="the lazy dog",
        max_tokens=8,
        n=3,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 24
    assert len({ch.text for ch in r.choices}) > 1  # seeded copies differ (seed + index)
    again = c.completions.create(
        model=MODEL,
        prompt="the lazy dog",
        max_tokens=8,
        n=3,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert [ch.text for ch in again.choices] == [ch.text for ch in r.choices]

    chunks = list(
        c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            n=2,
            temperature=1.0,
            seed=3,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    text = {0: "", 1: ""}
    finished = {0: 0, 1: 0}
    for ch in chunks:
        for choice in ch.choices:
            text[choice.index] += choice.delta.content or ""
            finished[choice.index] += choice.finish_reason is not None
    assert finished == {0: 1, 1: 1}
    whole = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        n=2,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert text == {ch.index: ch.message.content for ch in whole.choices}


def test_stop_strings(live: Live) -> None:
    c = live.openai()
    kw = dict(model=MODEL, prompt="hello paged", extra_body={"ignore_eos": True}, **greedy())
    full = c.completions.create(max_tokens=40, **kw).choices[0].text
    # A 2-character stop string that first occurs some way into the text.
    k = next(
        i
        for i in range(3, len(full) - 2)
        if "\ufffd" not in full[i : i + 2] and full.find(full[i : i + 2]) == i
    )
    stop = full[k : k + 2]
    r = c.completions.create(max_tokens=40, stop=[stop, "never-seen-stop"], **kw)
    assert r.choices[0].text == full[:k]
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(max_tokens=40, stop=stop, stream=True, **kw)
    )
    assert streamed == full[:k]


def test_stream_chunks_are_the_engines_deltas(live: Live, reference: LLMEngine) -> None:
    """What the client receives is exactly what the engine released, step by step.

    A stop string that never occurs must not delay any text: the server used to hold back
    its length - 1 characters until the end, on top of the detokenizer's own hold-back.
    """
    prompt = "hello paged attention"
    stop = "\u2603\u2603\u2603\u2603"
    engine_deltas = []
    reference.add_request(
        "deltas", prompt, SamplingParams(max_tokens=12, stop=stop, ignore_eos=True, **greedy())
    )
    while reference.has_unfinished_requests():
        engine_deltas += [o.outputs[0].text for o in reference.step() if o.request_id == "deltas"]
    chunks = list(
        live.openai().completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=12,
            stop=stop,
            stream=True,
            extra_body={"ignore_eos": True},
            **greedy(),
        )
    )
    streamed = [ch.choices[0].text for ch in chunks]
    assert [t for t in streamed if t] == [t for t in engine_deltas if t]
    assert chunks[-1].choices[0].finish_reason == "length"
    # Nothing was waiting for the end: the last chunk holds only the last token's text.
    assert len(streamed[-1]) <= max(len(t) for t in engine_deltas)


def test_logprobs(live: Live) -> None:
    c = live.openai()
    r = c.completions.create(
        model=MODEL,
        prompt="hello",
        max_tokens=5,
        logprobs=2,
        extra_body={"ignore_eos": True},
        **greedy(),
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    # Greedy: the sampled token is the most likely one.
    assert all(
        abs(max(top.values()) - x) < 1e-4 for top, x in zip(lp.top_logprobs, lp.token_logprobs)
    )
    chat = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
        **greedy(),
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)


def test_vllm_extras_accepted(live: Live) -> None:
    r = live.openai().completions.create(
        model=MODEL,
        prompt="hello world",
        max_tokens=6,
        top_p=0.9,
        seed=1,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        user="u1",
        extra_body={
            "top_k": 5,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "min_tokens": 6,
            "priority": 0,
            "cache_salt": "tenant-a",
            "stop_token_ids": [0],
        },
    )
    assert r.usage.completion_tokens == 6  # min_tokens holds off EOS and stop tokens


# ---------------------------------------------------------------- bad input

TOO_LONG = list(range(1, MAX_MODEL_LEN + 1))

BAD_REQUESTS: list[tuple[str, str, Any, int, str | None]] = [
    # (name, path, body (bytes = raw), status, param)
    ("malformed json", "/v1/completions", b'{"model": "x", "prompt": ', 400, None),
    ("body not an object", "/v1/completions", b"[1, 2, 3]", 400, None),
    ("missing prompt", "/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("max_tokens 0", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (
        "temperature string",
        "/v1/completions",
        {"prompt": "hi", "temperature": "hot"},
        400,
        "temperature",
    ),
    (
        "temperature negative",
        "/v1/completions",
        {"prompt": "hi", "temperature": -1},
        400,
        "temperature",
    ),
    ("top_p zero", "/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("n zero", "/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("logprobs too many", "/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("empty prompt list", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("token id past vocab", "/v1/completions", {"prompt": [10**6]}, 400, "prompt"),
    ("negative token id", "/v1/completions", {"prompt": [-3, 4]}, 400, "prompt"),
    ("prompt over context", "/v1/completions", {"prompt": TOO_LONG}, 400, "prompt"),
    (
        "max_tokens past context",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": MAX_MODEL_LEN},
        400,
        "max_tokens",
    ),
    (
        "min_tokens over max_tokens",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 3, "min_tokens": 5},
        400,
        "min_tokens",
    ),
    (
        "too many stops",
        "/v1/completions",
        {"prompt": "hi", "stop": [f"s{i}" for i in range(20)]},
        400,
        None,
    ),
    (
        "stream_options without stream",
        "/v1/completions",
        {"prompt": "hi", "stream_options": {"include_usage": True}},
        400,
        None,
    ),
    (
        "echo with logprobs",
        "/v1/completions",
        {"prompt": "hi", "echo": True, "logprobs": 1},
        400,
        None,
    ),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    (
        "bad role",
        "/v1/chat/completions",
        {"messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages",
    ),
    (
        "top_logprobs without logprobs",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        None,
    ),
    (
        "chat max_tokens past context",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10**5},
        400,
        "max_tokens",
    ),
    (
        "tool without a function",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        400,
        None,
    ),
    (
        "chat unknown model",
        "/v1/chat/completions",
        {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
        404,
        "model",
    ),
    ("body too large", "/v1/completions", {"prompt": "x" * (100 * 1024)}, 413, None),
    ("unknown route", "/v1/no-such-route", {"input": "x"}, 404, None),
]


@pytest.mark.parametrize(
    ("name", "path", "body", "status", "param"), BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS]
)
def test_bad_request_gets_openai_error(
    live: Live, name: str, path: str, body: Any, status: int, param: str | None
) -> None:
    for stream in (False, True):
        if isinstance(body, dict) and stream and "stream_options" not in body:
            payload: Any = {**body, "stream": True}
        elif stream:
            continue
        else:
            payload = body
        resp = (
            live.post(path, content=payload)
            if isinstance(payload, bytes)
            else live.post(path, payload)
        )
        assert resp.status_code == status, resp.text
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["message"], str) and error["message"]
        if param is not None:
            assert error["param"] == param, error
    # ...and the server still serves.
    ok = live.post("/v1/completions", {"prompt": "hello", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_chunked_body_over_limit(live: Live) -> None:
    """A body sent without Content-Length is counted as it arrives."""

    def body() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"x" * 1024
        yield b'"}'

    resp = httpx.post(
        live.url + "/v1/completions",
        content=body(),
        timeout=60,
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    assert resp.status_code == 413
    assert "exceeds" in resp.json()["error"]["message"]


def test_api_key_required(live: Live) -> None:
    body = {"prompt": "hi", "max_tokens": 2}
    missing = httpx.post(live.url + "/v1/completions", json=body, timeout=30)
    wrong = httpx.post(
        live.url + "/v1/completions",
        json=body,
        timeout=30,
        headers={"Authorization": "Bearer nope"},
    )
    for resp in (missing, wrong):
        assert resp.status_code == 401
        assert resp.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=live.url + "/v1", api_key="bad", max_retries=0).models.list()
    assert httpx.get(live.url + "/health").status_code == 200  # probes stay open
    with pytest.raises(openai.BadRequestError):
        live.openai().completions.create(model=MODEL, prompt="hi", max_tokens=10**6)
    with pytest.raises(openai.NotFoundError):
        live.openai().completions.create(model="other", prompt="hi")


# ---------------------------------------------------------------- lifecycle


def slow_steps(engine: LLMEngine, delay: float = 0.02) -> list[int]:
    """Make each engine step take at least `delay` (the tiny model outruns any client).

    Returns a one-element list counting steps; undo with `del engine.engine_core.step`.
    """
    core = engine.engine_core
    original = core.step
    count = [0]

    def step() -> Any:
        count[0] += 1
        time.sleep(delay)
        return original()

    core.step = step  # type: ignore[method-assign]
    return count


def test_disconnect_mid_stream_frees_blocks(live: Live) -> None:
    before = live.metrics()
    abort_key = ("pagemill:request_success_total", (("finished_reason", "abort"),))
    body = {
        "model": MODEL,
        "prompt": "hello world",
        "max_tokens": MAX_MODEL_LEN - 10,
        "ignore_eos": True,
        "stream": True,
    }
    steps = slow_steps(live.engine)
    try:
        with httpx.stream(
            "POST",
            live.url + "/v1/completions",
            json=body,
            timeout=60,
            headers={"Authorization": f"Bearer {API_KEY}"},
        ) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()  # kept: a dropped line iterator closes the connection
            assert next(line for line in lines if line.startswith("data: {"))
            assert live.client.num_pending == 1
        # Closed: the server must notice at once, not at the next token it tries to send...
        assert wait_for(lambda: live.client.num_pending == 0), "disconnect not noticed"
        steps_at_disconnect = steps[0]
        # ...and the engine must drop the request and free its blocks within a step.
        stats = live.wait_idle()
        assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
        # One step may have been running; the abort's final report takes one more call.
        assert steps[0] - steps_at_disconnect <= 2
    finally:
        del live.engine.engine_core.step
    assert wait_for(
        lambda: live.metrics().get(abort_key, 0) == before.get(abort_key, 0) + 1, timeout=10
    ), "the disconnected request was not aborted"


def test_disconnect_while_waiting_for_whole_answer(live: Live) -> None:
    """A non-streamed request is aborted too when its client gives up."""
    before = live.metrics()
    abort_key = ("pagemill:request_success_total", (("finished_reason", "abort"),))
    body = {
        "model": MODEL,
        "prompt": "hello world",
        "max_tokens": MAX_MODEL_LEN - 10,
        "ignore_eos": True,
    }
    slow_steps(live.engine)
    try:
        with pytest.raises(httpx.ReadTimeout):
            live.post("/v1/completions", body, timeout=1.0)
        assert wait_for(lambda: live.client.num_pending == 0), "disconnect not noticed"
        stats = live.wait_idle()
        assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    finally:
        del live.engine.engine_core.step
    assert wait_for(
        lambda: live.metrics().get(abort_key, 0) == before.get(abort_key, 0) + 1, timeout=10
    ), "the abandoned request was not aborted"


def test_32_concurrent_streams_complete_and_pool_empties(live: Live) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, str | None, int]:
        stream = await client.completions.create(
            model=MODEL,
            prompt=f"request {i}: the quick brown fox",
            max_tokens=16 + i % 5,
            stream=True,
            stream_options={"include_usage": True},
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        finish, usage = None, 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return i, finish, usage

    async def main() -> list[tuple[int, str | None, int]]:
        client = openai.AsyncOpenAI(
            base_url=live.url + "/v1", api_key=API_KEY, timeout=120, max_retries=0
        )
        try:
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, i) for i in range(32))), timeout=150
            )
        finally:
            await client.close()

    results = asyncio.run(main())
    assert [r[0] for r in results] == list(range(32))
    assert all(finish == "length" for _, finish, _ in results)
    assert [usage for _, _, usage in results] == [16 + i % 5 for i in range(32)]
    stats = live.wait_idle()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert live.client.num_pending == 0


def test_metrics_reflect_traffic(live: Live, reference: LLMEngine) -> None:
    before = live.metrics()
    prompt = "hello server"
    r = live.openai().completions.create(
        model=MODEL, prompt=prompt, max_tokens=7, extra_body={"ignore_eos": True}, **greedy()
    )
    live.wait_idle()
    after = live.metrics()

    def delta(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    n_prompt = len(reference.encode(prompt))
    assert r.usage.prompt_tokens == n_prompt
    assert delta("pagemill:prompt_tokens_total") == n_prompt
    assert delta("pagemill:generation_tokens_total") == 7
    assert delta("pagemill:request_success_total", (("finished_reason", "length"),)) == 1
    for hist in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
    ):
        assert delta(f"pagemill:{hist}_count") == 1, hist
    assert delta("pagemill:inter_token_latency_seconds_count") == 6
    assert delta("pagemill:prefix_cache_queries_total") >= n_prompt - 1
    assert after[("pagemill:num_requests_running", ())] == 0
    assert after[("pagemill:kv_cache_usage_perc", ())] == 0
    for name in (
        "pagemill:num_requests_waiting",
        "pagemill:num_preemptions_total",
        "pagemill:prefix_cache_hits_total",
    ):
        assert (name, ()) in after, name


def test_queue_limit_and_dead_engine(model_dir: Path) -> None:
    """A second server: max one pending request (429), then an engine that fails (503)."""
    engine = make_engine(model_dir, num_blocks=32)
    slow_steps(engine)
    client = AsyncEngine(engine, max_pending=1)
    app = build_app(client, MODEL)
    body = {
        "prompt": "hello world",
        "max_tokens": MAX_MODEL_LEN - 10,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        with (
            ServerThread(app) as url,
            httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as first,
        ):
            assert first.status_code == 200
            lines = first.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            busy = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
            assert busy.status_code == 429
            assert int(busy.headers["Retry-After"]) >= 1
            assert busy.json()["error"]["type"] == "rate_limit_error"

            def explode() -> None:
                raise RuntimeError("simulated device failure")

            engine.engine_core.step = explode  # the next step of the core thread raises
            rest = "\n".join(lines)
            assert '"code": 503' in rest or '"code":503' in rest
            assert rest.rstrip().endswith("data: [DONE]")
            assert httpx.get(url + "/health", timeout=30).status_code == 503
            after = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
            assert after.status_code == 503
            assert after.json()["error"]["message"]
    finally:
        client.shutdown()
