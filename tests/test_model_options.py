"""--chat-template, --generation-config and several --served-model-name, through the engine,
the offline LLM and the HTTP server; and bad models failing at start-up with one line.

The model is a tiny random Llama whose generation_config.json asks for its own sampling
defaults (greedy, top_k, a repetition penalty, five new tokens): requests that leave those
fields unset must get exactly what an engine driven with the same values produces.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from pagemill.runtime import LLM, LLMEngine, SamplingParams
from pagemill.runtime.chat_template import resolve_chat_template
from pagemill.runtime.generation_defaults import load_generation_defaults
from pagemill.server import ServerThread, build_app, cli

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
OTHER_TEMPLATE = (
    "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)
GEN_CONFIG = {
    "temperature": 0.0,
    "top_k": 7,
    "repetition_penalty": 1.3,
    "max_new_tokens": 5,
    "top_p": 1.0,
    "eos_token_id": 0,
}
DEFAULTS = {"temperature": 0.0, "top_k": 7, "repetition_penalty": 1.3, "max_tokens": 5}


def build_tiny_llama(folder: Path) -> Path:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        ["hello world, the quick brown fox", "paged attention serves"] * 4,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<eos>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(folder))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.2,
        eos_token_id=fast.eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(str(folder))
    (folder / "generation_config.json").write_text(json.dumps(GEN_CONFIG))
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("options-llama"))


def make_engine(folder: Path, **kw) -> LLMEngine:
    return LLMEngine(model=str(folder), dtype="float32", kv_cache_memory_bytes=1 << 20, **kw)


@pytest.fixture(scope="module")
def engine(model_dir) -> LLMEngine:
    """The served engine (stepped by the server's thread once the server runs)."""
    return make_engine(model_dir)


@pytest.fixture(scope="module")
def reference(model_dir) -> LLMEngine:
    """A second engine on the same weights, driven directly by the tests."""
    return make_engine(model_dir)


def run(engine: LLMEngine, prompt, params: SamplingParams) -> list[int]:
    engine.add_request("ref", prompt, params)
    ids: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids += out.outputs[0].token_ids
    return ids


# ---------------------------------------------------------------- --generation-config


def test_generation_defaults_modes(model_dir, tmp_path) -> None:
    assert load_generation_defaults("auto", model_dir) == DEFAULTS  # top_p 1.0: HF's default
    assert load_generation_defaults("vllm", model_dir) == {}
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9}))
    assert load_generation_defaults(str(other), model_dir) == {"temperature": 0.6, "top_p": 0.9}
    with pytest.raises(ValueError, match=r"no generation_config\.json"):
        load_generation_defaults(str(tmp_path), model_dir)
    (other / "generation_config.json").write_text(json.dumps({"top_p": 7}))
    with pytest.raises(ValueError, match=r"cannot use.*top_p"):
        load_generation_defaults(str(other), model_dir)


def test_offline_llm_uses_the_model_defaults(model_dir, reference) -> None:
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory_bytes=1 << 20)
    [out] = llm.generate([[5, 6, 7, 8]], use_tqdm=False)
    expected = run(reference, [5, 6, 7, 8], SamplingParams(**DEFAULTS))
    assert out.outputs[0].token_ids == expected and len(expected) == 5
    plain = LLM(
        str(model_dir), dtype="float32", kv_cache_memory_bytes=1 << 20, generation_config="vllm"
    )
    assert plain.get_default_sampling_params() == SamplingParams()


@pytest.fixture(scope="module")
def server(engine):
    app = build_app(engine, ["tiny-a", "tiny-b"])
    with ServerThread(app) as url:
        yield url


def test_unset_fields_take_the_model_defaults(server, reference) -> None:
    body = {"model": "tiny-a", "prompt": [5, 6, 7, 8]}
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()
    want = run(reference, [5, 6, 7, 8], SamplingParams(**DEFAULTS))
    assert r["usage"]["completion_tokens"] == 5
    assert r["choices"][0]["text"] == reference.tokenizer.decode(want)
    # The request's own values win: max_tokens 3, and no repetition penalty.
    body.update(max_tokens=3, repetition_penalty=1.0)
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()
    want = run(
        reference,
        [5, 6, 7, 8],
        SamplingParams(**{**DEFAULTS, "max_tokens": 3, "repetition_penalty": 1.0}),
    )
    assert r["choices"][0]["text"] == reference.tokenizer.decode(want)
    chat = {"model": "tiny-b", "messages": [{"role": "user", "content": "hello"}]}
    r = httpx.post(f"{server}/v1/chat/completions", json=chat, timeout=60).json()
    assert r["usage"]["completion_tokens"] == 5


def test_sampling_params_built_from_defaults(reference) -> None:
    from pagemill.server.entrypoints.openai.protocol import CompletionRequest
    from pagemill.server.entrypoints.openai.serving_completion import CompletionServing

    # The front end's view of the model (`AsyncEngine` has these), from a real engine.
    client = SimpleNamespace(
        generation_defaults=reference.generation_defaults, input_processor=reference.input_processor
    )
    serving = CompletionServing(client, "m", max_model_len=128, tokenizer=None, vocab_limit=300)
    sp = serving.sampling_params(CompletionRequest(prompt=[1]), 5, None)
    assert (sp.temperature, sp.top_k, sp.repetition_penalty, sp.top_p) == (0.0, 7, 1.3, 1.0)
    sp = serving.sampling_params(
        CompletionRequest(prompt=[1], temperature=0.5, top_k=None), 5, None
    )
    assert (sp.temperature, sp.top_k) == (0.5, 7)  # null is unset, as vLLM
    # max_tokens unset: the model's default, capped to the room the prompt leaves (the input
    # processor, the one validator, decides once it knows the prompt).
    sp = serving.sampling_params(CompletionRequest(prompt=[1]), None, None)
    assert sp.max_tokens is None

    def max_tokens(n_prompt: int) -> int:
        processed = reference.input_processor.process(
            "d", [1] * n_prompt, sp, priority=0, cache_salt=None, arrival_time=0.0
        )
        return processed.completions[0].max_tokens

    assert reference.max_model_len == 128
    assert max_tokens(125) == 3 and max_tokens(10) == 5


