"""Logprobs with speculative decoding: every emitted token (accepted draft, correction or
bonus) reports the target's own logprobs at its position, checked against transformers'
log-softmax over the same sequence."""

from __future__ import annotations

import pytest
import torch

from pagemill.runtime import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip


def test_logprobs_with_ngram_are_the_targets_per_token(tiny_llama, random_prompts) -> None:
    folder, model = tiny_llama
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=4 << 20,
              speculative_config=NGRAM)  # fmt: skip
    # Repeating prompts: the n-gram proposer has matches from the first step on.
    prompts = [p * 4 for p in random_prompts([3, 5], model.config.vocab_size, seed=11)]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24, logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats.spec_num_accepted_tokens > 0
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids) == 24
        seq = torch.tensor([prompt + list(c.token_ids)])
        with torch.no_grad():
            ref = torch.log_softmax(model(seq).logits[0].double(), dim=-1)
        total = 0.0
        for j, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            row = ref[len(prompt) - 1 + j]
            assert tok == int(row.argmax())
            assert set(entry) == {tok, *row.topk(3).indices.tolist()}
            for t, lp in entry.items():
                assert lp == pytest.approx(float(row[t]), abs=1e-4)
            total += entry[tok]
        assert c.cumulative_logprob == pytest.approx(total)
