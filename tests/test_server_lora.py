"""LoRA adapters behind the OpenAI API, with the official `openai` client against a live
server: the ``model`` field picks an adapter, answers equal peft's merged model's greedy
text, /v1/models lists adapters with their base as parent, unknown names are 404s in
OpenAI's shape, and adapters load and unload at run time."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import server_helpers
import torch

from pagemill.runtime import LLMEngine
from pagemill.server import ServerThread, build_app
from pagemill.server.entrypoints.openai.serving_lora import (
    parse_lora_modules,
    runtime_updating_allowed,
)

peft = pytest.importorskip("peft")

MODEL = "tiny"


def _adapter(base: torch.nn.Module, folder: Path, rank: int, alpha: int, seed: int) -> Any:
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
        init_lora_weights=False,
    )
    model = peft.get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    model.save_pretrained(str(folder))
    return model.merge_and_unload().eval()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    import transformers

    folder = tmp_path_factory.mktemp("lora-server-model")
    server_helpers.build_tiny_llama(folder, 256)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    paths, merged = {}, {}
    for i, (name, rank, alpha) in enumerate((("a1", 4, 8), ("a2", 8, 8))):
        paths[name] = tmp_path_factory.mktemp(f"lora-server-{name}")
        merged[name] = _adapter(base, paths[name], rank, alpha, seed=i)
    engine = LLMEngine(
        **server_helpers.engine_kwargs(folder), enable_lora=True, max_loras=2, max_lora_rank=8
    )
    app = build_app(
        engine, MODEL, lora_modules=[("a1", str(paths["a1"]))], allow_runtime_lora_updating=True
    )
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    with ServerThread(app) as url:
        yield dict(url=url, base=base, merged=merged, paths=paths, tok=tok)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=60, max_retries=0)


def _greedy_text(model: torch.nn.Module, tok: Any, prompt: list[int], n: int) -> list[int]:
    """Transformers' greedy token ids (compared as ids: a text cut inside a multi-byte
    character is held back by the server's detokenizer)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=[],
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def _complete(url: str, model: str, prompt: list[int]) -> list[int]:
    r = _client(url).completions.create(
        model=model,
        prompt=prompt,
        max_tokens=8,
        temperature=0.0,
        logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    logprobs = r.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    return [int(t.removeprefix("token_id:")) for t in logprobs.tokens]


def test_models_list_adapters_with_their_base_as_parent(live) -> None:
    cards = {m.id: m for m in _client(live["url"]).models.list().data}
    assert {MODEL, "a1"} <= set(cards)
    assert cards["a1"].model_extra["parent"] == MODEL
    assert cards["a1"].model_extra["root"] == str(live["paths"]["a1"])
    assert cards[MODEL].model_extra.get("parent") is None


def test_model_field_picks_the_adapter(live) -> None:
    prompt = [5, 17, 42, 9, 100, 33, 7]
    tok = live["tok"]
    want = _greedy_text(live["merged"]["a1"], tok, prompt, 8)
    assert want != _greedy_text(live["base"], tok, prompt, 8)  # the adapter matters here
    assert _complete(live["url"], "a1", prompt) == want
    assert _complete(live["url"], MODEL, prompt) == _greedy_text(live["base"], tok, prompt, 8)


def test_responses_name_the_adapter_that_answered(live) -> None:
    """As vLLM: a response's `model` is the adapter's name when the request named one."""
    client = _client(live["url"])
    for model in ("a1", MODEL):
        r = client.completions.create(model=model, prompt=[5, 17, 42], max_tokens=2)
        assert r.model == model
        c = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert c.model == model
        chunks = list(
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                stream=True,
            )
        )  # fmt: skip
        assert chunks and all(ch.model == model for ch in chunks)


def test_unknown_model_is_a_404_in_openais_shape(live) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        _complete(live["url"], "no-such-adapter", [1, 2, 3])
    body = exc.value.body
    assert isinstance(body, dict) and body["code"] == "model_not_found"
    assert "'a1'" in body["message"]


def test_adapters_load_and_unload_at_run_time(live) -> None:
    url, prompt = live["url"], [8, 3, 61, 12, 90]
    r = httpx.post(
        url + "/v1/load_lora_adapter",
        json={"lora_name": "a2", "lora_path": str(live["paths"]["a2"])},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert "a2" in {m.id for m in _client(url).models.list().data}
    assert _complete(url, "a2", prompt) == _greedy_text(
        live["merged"]["a2"], live["tok"], prompt, 8
    )
    again = httpx.post(
        url + "/v1/load_lora_adapter",
        json={"lora_name": "a2", "lora_path": str(live["paths"]["a2"])},
        timeout=30,
    )
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a2"}, timeout=30)
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        _complete(url, "a2", prompt)
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a2"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    bad = httpx.post(
        url + "/v1/load_lora_adapter",
        json={"lora_name": "bad", "lora_path": str(live["paths"]["a2"] / "missing")},
        timeout=30,
    )
    assert bad.status_code == 400 and "does not exist" in bad.json()["error"]["message"]


def test_runtime_updating_needs_the_flag_or_vllms_variable() -> None:
    assert not runtime_updating_allowed(False, {})
    assert runtime_updating_allowed(False, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    assert runtime_updating_allowed(True, {})


def test_lora_modules_take_vllms_two_forms() -> None:
    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}']) == [
        ("a", "/x"),
        ("b", "/y"),
    ]
    for bad in ("novalue", "=/x", '{"name": "b"}', "{oops"):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules([bad])
