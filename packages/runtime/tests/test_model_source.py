"""Model names resolve like vLLM's: folder, .gguf file, or a Hub id through the Hub cache.

No network exists here, so the Hub cache is laid out by hand exactly as huggingface_hub
writes it (models--org--name/refs/<ref> holding a commit, snapshots/<commit>/<files>),
under a temporary HF_HOME, and served offline.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pagemill.runtime import LLM, SamplingParams
from pagemill.runtime.model_executor.loader import resolve_model_path
from pagemill.runtime.model_executor.model_source import hub_cache_dir, is_hub_id, resolve_model

COMMIT_MAIN = "a" * 40
COMMIT_V2 = "b" * 40


def lay_out_hub_cache(hub: Path, repo_id: str, ref: str, commit: str, model_dir: Path) -> Path:
    """Copy a model folder into a Hub cache as huggingface_hub lays it out (blobs inlined)."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf" / "hub"


def test_hub_id_is_served_from_the_cache(
    hub, tiny_llama, tiny_qwen2, random_prompts, hf_greedy
) -> None:
    folder, ref = tiny_llama
    assert hub_cache_dir() == hub  # HF_HOME read now, not at huggingface_hub's import
    main = lay_out_hub_cache(hub, "tiny-org/tiny-llama", "main", COMMIT_MAIN, folder)
    qwen_folder, _ = tiny_qwen2
    v2 = lay_out_hub_cache(hub, "tiny-org/tiny-llama", "v2", COMMIT_V2, qwen_folder)
    source = resolve_model("tiny-org/tiny-llama")
    assert source.kind == "hub" and source.folder == main
    assert resolve_model_path("tiny-org/tiny-llama", revision="v2") == v2
    assert resolve_model_path("tiny-org/tiny-llama", revision=COMMIT_V2) == v2

    llm = LLM("tiny-org/tiny-llama", dtype="float32", kv_cache_memory_bytes=1 << 20)
    assert llm.llm_engine.model_path == main
    prompts = random_prompts([4, 21], ref.config.vocab_size, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, 6)
    other = LLM(
        "tiny-org/tiny-llama", revision="v2", dtype="float32", kv_cache_memory_bytes=1 << 20
    )
    assert other.llm_engine.model_config.architecture == "Qwen2ForCausalLM"


def test_hub_id_offline_without_a_cached_copy_says_how_to_fix_it(hub) -> None:
    with pytest.raises(
        ValueError,
        match=r"'tiny-org/absent' is not in the Hugging Face cache "
        r".*HF_HUB_OFFLINE is set.*unset HF_HUB_OFFLINE.*HF_HOME",
    ):
        resolve_model("tiny-org/absent")
    with pytest.raises(ValueError, match=r"at revision 'v9'"):
        resolve_model("tiny-org/absent", revision="v9")


def test_hub_id_without_network_says_so(hub, monkeypatch) -> None:
    """Online mode with the Hub unreachable (a closed local port stands in for no network)."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(
        ValueError,
        match=r"not in the Hugging Face cache .*could not be reached"
        r".*connect to the network",
    ):
        resolve_model("tiny-org/absent")


def test_unknown_names_and_files(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"unknown model '\./no/such/model'.*no such folder"):
        resolve_model("./no/such/model")
    text = tmp_path / "weights.bin"
    text.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"is a file but not a \.gguf"):
        resolve_model(str(text))
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("org/name.v1-x_y")
    assert not is_hub_id("a/b/c") and not is_hub_id("/abs/path") and not is_hub_id("../x")
    assert not is_hub_id("name")


def test_unsupported_architecture_names_what_is_supported(tmp_path) -> None:
    import torch
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(
        '{"architectures": ["FalconForCausalLM"], "model_type": "falcon", "vocab_size": 10}'
    )
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"unsupported model architecture.*Falcon.*LlamaForCausalLM"
    ):
        LLM(str(tmp_path), dtype="float32")


def test_hub_repo_is_checked_before_its_weights(hub, tmp_path) -> None:
    """The architecture is read from config.json alone (fetched first); a GGUF-only repo is
    not a model folder."""
    falcon = tmp_path / "falcon"
    falcon.mkdir()
    (falcon / "config.json").write_text(
        '{"architectures": ["FalconForCausalLM"], "model_type": "falcon"}'
    )
    lay_out_hub_cache(hub, "tiny-org/falcon", "main", COMMIT_MAIN, falcon)
    with pytest.raises(ValueError, match=r"unsupported model architecture.*Qwen2ForCausalLM"):
        resolve_model("tiny-org/falcon")
    ggufs = tmp_path / "ggufs"
    ggufs.mkdir()
    (ggufs / "model.Q4_0.gguf").write_bytes(b"GGUF")
    lay_out_hub_cache(hub, "tiny-org/only-gguf", "main", COMMIT_MAIN, ggufs)
    with pytest.raises(ValueError, match=r"'tiny-org/only-gguf' has no config\.json"):
        resolve_model("tiny-org/only-gguf")


def test_tokenizer_hub_id_comes_from_the_cache(hub, tiny_llama, tmp_path) -> None:
    from pagemill.runtime.model_executor.model_source import resolve_tokenizer

    folder, _ = tiny_llama
    snapshot = lay_out_hub_cache(hub, "tiny-org/tok", "main", COMMIT_MAIN, folder)
    assert resolve_tokenizer("tiny-org/tok") == str(snapshot)
    assert resolve_tokenizer(str(folder)) == str(folder)
    bare = tmp_path / "no-tokenizer"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(folder / f, bare / f)
    llm = LLM(str(bare), tokenizer="tiny-org/tok", dtype="float32", kv_cache_memory_bytes=1 << 20)
    assert llm.get_tokenizer() is not None and llm.llm_engine.encode("hello world")
