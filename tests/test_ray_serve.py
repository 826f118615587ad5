"""pagemill on Ray Serve (`pagemill.server.ray_serve`): a local Ray, two engine replicas of a
tiny random Llama behind the OpenAI ingress, routed by `PagemillRequestRouter` (prefix).

A streamed chat through the `openai` client must arrive in pieces and equal the same
request answered whole; requests that share a long prompt must land on one replica (its
prefix-cache hits, read from the replicas themselves, cover the shared blocks).
Skipped, saying why, when Ray Serve is not installed (`pip install 'pagemill-server[ray]'`).
"""

from __future__ import annotations

import os
import socket

import pytest
from server_helpers import build_tiny_llama, engine_kwargs

serve = pytest.importorskip(
    "ray.serve", reason="Ray Serve is not installed (pip install 'pagemill-server[ray]')"
)
openai = pytest.importorskip("openai")

MODEL = "tiny"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ray_app(tmp_path_factory: pytest.TempPathFactory):
    import ray

    from pagemill.server.ray_serve import build_serve_app

    folder = tmp_path_factory.mktemp("ray-llama")
    build_tiny_llama(folder)
    kwargs = engine_kwargs(folder, num_blocks=64)
    model = kwargs.pop("model")
    port = _free_port()
    # A busy machine starts the raylet slowly; Ray's default 30 s wait is not always enough.
    os.environ.setdefault("RAY_raylet_start_wait_time_s", "180")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_serve_app(
            model,
            num_replicas=2,
            routing="prefix",
            served_model_name=MODEL,
            engine_threads=1,
            num_cpus=0.5,
            **kwargs,
        )
        serve.run(app, name="pagemill", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.mark.slow  # a local Ray and three Serve replicas start: about a minute
def test_two_replicas_stream_a_chat_and_route_by_prefix(ray_app: str) -> None:
    client = openai.OpenAI(base_url=ray_app + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "hello world, tell me a story"}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0
    )
    answer = whole.choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True
    )
    pieces, finish = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert len([p for p in pieces if p]) > 1  # streamed, not one block
    assert "".join(pieces) == answer
    assert finish == whole.choices[0].finish_reason == "length"

    # Four requests sharing 4 blocks of prompt: prefix routing keeps them on one replica,
    # whose prefix cache then serves the shared blocks to the three that follow.
    shared = list(range(20, 84))
    for tail in ([3], [4], [5], [6]):
        r = client.completions.create(
            model=MODEL, prompt=[*shared, *tail], max_tokens=2, temperature=0
        )
        assert r.choices[0].finish_reason == "length"
    from ray import serve as ray_serve

    from pagemill.server.ray_serve import routing_summary

    # Utility calls go to the least loaded replica, taking turns when both are idle.
    handle = ray_serve.get_deployment_handle("PagemillEngine", app_name="pagemill")
    by_replica = {}
    for _ in range(6):
        summary = handle.call.remote(routing_summary).result(timeout_s=60)
        by_replica[summary["pid"]] = summary
    assert len(by_replica) == 2
    hits = sorted(s["prefix_cache_hits"] for s in by_replica.values())
    assert hits[-1] >= 3 * 64 and hits[0] < 64, hits
