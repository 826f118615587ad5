"""Tiny random-weight models (and a tiny tokenizer) for the runtime's engine and model tests.

Models are built from transformers config classes with a fixed seed and saved with
`save_pretrained`, so the engine loads them exactly like a real checkpoint and the
reference is transformers itself on the same weights. `initializer_range` is larger than
HF's default so the logits are well separated: greedy equality then tests the engine, not
last-bit rounding between two attention implementations at a near tie.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

# As the repository's root conftest, for a run rooted here: no compile cache in the user's
# folder (an env var, so spawned engine processes see it too).
os.environ.setdefault("PAGEMILL_COMPILE_CACHE", "0")
os.environ.setdefault("PAGEMILL_COMPILE_BACKGROUND", "0")
# Torch's first-call check that no custom op aliases its inputs, on every compiled graph
# (off in a served engine: see `model_runner.OP_ALIASING_CHECK_ENV`).
os.environ.setdefault("PAGEMILL_CHECK_OP_ALIASING", "1")

TINY_VOCAB_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "pack my box with five dozen liquor jugs",
    "hello world, hello engine, hello paged attention",
    "continuous batching schedules every step, not every batch",
    "héllo wörld ça va naïve façade 中文 😀",
] * 4

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(folder: Path) -> Any:
    """A byte-level BPE trained on a few lines: real merges and multi-byte characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TINY_VOCAB_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return fast


