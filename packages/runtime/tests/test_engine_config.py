"""EngineConfig composed of SchedulerConfig + CacheConfig, the flat-name routing, and the one
dtype table shared with the planner."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagemill.blockpool import DTYPE_BYTES, CacheConfig
from pagemill.runtime.config import (
    DEFAULT_MODEL,
    KWARG_ROUTES,
    EngineConfig,
    resolve_dtype,
    torch_dtype,
)
from pagemill.runtime.model_config import DTYPE_ALIASES, DTYPES, ModelConfig, canonical_dtype
from pagemill.runtime.sample.structured_output import StructuredOutputsConfig
from pagemill.scheduler import SchedulerConfig

# ---------------------------------------------------------------- dtypes


@pytest.mark.parametrize(
    ("spelling", "canonical"),
    [
        ("float32", "float32"),
        ("fp32", "float32"),
        ("float", "float32"),
        ("float16", "float16"),
        ("fp16", "float16"),
        ("half", "float16"),
        ("bfloat16", "bfloat16"),
        ("bf16", "bfloat16"),
        ("torch.bfloat16", "bfloat16"),
        ("BF16", "bfloat16"),
        ("torch.float16", "float16"),
    ],
)
def test_canonical_dtype(spelling: str, canonical: str) -> None:
    assert canonical_dtype(spelling) == canonical
    assert torch_dtype(spelling) == getattr(torch, canonical)


def test_dtype_table_agrees_with_the_pool_and_torch() -> None:
    assert set(DTYPES) == {"float32", "float16", "bfloat16"}
    assert set(DTYPE_ALIASES.values()) <= set(DTYPES)
    for name, size in DTYPES.items():
        assert size == DTYPE_BYTES[name] == torch.empty((), dtype=torch_dtype(name)).element_size()
    with pytest.raises(ValueError, match=r"unsupported dtype 'int8'.*bfloat16.*half.*bf16"):
        canonical_dtype("int8")


def test_resolve_dtype_gives_canonical_names() -> None:
    assert resolve_dtype("auto", "bfloat16", "cpu", cpu_bf16=False) == "float32"
    assert resolve_dtype("auto", "float32", "cpu", cpu_bf16=True) == "bfloat16"
    assert resolve_dtype("auto", "float16", "cuda") == "float16"
    assert resolve_dtype("auto", "bfloat16", "cuda") == "bfloat16"
    assert resolve_dtype("auto", "float32", "cuda") == "bfloat16"
    assert resolve_dtype("auto", None, "cuda") == "bfloat16"
    assert resolve_dtype("half", None, "cpu") == "float16"


def test_model_config_dtype_is_a_canonical_name() -> None:
    raw = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
    )
    assert ModelConfig.from_dict(dict(raw, torch_dtype="bfloat16")).config_dtype == "bfloat16"
    assert ModelConfig.from_dict(dict(raw, dtype="torch.float16")).config_dtype == "float16"
    assert ModelConfig.from_dict(dict(raw, dtype="float8_e4m3fn")).config_dtype is None
    assert ModelConfig.from_dict(raw).config_dtype is None
    # The planner's leniency: any architecture, the Qwen2 layout decided by model_type too.
    other = dict(raw, architectures=["GemmaForCausalLM"], model_type="gemma")
    with pytest.raises(ValueError, match="unsupported model architecture"):
        ModelConfig.from_dict(other)
    assert ModelConfig.from_dict(other, require_supported=False).architecture == "GemmaForCausalLM"
    assert ModelConfig.from_dict(dict(raw, model_type="qwen2")).attention_bias


# ---------------------------------------------------------------- EngineConfig


def test_defaults_compose_the_sub_configs() -> None:
    config = EngineConfig()
    assert config.model == DEFAULT_MODEL and config.dtype == "auto"
    assert config.scheduler == SchedulerConfig() and config.cache == CacheConfig()
    assert EngineConfig.from_kwargs() == config
    assert EngineConfig(dtype="bf16").dtype == "bfloat16"  # stored canonical


def test_every_field_has_exactly_one_flat_name() -> None:
    routed = {(section, name) for section, name in KWARG_ROUTES.values()}
    assert len(routed) == len(KWARG_ROUTES)
    expected = {
        (None, f.name)
        for f in dataclasses.fields(EngineConfig)
        # data_parallel_rank: set per core by the data-parallel front end, not a user knob.
        if f.name not in ("scheduler", "cache", "structured_outputs", "data_parallel_rank")
    }
    expected |= {
        ("scheduler", f.name)
        for f in dataclasses.fields(SchedulerConfig)
        if f.name not in ("max_model_len", "max_loras")
    }  # the engine's max_model_len and max_loras decide them
    expected |= {("cache", f.name) for f in dataclasses.fields(CacheConfig)}
    expected |= {
        ("structured_outputs", f.name) for f in dataclasses.fields(StructuredOutputsConfig)
    }
    assert routed == expected
    assert KWARG_ROUTES["scheduling_policy"] == ("scheduler", "policy")


def test_from_kwargs_routes_flat_names() -> None:
    config = EngineConfig.from_kwargs(
        model="/m",
        tokenizer="/t",
        dtype="half",
        device="cpu",
        seed=3,
        load_format="dummy",
        max_model_len=512,
        max_num_batched_tokens=1024,
        max_num_seqs=8,
        long_prefill_token_threshold=64,
        enable_chunked_prefill=True,
        scheduling_policy="priority",
        block_size=32,
        enable_prefix_caching=False,
        prefix_caching_hash_algo="xxh3_128",
        kv_cache_memory_bytes=1 << 20,
        gpu_memory_utilization=0.5,
    )
    assert config == EngineConfig(
        model="/m",
        tokenizer="/t",
        dtype="float16",
        device="cpu",
        seed=3,
        load_format="dummy",
        max_model_len=512,
        scheduler=SchedulerConfig(
            max_num_batched_tokens=1024,
            max_num_seqs=8,
            max_model_len=512,
            long_prefill_token_threshold=64,
            policy="priority",
        ),
        cache=CacheConfig(
            block_size=32,
            enable_prefix_caching=False,
            prefix_caching_hash_algo="xxh3_128",
            kv_cache_memory_bytes=1 << 20,
            gpu_memory_utilization=0.5,
        ),
    )


def test_max_model_len_reaches_the_scheduler() -> None:
    assert EngineConfig(max_model_len=300).scheduler.max_model_len == 300
    assert EngineConfig.from_kwargs(max_model_len=300).scheduler.max_model_len == 300
    # Without chunking a whole prompt must fit one step: a given length is checked at once...
    with pytest.raises(ValueError, match="without chunked prefill"):
        EngineConfig.from_kwargs(
            enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=1024
        )
    # ... an unknown one (the model's own) when the engine knows it.
    config = EngineConfig.from_kwargs(enable_chunked_prefill=False, max_num_batched_tokens=512)
    assert not config.scheduler.enable_chunked_prefill
    with pytest.raises(ValueError, match="without chunked prefill"):
        dataclasses.replace(config.scheduler, max_model_len=2048)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_num_seq": 4}, TypeError, r"'max_num_seq' \(did you mean 'max_num_seqs'\?\)"),
        ({"policy": "fcfs"}, TypeError, r"unknown option\(s\) 'policy'.*scheduling_policy"),
        ({"scheduling_policy": "lifo"}, ValueError, "SchedulerConfig.policy"),
        ({"block_size": 0}, ValueError, "CacheConfig.block_size"),
        ({"dtype": "int4"}, ValueError, "EngineConfig.dtype"),
        ({"device": "tpu"}, ValueError, "EngineConfig.device"),
        ({"device": "cuda:x"}, ValueError, "EngineConfig.device"),
        ({"max_model_len": 1}, ValueError, "EngineConfig.max_model_len"),
        ({"load_format": "pt"}, ValueError, "EngineConfig.load_format"),
        ({"model": ""}, ValueError, "EngineConfig.model"),
        ({"seed": 1.5}, ValueError, "EngineConfig.seed"),
    ],
)
def test_bad_options_name_the_field(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        EngineConfig.from_kwargs(**kwargs)


def test_sub_configs_must_be_configs() -> None:
    with pytest.raises(TypeError, match=r"EngineConfig\.cache must be a CacheConfig"):
        EngineConfig(cache={"block_size": 16})  # type: ignore[arg-type]


def test_resolve_device() -> None:
    assert EngineConfig(device="cpu").resolve_device() == "cpu"
    assert EngineConfig().resolve_device() == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            EngineConfig(device="cuda:0").resolve_device()


def test_lora_options_are_checked_and_reach_the_scheduler() -> None:
    cfg = EngineConfig.from_kwargs(enable_lora=True, max_loras=3, max_lora_rank=32)
    assert cfg.scheduler.max_loras == 3
    assert EngineConfig.from_kwargs(max_loras=3).scheduler.max_loras == 0  # LoRA off
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig.from_kwargs(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_lora_rank"):
        EngineConfig.from_kwargs(enable_lora=True, max_lora_rank=0)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig.from_kwargs(enable_lora=True, tensor_parallel_size=2)
