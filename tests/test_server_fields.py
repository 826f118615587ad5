"""vLLM's request fields through the real `openai` SDK: each one honoured (shown by its
effect on the output) or refused with a 400 that names it; unknown fields warned once."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import server_helpers
from transformers import AutoTokenizer

from pagemill.runtime import LLMEngine
from pagemill.server import AsyncEngine, EngineMetrics, ServerThread, build_app
from pagemill.server.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagemill.server.entrypoints.openai.request_fields import FIELDS, fields_for

MODEL = "tiny-fields"
MAX_MODEL_LEN = 256
BLOCK_SIZE = 16
# Shows the template variables the fields set: enable_thinking (chat_template_kwargs) and
# reasoning_effort.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}no thinking. {% endif %}"
    "{% if reasoning_effort is defined %}effort {{ reasoning_effort }}. {% endif %}"
    "{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello server, hello paged attention",
    "no thinking effort low high yes red blue",
] * 4
USER = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("fields-tiny-llama")
    server_helpers.build_tiny_llama(
        folder,
        MAX_MODEL_LEN,
        corpus=CORPUS,
        vocab_size=300,
        extra_special=(),
        chat_template=CHAT_TEMPLATE,
    )
    return folder


class Live:
    def __init__(self, url: str, folder: Path) -> None:
        self.url = url
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", timeout=60, max_retries=0)

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=60)


@pytest.fixture(scope="module")
def live(model_dir: Path) -> Iterator[Live]:
    engine = LLMEngine(
        model=str(model_dir),
        device="cpu",
        dtype="float32",
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=64 * BLOCK_SIZE * 2 * 2 * 2 * 16 * 4,
        max_num_batched_tokens=512,
    )
    client = AsyncEngine(engine, observer=EngineMetrics(MODEL))
    app = build_app(client, MODEL)
    with ServerThread(app) as url:
        yield Live(url, model_dir)
    client.shutdown()


def complete(live: Live, prompt: Any, **kw: Any) -> Any:
    kw.setdefault("max_tokens", 8)
    return live.openai().completions.create(model=MODEL, prompt=prompt, temperature=0.0, **kw)


def chat(live: Live, messages: Any = USER, **kw: Any) -> Any:
    kw.setdefault("max_tokens", 8)
    return live.openai().chat.completions.create(
        model=MODEL, messages=messages, temperature=0.0, **kw
    )


# ---------------------------------------------------------------- the table


@pytest.mark.parametrize(
    ("endpoint", "model"), [("chat", ChatCompletionRequest), ("completion", CompletionRequest)]
)
def test_every_listed_field_is_declared(endpoint: Any, model: Any) -> None:
    """A listed field the model did not declare would be dropped without a word."""
    for name, f in fields_for(endpoint).items():
        if f.status == "elsewhere":
            continue
        assert name in model.model_fields, name


def _body(endpoint: str, **extra: Any) -> tuple[str, dict[str, Any]]:
    if endpoint == "chat":
        return "/v1/chat/completions", {"messages": USER, "max_tokens": 2, **extra}
    return "/v1/completions", {"prompt": "hello", "max_tokens": 2, **extra}


REFUSED = [
    (endpoint, name)
    for endpoint in ("chat", "completion")
    for name, f in fields_for(endpoint).items()  # type: ignore[arg-type]
    if f.status == "refused"
]


@pytest.mark.parametrize(("endpoint", "name"), REFUSED, ids=[f"{e}-{n}" for e, n in REFUSED])
def test_refused_fields_are_a_400_naming_them(live: Live, endpoint: str, name: str) -> None:
    f = FIELDS[name]
    path, body = _body(endpoint, **{name: f.example})
    r = live.post(path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == name and name in error["message"]
    if f.default is not None:  # the default value is always fine
        path, body = _body(endpoint, **{name: f.default})
        assert live.post(path, body).status_code == 200


def test_unknown_field_warns_once(live: Live, caplog: pytest.LogCaptureFixture) -> None:
    name = f"not_a_field_{time.monotonic_ns()}"
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            r = complete(live, "hello", max_tokens=2, extra_body={name: 1})
            assert r.choices[0].text is not None
            chat(live, max_tokens=2, extra_body={name: {"x": 1}})
            stream = live.openai().completions.create(
                model=MODEL,
                prompt="hello",
                max_tokens=2,
                stream=True,
                stream_options={name: True},  # type: ignore[typeddict-unknown-key]
            )
            assert [ch for ch in stream]
    assert sum(f"'{name}'" in rec.getMessage() for rec in caplog.records) == 1
    assert sum(f"'stream_options.{name}'" in rec.getMessage() for rec in caplog.records) == 1


# ---------------------------------------------------------------- structured output aliases


def test_guided_choice(live: Live) -> None:
    choices = ["red", "blue", "hello world"]
    for seed in range(3):
        r = live.openai().completions.create(
            model=MODEL,
            prompt="the",
            max_tokens=12,
            temperature=1.0,
            seed=seed,
            extra_body={"guided_choice": choices},
        )
        assert r.choices[0].text in choices
    c = chat(live, max_tokens=12, extra_body={"guided_choice": choices})
    assert c.choices[0].message.content in choices


def test_guided_regex_grammar_json(live: Live) -> None:
    r = complete(live, "the", max_tokens=12, extra_body={"guided_regex": "(yes|no) (red|blue)"})
    assert re.fullmatch("(yes|no) (red|blue)", r.choices[0].text)
    r = complete(live, "the", max_tokens=12, extra_body={"guided_grammar": 'root ::= "ab" | "cd"'})
    assert r.choices[0].text in ("ab", "cd")
    schema = {"type": "string", "enum": ["red", "blue"]}
    c = chat(live, max_tokens=12, extra_body={"guided_json": schema})
    assert json.loads(c.choices[0].message.content or "") in ("red", "blue")


def test_guided_conflicts_and_backend(live: Live) -> None:
    both = {"guided_regex": "a", "guided_choice": ["a"]}
    r = live.post("/v1/completions", {"prompt": "x", **both})
    assert r.status_code == 400 and r.json()["error"]["param"] in both
    r = live.post(
        "/v1/completions",
        {"prompt": "x", "guided_regex": "a", "structured_outputs": {"choice": ["a"]}},
    )
    assert r.status_code == 400
    r = live.post(
        "/v1/completions",
        {"prompt": "x", "guided_choice": ["a"], "guided_decoding_backend": "outlines"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_decoding_backend"
    ok = complete(
        live,
        "x",
        max_tokens=4,
        extra_body={"guided_choice": ["ab"], "guided_decoding_backend": "xgrammar"},
    )
    assert ok.choices[0].text == "ab"


# ---------------------------------------------------------------- sampler fields


def test_allowed_token_ids(live: Live) -> None:
    tok = live.tokenizer
    allowed = tok.convert_tokens_to_ids(["x", "y"])
    assert all(isinstance(t, int) for t in allowed)
    r = complete(live, "hello", max_tokens=10, extra_body={"allowed_token_ids": allowed})
    # EOS is not allowed either: the output runs to max_tokens, all of it x and y.
    assert r.usage.completion_tokens == 10
    assert set(r.choices[0].text) <= {"x", "y"}
    r = live.post("/v1/completions", {"prompt": "hi", "allowed_token_ids": [10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids"


def test_bad_words(live: Live) -> None:
    free = complete(live, "hello world", max_tokens=12, logprobs=0, extra_body={"ignore_eos": True})
    tokens = free.choices[0].logprobs.tokens
    word = next(t.strip() for t in tokens if t.strip())
    banned = complete(
        live,
        "hello world",
        max_tokens=12,
        logprobs=0,
        extra_body={"ignore_eos": True, "bad_words": [word]},
    )
    out = banned.choices[0].logprobs.tokens
    assert out != tokens
    ids = {tuple(live.tokenizer.encode(w, add_special_tokens=False)) for w in (word, " " + word)}
    single = {i[0] for i in ids if len(i) == 1}
    got = [live.tokenizer.convert_tokens_to_ids(live.tokenizer.tokenize(t)) for t in out]
    assert not any(len(g) == 1 and g[0] in single for g in got)


def test_truncate_prompt_tokens(live: Live) -> None:
    ids = live.tokenizer.encode(" ".join(CORPUS[:3]))
    k = 7
    r = complete(live, ids, extra_body={"truncate_prompt_tokens": k})
    assert r.usage.prompt_tokens == k
    tail = complete(live, ids[-k:])
    assert r.choices[0].text == tail.choices[0].text
    c = chat(live, extra_body={"truncate_prompt_tokens": k})
    assert c.usage.prompt_tokens == k


# ---------------------------------------------------------------- chat template fields


def test_chat_template_kwargs_and_reasoning_effort(live: Live) -> None:
    plain = chat(live, max_tokens=1).usage.prompt_tokens
    off = chat(live, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    on = chat(live, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    expected = len(live.tokenizer.encode("no thinking. ", add_special_tokens=False))
    assert off.usage.prompt_tokens == plain + expected
    assert on.usage.prompt_tokens == plain
    effort = chat(live, max_tokens=1, extra_body={"reasoning_effort": "low"})
    assert effort.usage.prompt_tokens == plain + len(
        live.tokenizer.encode("effort low. ", add_special_tokens=False)
    )
    r = live.post(
        "/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"tokenize": True}}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_continue_final_message_and_echo(live: Live) -> None:
    prefill = "the quick brown"
    messages = [*USER, {"role": "assistant", "content": prefill}]
    c = chat(live, messages, max_tokens=6, extra_body={"continue_final_message": True})
    # The same prompt written out: the template's text, cut after the final message.
    raw = complete(live, f"<|user|>hello world\n<|assistant|>{prefill}", max_tokens=6)
    assert c.choices[0].message.content == raw.choices[0].text
    assert c.usage.prompt_tokens == raw.usage.prompt_tokens
    echoed = chat(
        live, messages, max_tokens=6, extra_body={"continue_final_message": True, "echo": True}
    )
    assert echoed.choices[0].message.content == prefill + raw.choices[0].text
    both = live.post(
        "/v1/chat/completions",
        {"messages": messages, "continue_final_message": True, "add_generation_prompt": True},
    )
    assert both.status_code == 400


def test_completion_echo(live: Live) -> None:
    plain = complete(live, "hello world")
    r = complete(live, "hello world", echo=True)
    assert r.choices[0].text == "hello world" + plain.choices[0].text
    stream = live.openai().completions.create(
        model=MODEL, prompt="hello world", temperature=0.0, max_tokens=8, echo=True, stream=True
    )
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == r.choices[0].text
    ids = live.tokenizer.encode("hello world")
    r = complete(live, ids, echo=True)
    assert r.choices[0].text.startswith(live.tokenizer.decode(ids))


# ---------------------------------------------------------------- usage


def test_cached_tokens_on_a_repeated_prompt(live: Live) -> None:
    long = " ".join(CORPUS[:4]) + f" {time.monotonic_ns()}"
    first = complete(live, long, max_tokens=2)
    assert first.usage.prompt_tokens > 3 * BLOCK_SIZE
    second = complete(live, long, max_tokens=2)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 2 * BLOCK_SIZE and cached % BLOCK_SIZE == 0
    stream = live.openai().completions.create(
        model=MODEL,
        prompt=long,
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    last = [ch for ch in stream][-1]
    assert last.usage.prompt_tokens_details.cached_tokens == cached
    messages = [{"role": "user", "content": long}]
    chat(live, messages, max_tokens=2)
    again = chat(live, messages, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens >= 2 * BLOCK_SIZE
    chunks = list(
        live.openai().chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 2 * BLOCK_SIZE


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_continuous_usage_stats(live: Live, endpoint: str) -> None:
    """Every chunk carries the usage so far: its completion_tokens are the tokens sent up to
    and including that chunk (counted from the chunks' logprobs, one entry per token)."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    kw: dict[str, Any] = dict(
        model=MODEL, max_tokens=6, temperature=0.0, stream=True, stream_options=opts
    )
    if endpoint == "chat":
        chunks = list(live.openai().chat.completions.create(messages=USER, logprobs=True, **kw))
    else:
        chunks = list(live.openai().completions.create(prompt="hello", logprobs=0, **kw))
    assert all(ch.usage is not None for ch in chunks)
    sent = 0
    for ch in chunks:
        for choice in ch.choices:
            lp = choice.logprobs
            if lp is not None:
                sent += len(lp.content or []) if endpoint == "chat" else len(lp.tokens or [])
        assert ch.usage.completion_tokens == sent
        assert ch.usage.prompt_tokens == chunks[-1].usage.prompt_tokens > 0
    assert sent == 6


