"""pagemill started with a vLLM command line (flags plus a --config YAML), driven by the
official `openai` client: vLLM's flags take effect, /metrics carries vLLM's names with
vLLM's labels and bucket edges, and `run-batch` answers an OpenAI batch file."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import BLOCK_SIZE, CoreDouble, build_tiny_llama, free_socket, front_end

from pagemill.server import cli

NAME = "tiny"
KEY = "sk-vllm-env"
ORIGIN = "https://app.example"
# vLLM's bucket edges (vllm/v1/metrics/loggers.py), copied from vLLM's source.
VLLM_TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
VLLM_TPOT_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
]  # fmt: skip
VLLM_LATENCY_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("vllm-dropin")
    build_tiny_llama(folder, max_len=512)
    return folder


def engine_yaml(folder: Path) -> str:
    # What a vLLM user keeps in --config, plus pagemill's CPU settings for this test.
    return (
        "device: cpu\n"
        "dtype: float32\n"
        f"block-size: {BLOCK_SIZE}\n"
        f"kv_cache_memory_bytes: {64 * BLOCK_SIZE * 2 * 2 * 2 * 16 * 4}\n"
        "max-num-batched-tokens: 512\n"
        "override-generation-config: {max_new_tokens: 3}\n"
        "engine-process: false\n"
        "engine-threads: 1\n"
        "served-model-name: [wrong-name]\n"  # the command line's name wins
    )


class Served:
    def __init__(self, url: str, thread: threading.Thread, codes: list[int]) -> None:
        self.url, self.thread, self.codes = url, thread, codes

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }


@pytest.fixture(scope="module")
def served(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    cfg = tmp_path_factory.mktemp("cfg") / "cfg.yaml"
    cfg.write_text(engine_yaml(model_dir))
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    # A vLLM command line (vLLM's docs' flags), then pagemill's own settings in the file.
    argv = [
        "serve",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        NAME,
        "--max-model-len",
        "256",
        "--gpu-memory-utilization",
        "0.9",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--trust-remote-code",
        "--enable-log-requests",
        "--max-log-len",
        "4",
        "--kv-cache-dtype",
        "auto",
        "--pipeline-parallel-size",
        "1",
        "-O0",
        "--max-logprobs",
        "2",
        "--allowed-origins",
        json.dumps([ORIGIN]),
        "--uvicorn-log-level",
        "warning",
        "--disable-log-stats",
        "--config",
        str(cfg),
    ]
    codes: list[int] = []
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_API_KEY", KEY)
    mp.delenv("PAGEMILL_API_KEY", raising=False)
    thread = threading.Thread(target=lambda: codes.append(cli.main(argv)), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert thread.is_alive(), f"serve exited with {codes}"
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.1)
    try:
        yield Served(url, thread, codes)
    finally:
        mp.undo()
        from pagemill.server.entrypoints import shutdown

        if shutdown.LAST_SERVER is not None:
            shutdown.LAST_SERVER.should_exit = True
        thread.join(60)


def wait_idle(served: Served) -> None:
    deadline = time.monotonic() + 30
    while served.metrics()[("vllm:num_requests_running", (("engine", "0"), ("model_name", NAME)))]:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_vllm_flags_take_effect(served: Served, caplog: pytest.LogCaptureFixture) -> None:
    # VLLM_API_KEY guards /v1 (no --api-key, no PAGEMILL_API_KEY).
    assert httpx.get(served.url + "/v1/models").status_code == 401
    models = served.client().models.list()
    assert [m.id for m in models.data] == [NAME]
    # --override-generation-config max_new_tokens: a request without max_tokens gets 3.
    with caplog.at_level(logging.INFO, logger="pagemill.requests"):
        r = served.client().completions.create(
            model=NAME, prompt="hello world", temperature=0, extra_body={"ignore_eos": True}
        )
    assert r.usage.completion_tokens == 3
    # --enable-log-requests with --max-log-len 4.
    logged = [rec.getMessage() for rec in caplog.records if rec.name == "pagemill.requests"]
    assert any("received request" in m and "'hell'" in m for m in logged), logged
    # --max-logprobs 2: 2 is served, 3 is a 400 naming the limit.
    ok = served.client().completions.create(model=NAME, prompt="hello", max_tokens=2, logprobs=2)
    assert ok.choices[0].logprobs is not None
    with pytest.raises(openai.BadRequestError) as exc:
        served.client().completions.create(model=NAME, prompt="hello", max_tokens=2, logprobs=3)
    assert "--max-logprobs 2" in exc.value.message
    with pytest.raises(openai.BadRequestError):
        served.client().chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": "hi"}],
            logprobs=True,
            top_logprobs=3,
        )


def test_cors(served: Served) -> None:
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    r = httpx.options(served.url + "/v1/completions", headers=preflight)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(
        served.url + "/v1/completions", headers={**preflight, "Origin": "https://evil.example"}
    )
    assert "access-control-allow-origin" not in other.headers
    r = httpx.get(
        served.url + "/v1/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN


def test_vllm_metric_names(served: Served) -> None:
    wait_idle(served)
    before = served.metrics()
    r = served.client().completions.create(
        model=NAME, prompt="the quick brown fox", max_tokens=5, extra_body={"ignore_eos": True}
    )
    wait_idle(served)
    after = served.metrics()
    vllm = (("engine", "0"), ("model_name", NAME))
    ours = (("model_name", NAME),)

    def delta(name: str, labels: tuple[tuple[str, str], ...]) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert delta("vllm:prompt_tokens_total", vllm) == r.usage.prompt_tokens
    assert delta("vllm:generation_tokens_total", vllm) == 5
    length = tuple(sorted((*vllm, ("finished_reason", "length"))))
    assert delta("vllm:request_success_total", length) == 1
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
    ):
        assert delta(f"vllm:{name}_count", vllm) == 1, name
    assert delta("vllm:inter_token_latency_seconds_count", vllm) == 4
    assert delta("vllm:time_per_output_token_seconds_count", vllm) == 4
    assert delta("vllm:prefix_cache_queries_total", vllm) >= r.usage.prompt_tokens - 1
    # Every vLLM figure equals pagemill's own.
    for (name, labels), value in after.items():
        if name.startswith("pagemill:") and not name.endswith("_created"):
            twin = name.replace("pagemill:", "vllm:", 1)
            if labels == ours or "finished_reason" in dict(labels):
                theirs = tuple(sorted((*labels, ("engine", "0"))))
                if (twin, theirs) in after:
                    assert after[(twin, theirs)] == value, name
    for gauge in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_hits_total",
    ):
        assert (gauge, vllm) in after, gauge
    assert after[("vllm:kv_cache_usage_perc", vllm)] == 0.0

    def edges(name: str) -> list[float]:
        return sorted(
            float(dict(labels)["le"])
            for (n, labels) in after
            if n == f"vllm:{name}_bucket" and dict(labels)["le"] != "+Inf"
        )

    assert edges("time_to_first_token_seconds") == VLLM_TTFT_BUCKETS
    assert edges("inter_token_latency_seconds") == VLLM_TPOT_BUCKETS
    assert edges("time_per_output_token_seconds") == VLLM_TPOT_BUCKETS
    assert edges("e2e_request_latency_seconds") == VLLM_LATENCY_BUCKETS
    assert edges("request_queue_time_seconds") == VLLM_LATENCY_BUCKETS


# ---------------------------------------------------------------- run-batch


def batch_line(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_run_batch(model_dir: Path, tmp_path: Path, served: Served) -> None:
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    completion = {"model": NAME, "prompt": "the quick brown", "max_tokens": 6, "temperature": 0}
    lines = [
        batch_line("chat-1", "/v1/chat/completions", {**chat, "temperature": 0}),
        "{not json",
        batch_line("completion-1", "/v1/completions", completion),
        batch_line("bad-url", "/v1/images/generations", {"model": NAME}),
        batch_line("bad-body", "/v1/completions", {**completion, "max_tokens": -1}),
        "",
        batch_line("other-model", "/v1/completions", {**completion, "model": "nope"}),
        batch_line("stream", "/v1/completions", {**completion, "stream": True}),
    ]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    cfg = tmp_path / "cfg.yaml"
    serve_only = ("engine-process: false\n", "engine-threads: 1\n")
    text = engine_yaml(model_dir)
    for line in serve_only:
        text = text.replace(line, "")
    cfg.write_text(text)
    code = cli.main(
        [
            "run-batch",
            "-i",
            str(source),
            "-o",
            str(target),
            "--model",
            str(model_dir),
            "--served-model-name",
            NAME,
            "--max-model-len",
            "256",
            "--config",
            str(cfg),
        ]
    )
    assert code == 0
    out = [json.loads(line) for line in target.read_text().splitlines()]
    assert [o["custom_id"] for o in out] == [
        "chat-1",
        None,
        "completion-1",
        "bad-url",
        "bad-body",
        "other-model",
        "stream",
    ]
    by_id = {o["custom_id"]: o for o in out}
    for o in out:
        assert set(o) == {"id", "custom_id", "response", "error"}
        assert set(o["response"]) == {"status_code", "request_id", "body"}
    ok_chat = ChatCompletion.model_validate(by_id["chat-1"]["response"]["body"])
    ok_completion = Completion.model_validate(by_id["completion-1"]["response"]["body"])
    assert by_id["chat-1"]["error"] is None and by_id["chat-1"]["response"]["status_code"] == 200
    # The same request through the running server gives the same greedy text.
    live = served.client().completions.create(**completion)
    assert ok_completion.choices[0].text == live.choices[0].text
    assert ok_completion.usage is not None and ok_completion.usage.completion_tokens <= 6
    live_chat = served.client().chat.completions.create(**{**chat, "temperature": 0})
    assert ok_chat.choices[0].message.content == live_chat.choices[0].message.content
    assert out[1]["error"]["code"] == "invalid_json"
    assert by_id["bad-url"]["error"]["code"] == "unsupported_url"
    assert by_id["bad-body"]["response"]["status_code"] == 400
    assert by_id["bad-body"]["error"]["message"]
    assert by_id["other-model"]["response"]["status_code"] == 404
    assert by_id["stream"]["response"]["status_code"] == 400


def test_run_batch_missing_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["run-batch", "-i", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "o")])
    assert code == 2
    assert "nope.jsonl" in capsys.readouterr().err


# ---------------------------------------------------------------- CORS off by default


class IdleCore(CoreDouble):
    """An engine core with nothing to do: enough for routes that do not generate."""

    def add_request(self, request: Any) -> None:
        pass

    def abort_requests(self, request_ids: Any) -> None:
        pass

    def has_unfinished_requests(self) -> bool:
        return False

    def step(self) -> Any:
        from pagemill.runtime.engine.protocol import EngineCoreOutputs

        return EngineCoreOutputs([])


@pytest.mark.parametrize("cors", [None, {"allow_origins": [ORIGIN]}])
def test_no_cors_headers_unless_asked(cors: dict[str, Any] | None) -> None:
    import asyncio

    from pagemill.server import build_app

    client = front_end(IdleCore())
    try:
        app = build_app(client, NAME, cors=cors)

        async def ask() -> tuple[httpx.Response, httpx.Response]:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                get = await http.get("/v1/models", headers={"Origin": ORIGIN})
                preflight = await http.options(
                    "/v1/models",
                    headers={"Origin": ORIGIN, "Access-Control-Request-Method": "GET"},
                )
                return get, preflight

        get, preflight = asyncio.run(ask())
    finally:
        client.shutdown()
    assert get.status_code == 200
    if cors is None:
        assert "access-control-allow-origin" not in get.headers
        assert "access-control-allow-origin" not in preflight.headers
        assert preflight.status_code == 405
    else:
        assert get.headers["access-control-allow-origin"] == ORIGIN
        assert preflight.status_code == 200
