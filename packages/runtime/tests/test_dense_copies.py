"""`cpu_dense_weights`: whether packed layers keep a dense copy for large batches.

never keeps packed weights only, always keeps a copy of every packed layer, auto keeps them
where bf16 GEMMs are native and all of them fit in a share of the machine's memory.
"""

from __future__ import annotations

import logging

import pytest
import torch

from pagemill.runtime.config import EngineConfig, ModelConfig
from pagemill.runtime.model_executor.layers import Linear
from pagemill.runtime.model_executor.loader import load_model
from pagemill.runtime.model_executor.models.llama import LlamaForCausalLM
from pagemill.runtime.model_executor.quantization import (
    choose_dense_copies,
    plan_weights,
    weight_report,
)
from pagemill.runtime.model_executor.quantization import plan as plan_module

CPU = torch.device("cpu")


def test_the_option_is_checked_and_routed() -> None:
    assert EngineConfig.from_kwargs(cpu_dense_weights="never").cpu_dense_weights == "never"
    assert EngineConfig().cpu_dense_weights == "auto"
    with pytest.raises(ValueError, match="cpu_dense_weights must be one of"):
        EngineConfig(cpu_dense_weights="sometimes")


def _planned(folder, mode: str, memory: int, native: bool, monkeypatch):
    monkeypatch.setattr(plan_module, "default_dense_fallback", lambda dtype, device: native)
    config = ModelConfig.from_pretrained(folder)
    model = LlamaForCausalLM(config, torch.bfloat16, 256)
    plan = plan_weights("int4", gguf=False, dtype=torch.bfloat16, device=CPU)
    return choose_dense_copies(plan, model, mode, torch.bfloat16, CPU, memory_bytes=memory)


def test_auto_keeps_copies_only_where_they_fit(tiny_llama, monkeypatch) -> None:
    folder, hf = tiny_llama
    c = hf.config
    h, inter = c.hidden_size, c.intermediate_size
    plan, line = _planned(folder, "auto", 1 << 40, True, monkeypatch)
    assert plan.linear.dense_fallback and plan.lm_head is not None and plan.lm_head.dense_fallback
    assert line is not None and "copies of packed layers for large batches allowed" in line
    assert "fits 25%" in line
    # What the copies take: every projection in bf16 (and an untied head), nothing else.
    config = ModelConfig.from_pretrained(folder)
    layer = (config.q_size + 2 * config.kv_size) * h + config.q_size * h + 3 * inter * h
    head = 0 if c.tie_word_embeddings else c.vocab_size * h
    need = (c.num_hidden_layers * layer + head) * 2
    model = LlamaForCausalLM(config, torch.bfloat16, 256)
    assert plan_module.dense_copy_bytes(plan, model) == need
    plan, line = _planned(folder, "auto", 4 * need - 1, True, monkeypatch)
    assert not plan.linear.dense_fallback and line is not None and "exceeds 25%" in line
    plan, line = _planned(folder, "auto", 1 << 40, False, monkeypatch)  # bf16 not native
    assert not plan.linear.dense_fallback and line is not None and "not native" in line
    plan, _ = _planned(folder, "always", 1, False, monkeypatch)
    assert plan.linear.dense_fallback
    plan, _ = _planned(folder, "never", 1 << 40, True, monkeypatch)
    assert not plan.linear.dense_fallback and plan.lm_head is not None
    assert not plan.lm_head.dense_fallback


@pytest.mark.parametrize("mode", ["never", "always"])
def test_loaded_model_holds_what_was_asked(tiny_llama, mode, caplog, monkeypatch) -> None:
    if mode == "never":  # no path above the limit either, not AMX on the packed blocks
        monkeypatch.setattr(Linear, "amx_packed", False)  # (test_gemv_q4_linear)
    # "always" keeps the copies even where AMX could run the packed blocks without them.
    folder, _ = tiny_llama
    config = ModelConfig.from_pretrained(folder)
    with caplog.at_level(logging.INFO, logger="pagemill.runtime.model_executor.loader"):
        model = load_model(
            folder, config, torch.bfloat16, CPU, 256, quantization="int4", cpu_dense_weights=mode
        )
    assert sum("cpu_dense_weights:" in r.getMessage() for r in caplog.records) == 1
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.weight_format != "dense" for m in layers)
    assert all(m.has_dense_fallback == (mode == "always") for m in layers)
    report = weight_report(model)
    assert (report.dense_copy_bytes > 0) == (mode == "always")
