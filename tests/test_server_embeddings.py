"""/v1/embeddings and prompt_logprobs through the official `openai` client, live on loopback.

The expected vectors are transformers' own: `AutoModel`'s last hidden state on the same
weights, pooled and normalized the way the server's defaults say (last token, L2); the
expected prompt logprobs a log_softmax over `AutoModelForCausalLM`'s logits.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import server_helpers
import torch
import torch.nn.functional as F

from pagemill.runtime import LLMEngine
from pagemill.server import AsyncEngine, ServerThread, build_app

MODEL = "tiny-embed"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("server-embed-llama")
    server_helpers.build_tiny_llama(folder, 256)
    return folder


@pytest.fixture(scope="module")
def url(model_dir: Path) -> Iterator[str]:
    kwargs = server_helpers.engine_kwargs(model_dir)
    kwargs["max_num_batched_tokens"] = 32  # long inputs are chunked
    client = AsyncEngine(LLMEngine(enforce_eager=True, **kwargs))
    with ServerThread(build_app(client, MODEL)) as base:
        yield base
    client.shutdown()


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> Any:
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    base = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    lm = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return base, lm, AutoTokenizer.from_pretrained(str(model_dir))


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=60, max_retries=0)


def _expected(base: Any, ids: list[int], dims: int | None = None) -> np.ndarray:
    with torch.no_grad():
        last = base(torch.tensor([ids])).last_hidden_state[0, -1]
    if dims is not None:
        last = last[:dims]
    return F.normalize(last, dim=-1).numpy()


def test_embeddings_float_base64_and_dimensions(url: str, hf: Any) -> None:
    base, _, tok = hf
    texts = ["hello world, hello server", "the quick brown fox jumps over the lazy dog " * 4]
    ids = [tok.encode(t) for t in texts]
    client = _client(url)
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    assert len(ids[1]) > 32  # chunked prefill
    for d, i in zip(floats.data, ids):
        np.testing.assert_allclose(d.embedding, _expected(base, i), atol=2e-5)
    # The SDK's default asks for base64 and decodes it. A second computation: its chunks
    # may share steps differently (fp32 sums in another order, a few ulps); the encoding
    # itself is exact (the raw base64 below is checked against transformers).
    default = client.embeddings.create(model=MODEL, input=texts)
    for d, f in zip(default.data, floats.data):
        np.testing.assert_allclose(d.embedding, f.embedding, atol=1e-6)
    raw = httpx.post(
        url + "/v1/embeddings", json={"input": ids[0], "encoding_format": "base64"}, timeout=60
    ).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, _expected(base, ids[0]), atol=2e-5)
    small = client.embeddings.create(model=MODEL, input=[ids[1]], dimensions=8)
    np.testing.assert_allclose(small.data[0].embedding, _expected(base, ids[1], 8), atol=2e-5)


def test_embeddings_refusals(url: str) -> None:
    client = _client(url)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.embeddings.create(model=MODEL, input=[list(range(1, 300))])
    resp = httpx.post(
        url + "/v1/embeddings",
        json={"input": [list(range(1, 300))], "truncate_prompt_tokens": 10},
        timeout=60,
    )
    assert resp.status_code == 200
    assert resp.json()["usage"]["prompt_tokens"] == 10
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model=MODEL, input="hello", dimensions=100_000)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MODEL, input=[])
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="hello")


def _check(entries: list[Any], ids: list[int], lm: Any, k: int) -> None:
    with torch.no_grad():
        ref = torch.log_softmax(lm(torch.tensor([ids])).logits[0], dim=-1)
    assert entries[0] is None and len(entries) == len(ids)
    for i in range(1, len(ids)):
        entry = entries[i]
        got = entry[str(ids[i])]
        assert got["logprob"] == pytest.approx(ref[i - 1, ids[i]].item(), abs=2e-5)
        rank = int((ref[i - 1] > ref[i - 1, ids[i]]).sum()) + 1
        assert got["rank"] == (rank if rank <= k else None)
        top = ref[i - 1].topk(k)
        for rank, (t, lp) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            assert entry[str(t)]["logprob"] == pytest.approx(lp, abs=2e-5)
            assert entry[str(t)]["rank"] == rank


def test_prompt_logprobs_completions_and_chat(url: str, hf: Any) -> None:
    _, lm, tok = hf
    client = _client(url)
    prompt = "continuous batching schedules every step " * 3
    ids = tok.encode(prompt)
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, extra_body={"prompt_logprobs": 2}
    )
    _check(out.choices[0].prompt_logprobs, ids, lm, 2)  # type: ignore[attr-defined]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello world"}],
        max_tokens=2,
        extra_body={"prompt_logprobs": 1},
    )
    entries = chat.prompt_logprobs  # type: ignore[attr-defined]
    assert entries[0] is None and len(entries) > 3
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert getattr(plain.choices[0], "prompt_logprobs", None) is None
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):  # as vLLM
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=1, stream=True, extra_body={"prompt_logprobs": 1}
        )
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 21}
        )


@pytest.mark.slow
def test_through_an_engine_process(model_dir: Path, hf: Any) -> None:
    """Pooling parameters, vectors and prompt logprobs cross the process boundary."""
    base, lm, tok = hf
    kwargs = server_helpers.engine_kwargs(model_dir)
    kwargs["max_num_batched_tokens"] = 32
    client = AsyncEngine.launch(enforce_eager=True, **kwargs)
    try:
        with ServerThread(build_app(client, MODEL)) as base_url:
            oa = _client(base_url)
            text = "streaming tokens to clients over server sent events " * 2
            ids = tok.encode(text)
            got = oa.embeddings.create(model=MODEL, input=text, dimensions=16)
            np.testing.assert_allclose(got.data[0].embedding, _expected(base, ids, 16), atol=2e-5)
            out = oa.completions.create(
                model=MODEL, prompt=text, max_tokens=1, extra_body={"prompt_logprobs": 1}
            )
            _check(out.choices[0].prompt_logprobs, ids, lm, 1)  # type: ignore[attr-defined]
    finally:
        client.shutdown()
