"""Which attention layers rotate q and k as one tensor of heads (`apply_rotary_qk`): on CPU
the Llama layer with full RoPE does (one generated loop per layer, compiled); layers with
anything between the projection and the rotation keep the separate path. The values are
checked end to end by the greedy tests against transformers (eager and compiled)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagemill.runtime.model_config import ModelConfig
from pagemill.runtime.model_executor.models.llama import LlamaAttention

RAW = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def _attention(**kwargs: Any) -> LlamaAttention:
    return LlamaAttention(ModelConfig.from_dict(dict(RAW)), torch.float32, **kwargs)


def test_llama_rotates_q_and_k_together_on_cpu() -> None:
    qkv = torch.zeros(3, 64 + 2 * 32)
    assert _attention()._rotates_qk_together(qkv)


def test_q_k_norms_keep_the_separate_rotation() -> None:
    qkv = torch.zeros(3, 64 + 2 * 32)
    assert not _attention(qk_norm=True)._rotates_qk_together(qkv)


def test_class_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(LlamaAttention, "rotate_qk_together", False)
    assert not _attention()._rotates_qk_together(torch.zeros(3, 128))


def test_subclass_with_own_norms_keeps_the_separate_rotation() -> None:
    class Normed(LlamaAttention):
        def _norm_projections(
            self, q: torch.Tensor, k: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return q * 2, k

    layer = Normed(ModelConfig.from_dict(dict(RAW)), torch.float32)
    assert not layer._rotates_qk_together(torch.zeros(3, 128))