def build_model(folder: Path, arch: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """Save a tiny fp32 model of `arch` into `folder`: "llama", "qwen2", "mistral", "qwen3",
    "phi3", "gemma2", "gemma3" (Gemma 3's text model), "smollm3", "olmo2", "granite", or the
    mixture-of-experts "qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "gpt_oss"."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder)
    common: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM),
        "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),
        "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    }[arch]
    if arch == "mistral":
        common.setdefault("sliding_window", None)
    if arch.startswith("gemma"):
        # Eager attention is transformers' reference for soft-capped scores.
        common.setdefault("attn_implementation", "eager")
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common)).eval()
    if arch.startswith("gemma") or arch in ("qwen3", "olmo2", "qwen3_moe", "olmoe"):
        # HF initialises norms to zero (Gemma: 1 + w) or one: random ones are seen.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(torch.randn_like(p) * 0.1)
    if arch in ("qwen2", "qwen2_moe") or common.get("attention_bias"):
        # HF initialises biases to zero; random ones make the test see whether they are used.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                    layer.self_attn.o_proj,
                ):
                    if proj.bias is not None:
                        proj.bias.normal_(0, 0.2)
    model.save_pretrained(str(folder))
    return model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("tiny-llama")
    return folder, build_model(folder, "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    return folder, build_model(
        folder, "qwen2", seed=1, num_hidden_layers=3, tie_word_embeddings=True
    )


def _hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Transformers' greedy continuation of one unpadded prompt, never stopping at EOS."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=[],  # None would fall back to the config's EOS
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def _random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def _all_logits(runner: Any, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Logits at every position of each prompt, all prompts in one flattened prefill through
    a `ModelRunner` (fresh blocks from 0; the previous call's requests are finished)."""
    from pagemill.runtime import SamplingParams
    from pagemill.scheduler import Request, ScheduledRequest, SchedulerOutput

    sched, next_block = [], 0
    for i, p in enumerate(prompts):
        nb = -(-len(p) // 16)
        record = Request(f"r{i}", p, sampling_params=SamplingParams(temperature=0.0))
        blocks = list(range(next_block, next_block + nb))
        sched.append(ScheduledRequest(record.request_id, p, 0, len(p), blocks, True, True, record))
        next_block += nb
    out = SchedulerOutput(sched, sum(len(p) for p in prompts), [], list(runner.requests))
    batch = runner.prepare(out)
    with torch.inference_mode():
        hidden = runner.model(batch.input_ids, batch.positions, batch.attn)
        logits = runner.model.compute_logits(hidden)
    bounds = batch.attn.plan.query_start_loc.tolist()
    return [logits[bounds[i] : bounds[i + 1]] for i in range(len(prompts))]


@pytest.fixture(scope="session")
def all_logits() -> Callable[[Any, list[list[int]]], list[torch.Tensor]]:
    return _all_logits


@pytest.fixture(scope="session")
def hf_greedy() -> Callable[[torch.nn.Module, list[int], int], list[int]]:
    return _hf_greedy


@pytest.fixture(scope="session")
def random_prompts() -> Callable[..., list[list[int]]]:
    return _random_prompts


@pytest.fixture(scope="session")
def build_tiny_model() -> Callable[..., torch.nn.Module]:
    """`build_tiny_model(folder, arch, seed=0, **config_overrides)` saves and returns the HF
    model."""
    return build_model


@pytest.fixture(scope="session")
def write_gguf() -> Callable[..., Path]:
    """test_gguf_model's GGUF writer, `write_gguf(model, hf_dir, out, qtype, arch=...)` (tests
    import as files here, not as a package)."""
    spec = importlib.util.spec_from_file_location(
        "_gguf_writer", Path(__file__).with_name("test_gguf_model.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    writer: Callable[..., Path] = module.write_gguf
    return writer


@pytest.fixture(scope="session")
def compiled_llm_of() -> Callable[..., Any]:
    """`compiled_llm_of(folder, **llm_kwargs)`: an `LLM` with its forward compiled (the
    suite runs eager by default), or the test skipped where compiling is unavailable."""
    from pagemill.runtime import LLM
    from pagemill.runtime.worker.compilation import (
        ENFORCE_EAGER_ENV,
        compile_unavailable_reason,
    )

    def build(folder: object, **kwargs: Any) -> Any:
        reason = compile_unavailable_reason(torch.device("cpu"))
        if reason is not None:
            pytest.skip(reason)
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv(ENFORCE_EAGER_ENV, raising=False)
            llm = LLM(str(folder), **kwargs)
        assert llm.llm_engine.engine_core.model_runner.compiled
        return llm

    return build


# A small engine over `tiny_llama`: a 64-token step budget, four sequences and a KV pool of
# 512 blocks of 16 tokens' fp32 worth, so a test's requests share few blocks.
SMALL_ENGINE = dict(
    dtype="float32",
    max_num_batched_tokens=64,
    max_num_seqs=4,
    kv_cache_memory_bytes=16 * 16 * 512,
    max_model_len=128,
)


@pytest.fixture(scope="session")
def small_engine() -> dict[str, Any]:
    """`SMALL_ENGINE`'s LLM keyword arguments (a fresh copy)."""
    return dict(SMALL_ENGINE)


@pytest.fixture(scope="module")
def native_compiled_llm(tiny_llama, compiled_llm_of, small_engine) -> Any:
    """A compiled `small_engine` LLM over `tiny_llama` whose decode steps take the C++ KV
    write and decode operators (skipped where those cannot be built); one per module."""
    from pagemill.kernels import cpu_native

    if not cpu_native.load_attention_ops():
        pytest.skip("the C++ attention operators cannot be built here")
    folder, _ = tiny_llama
    return compiled_llm_of(folder, **small_engine)


@pytest.fixture(scope="session")
def q4_gguf(tmp_path_factory, build_tiny_model, write_gguf) -> Path:
    """A tiny random llama written as a Q4_0 GGUF (its int4 rows run `gemv_q4`)."""
    gguf = pytest.importorskip("gguf")
    hf_dir = tmp_path_factory.mktemp("hf-q4")
    model = build_tiny_model(hf_dir, "llama", seed=21)
    out = tmp_path_factory.mktemp("gguf-q4") / "tiny-Q4_0.gguf"
    return write_gguf(model, hf_dir, out, gguf.GGMLQuantizationType.Q4_0)