# ---------------------------------------------------------------- --served-model-name


def test_several_served_model_names(server) -> None:
    models = httpx.get(f"{server}/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["tiny-a", "tiny-b"]
    for name in ("tiny-a", "tiny-b"):
        r = httpx.post(
            f"{server}/v1/completions",
            json={"model": name, "prompt": [5, 6], "max_tokens": 2},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["model"] == "tiny-a"
    r = httpx.post(f"{server}/v1/completions", json={"model": "tiny-c", "prompt": [5]})
    assert r.status_code == 404 and "'tiny-a', 'tiny-b'" in r.json()["error"]["message"]


# ---------------------------------------------------------------- --chat-template


def test_chat_template_inline_or_file(model_dir, tmp_path) -> None:
    messages = [{"role": "user", "content": "hello"}]
    file = tmp_path / "t.jinja"
    file.write_text(OTHER_TEMPLATE)
    for value in (OTHER_TEMPLATE, str(file)):
        eng = make_engine(model_dir, chat_template=value)
        assert eng.apply_chat_template(messages) == eng.tokenizer.encode(
            "<hello>A:", add_special_tokens=False
        )
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        resolve_chat_template(str(tmp_path / "missing.jinja"))
    # Per call, as vLLM's LLM.chat(chat_template=...): this call only.
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory_bytes=1 << 20)
    tok = llm.get_tokenizer()
    params = SamplingParams(max_tokens=1)
    [out] = llm.chat(messages, params, use_tqdm=False, chat_template=OTHER_TEMPLATE)
    assert out.prompt_token_ids == tok.encode("<hello>A:", add_special_tokens=False)
    [out] = llm.chat(messages, params, use_tqdm=False)
    assert out.prompt_token_ids == tok.encode("user: hello\n", add_special_tokens=False)


def test_chat_template_reaches_the_api_process_side(model_dir) -> None:
    """With the engine in its own process, the API side renders chats: same template there."""
    from pagemill.runtime import EngineConfig
    from pagemill.runtime.engine.model_assets import ModelAssets

    # What `AsyncEngine.launch` loads on the API side (the core process loads its own).
    config = EngineConfig(
        model=str(model_dir), chat_template=OTHER_TEMPLATE, generation_config="vllm"
    )
    assets = ModelAssets.load(config)
    assert assets.tokenizer.chat_template == OTHER_TEMPLATE
    assert assets.generation_defaults == {}


# ---------------------------------------------------------------- bad models at start-up


def _gguf(path: Path, arch: str, tensor: np.ndarray) -> str:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_bad_models_are_one_line_and_exit_code_2(tmp_path, monkeypatch, capsys, model_dir) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("PAGEMILL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cli, "_make_engine", lambda config: pytest.fail("engine built"))
    falcon = tmp_path / "falcon"
    falcon.mkdir()
    (falcon / "config.json").write_text(
        json.dumps({"architectures": ["FalconForCausalLM"], "model_type": "falcon"})
    )
    cases = {
        "/no/such/model": r"unknown model '/no/such/model'",
        "no-org/no-model": r"not in the Hugging Face cache .*HF_HUB_OFFLINE",
        str(falcon): r"unsupported model architecture.*LlamaForCausalLM",
        _gguf(
            tmp_path / "b.gguf", "bloom", np.zeros((4, 32), np.float32)
        ): r"GGUF architecture 'bloom' .*llama, qwen2",
        _gguf(
            tmp_path / "g.gguf", "gemma2", np.zeros((4, 32), np.float32)
        ): r"lacks metadata key gemma2\.embedding_length",
        _gguf(tmp_path / "i.gguf", "llama", np.zeros((4, 32), np.int8)): r"GGML type\(s\) I8",
    }
    for model, message in cases.items():
        for command in (
            ["serve", model, "--no-engine-process"],
            ["generate", "hi", "--model", model],
        ):
            assert cli.main(command) == 2, model
            err = capsys.readouterr().err
            assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
            assert err.startswith(f"pagemill {command[0]}: error: "), err
            assert re.search(message, err), err
    assert cli.main(["serve", str(model_dir), "--chat-template", "nope.jinja"]) == 2
    assert "neither a file nor a Jinja template" in capsys.readouterr().err
    assert cli.main(["serve", str(model_dir), "--generation-config", str(tmp_path)]) == 2
    assert "no generation_config.json" in capsys.readouterr().err


def test_download_prints_the_hub_snapshot(tmp_path, monkeypatch, capsys, model_dir) -> None:
    import shutil

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = tmp_path / "hf" / "hub" / "models--tiny-org--options"
    shutil.copytree(model_dir, repo / "snapshots" / ("c" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "stable").write_text("c" * 40)
    assert cli.main(["download", "tiny-org/options", "--revision", "stable"]) == 0
    assert capsys.readouterr().out.strip() == str(repo / "snapshots" / ("c" * 40))
    assert cli.main(["download", "tiny-org/options"]) == 2  # no main ref cached
    assert "not in the Hugging Face cache" in capsys.readouterr().err