def test_best_of_and_request_id(live: Live) -> None:
    r = live.post("/v1/completions", {"prompt": "x", "n": 1, "best_of": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] is None
    assert "best_of" in r.json()["error"]["message"]
    ok = complete(live, "x", max_tokens=2, n=2, best_of=2, extra_body={"request_id": "abc"})
    assert len(ok.choices) == 2 and ok.id == "cmpl-abc"


def test_null_sampling_fields_mean_their_defaults(live: Live) -> None:
    nulls = {"min_p": None, "repetition_penalty": None, "presence_penalty": None, "top_k": None}
    r = complete(live, "hello world", extra_body={**nulls, "frequency_penalty": None})
    assert r.choices[0].text == complete(live, "hello world").choices[0].text


def test_continuous_usage_of_a_truncated_chat_prompt(live: Live) -> None:
    chunks = list(
        live.openai().chat.completions.create(
            model=MODEL,
            messages=USER,
            max_tokens=3,
            stream=True,
            stream_options={"continuous_usage_stats": True},
            extra_body={"truncate_prompt_tokens": 5},
        )
    )
    assert chunks and all(ch.usage.prompt_tokens == 5 for ch in chunks)


def test_return_tokens_as_token_ids(live: Live) -> None:
    """The same greedy tokens, written as ids: each id decodes to the token text a plain
    request reports at that position."""
    as_ids = {"return_tokens_as_token_ids": True}
    plain = complete(live, "hello world", logprobs=2).choices[0].logprobs
    lp = complete(live, "hello world", logprobs=2, extra_body=as_ids).choices[0].logprobs
    assert all(t.startswith("token_id:") for t in lp.tokens)
    ids = [int(t.removeprefix("token_id:")) for t in lp.tokens]
    assert [live.tokenizer.decode([i]) for i in ids] == plain.tokens
    assert lp.text_offset == plain.text_offset
    assert all(k.startswith("token_id:") for top in lp.top_logprobs for k in top)
    plain_chat = chat(live, logprobs=True, top_logprobs=1).choices[0].logprobs.content
    content = chat(live, logprobs=True, top_logprobs=1, extra_body=as_ids)
    tokens = [t.token for t in content.choices[0].logprobs.content]
    assert [live.tokenizer.decode([int(t.removeprefix("token_id:"))]) for t in tokens] == [
        t.token for t in plain_chat
    ]


def test_tokenize_takes_the_chat_template_fields(live: Live) -> None:
    def count(**extra: Any) -> int:
        r = live.post("/tokenize", {"messages": USER, **extra})
        assert r.status_code == 200, r.text
        return int(r.json()["count"])

    plain = count()
    off = count(chat_template_kwargs={"enable_thinking": False})
    assert off == plain + len(live.tokenizer.encode("no thinking. ", add_special_tokens=False))
    messages = [*USER, {"role": "assistant", "content": "the quick"}]
    r = live.post("/tokenize", {"messages": messages, "continue_final_message": True})
    text = "<|user|>hello world\n<|assistant|>the quick"
    assert r.json()["tokens"] == live.tokenizer.encode(text, add_special_tokens=False)
    bad = live.post("/tokenize", {"messages": USER, "chat_template_kwargs": {"tokenize": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
