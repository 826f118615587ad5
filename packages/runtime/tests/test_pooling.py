"""Embeddings (pooling requests) and prompt logprobs equal transformers' on the same weights.

The reference is transformers itself: `AutoModel`'s last hidden state (after the final
norm) pooled the same way, and a plain log_softmax over `AutoModelForCausalLM`'s logits.
Each engine runs with a token budget of 16, so every longer prompt is chunked.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from pagemill.runtime import LLM, LLMEngine, SamplingParams
from pagemill.runtime.outputs import EmbeddingRequestOutput
from pagemill.runtime.pooling_params import PoolingParams

CHUNKED = dict(
    dtype="float32",
    max_num_batched_tokens=16,
    kv_cache_memory_bytes=4 << 20,
    enforce_eager=True,
)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory, build_tiny_model):
    folder = tmp_path_factory.mktemp("tiny-qwen3-embed")
    build_tiny_model(folder, "qwen3", seed=2)
    return folder


@pytest.fixture(scope="module")
def hf_base(tiny_qwen3):
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(tiny_qwen3), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    return LLM(str(tiny_qwen3), **CHUNKED)


def _hidden(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).last_hidden_state[0]


def _close(got: list[float], expected: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got), expected, atol=2e-5, rtol=1e-4)


def test_last_and_mean_pooling_match_hf(llm, hf_base, random_prompts) -> None:
    prompts = random_prompts([5, 40, 70], hf_base.config.vocab_size, seed=11)
    last = llm.embed(prompts, use_tqdm=False)  # the default: last token, normalized
    mean = llm.embed(prompts, PoolingParams(pooling_type="MEAN", normalize=False), use_tqdm=False)
    cls = llm.embed(prompts, PoolingParams(pooling_type="CLS"), use_tqdm=False)
    for prompt, a, b, c in zip(prompts, last, mean, cls):
        hidden = _hidden(hf_base, prompt)
        assert a.prompt_token_ids == prompt and a.finished
        _close(a.outputs.embedding, F.normalize(hidden[-1], dim=-1))
        _close(b.outputs.embedding, hidden.mean(0))
        _close(c.outputs.embedding, F.normalize(hidden[0], dim=-1))


def test_dimensions_truncate_then_normalize(llm, hf_base, random_prompts) -> None:
    prompt = random_prompts([33], hf_base.config.vocab_size, seed=12)[0]
    (out,) = llm.embed([prompt], PoolingParams(dimensions=8), use_tqdm=False)
    assert out.outputs.hidden_size == 8
    _close(out.outputs.embedding, F.normalize(_hidden(hf_base, prompt)[-1][:8], dim=-1))
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed([prompt], PoolingParams(dimensions=10_000), use_tqdm=False)


def test_embeddings_and_generation_share_steps(tiny_qwen3, hf_base, hf_greedy, random_prompts):
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3), dtype=torch.float32).eval()
    vocab = hf_base.config.vocab_size
    gen_prompts = random_prompts([30, 9], vocab, seed=13)
    emb_prompts = random_prompts([50, 3, 21], vocab, seed=14)
    engine = LLMEngine(model=str(tiny_qwen3), max_num_seqs=8, **CHUNKED)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6)
    mean = PoolingParams(pooling_type="MEAN")
    for i, p in enumerate(gen_prompts):
        engine.add_request(f"g{i}", p, greedy)
    for i, p in enumerate(emb_prompts):
        engine.add_request(f"e{i}", p, mean)
    tokens: dict[str, list[int]] = {}
    vectors: dict[str, list[float]] = {}
    mixed_steps = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        kinds = {type(o) for o in outs}
        mixed_steps += len(kinds) == 2
        for o in outs:
            if isinstance(o, EmbeddingRequestOutput):
                assert o.finish_reason == "stop"
                vectors[o.request_id] = o.outputs.embedding
            else:
                tokens.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
    assert mixed_steps >= 1  # an embedding finished in a step that also sampled tokens
    for i, p in enumerate(gen_prompts):
        assert tokens[f"g{i}"] == hf_greedy(lm, p, 6)
    for i, p in enumerate(emb_prompts):
        _close(vectors[f"e{i}"], F.normalize(_hidden(hf_base, p).mean(0), dim=-1))
    assert engine.get_stats().kv_cache_usage == 0.0


def test_prefix_cache_hits_and_mean_pooling(tiny_qwen3, hf_base, random_prompts) -> None:
    """LAST pooling may reuse cached prompt blocks (the last token is always recomputed);
    MEAN must see every position, so it computes its whole prompt despite a warm cache."""
    llm = LLM(str(tiny_qwen3), **CHUNKED)
    prompt = random_prompts([48], hf_base.config.vocab_size, seed=15)[0]
    hidden = _hidden(hf_base, prompt)
    llm.embed([prompt], use_tqdm=False)  # warms the cache
    (last,) = llm.embed([prompt], use_tqdm=False)
    assert last.num_cached_tokens >= 32
    _close(last.outputs.embedding, F.normalize(hidden[-1], dim=-1))
    (mean,) = llm.embed([prompt], PoolingParams(pooling_type="MEAN"), use_tqdm=False)
    assert mean.num_cached_tokens == 0
    _close(mean.outputs.embedding, F.normalize(hidden.mean(0), dim=-1))


def test_truncation_and_context_limit(tiny_qwen3, hf_base, random_prompts) -> None:
    llm = LLM(str(tiny_qwen3), max_model_len=64, **CHUNKED)
    prompt = random_prompts([80], hf_base.config.vocab_size, seed=16)[0]
    with pytest.raises(ValueError, match="maximum context length is 64"):
        llm.embed([prompt], use_tqdm=False)
    (out,) = llm.embed([prompt], truncate_prompt_tokens=20, use_tqdm=False)
    assert out.prompt_token_ids == prompt[-20:]
    _close(out.outputs.embedding, F.normalize(_hidden(hf_base, prompt[-20:])[-1], dim=-1))
    (whole,) = llm.embed([prompt[:64]], use_tqdm=False)  # a prompt may fill the context
    assert len(whole.prompt_token_ids) == 64


def test_sentence_transformers_defaults_and_runner(tmp_path, build_tiny_model, random_prompts):
    """modules.json + 1_Pooling/config.json set the defaults (here: mean, not normalized);
    --pooler-config overrides them; runner "generate"/"pooling" refuse the other kind."""
    folder = tmp_path / "st"
    build_tiny_model(folder, "llama", seed=3)
    (folder / "modules.json").write_text(
        json.dumps(
            [
                {
                    "idx": 0,
                    "name": "0",
                    "path": "",
                    "type": "sentence_transformers.models.Transformer",
                },
                {
                    "idx": 1,
                    "name": "1",
                    "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling",
                },
            ]
        )
    )
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False})
    )
    from transformers import AutoModel

    base = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    prompt = random_prompts([20], base.config.vocab_size, seed=17)[0]
    hidden = _hidden(base, prompt)
    llm = LLM(str(folder), runner="pooling", **CHUNKED)
    (out,) = llm.embed([prompt], use_tqdm=False)
    _close(out.outputs.embedding, hidden.mean(0))
    with pytest.raises(ValueError, match="embeddings only"):
        llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    llm = LLM(str(folder), pooler_config='{"pooling_type": "LAST", "normalize": true}', **CHUNKED)
    (out,) = llm.embed([prompt], use_tqdm=False)
    _close(out.outputs.embedding, F.normalize(hidden[-1], dim=-1))
    llm = LLM(str(folder), runner="generate", **CHUNKED)
    with pytest.raises(ValueError, match="runner='generate'"):
        llm.embed([prompt], use_tqdm=False)


# ---- prompt logprobs -------------------------------------------------------------------


def _reference_logprobs(lm, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(lm(torch.tensor([prompt])).logits[0].float(), dim=-1)


def _check_prompt_logprobs(entries, prompt, reference, k) -> None:
    assert entries is not None and len(entries) == len(prompt)
    assert entries[0] is None
    for i in range(1, len(prompt)):
        row = reference[i - 1]
        entry = entries[i]
        assert next(iter(entry)) == prompt[i]  # the prompt's own token first
        assert entry[prompt[i]] == pytest.approx(row[prompt[i]].item(), abs=2e-5)
        top = row.topk(k)
        for t, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[t] == pytest.approx(lp, abs=2e-5)
        assert len(entry) in (k, k + 1)


def test_prompt_logprobs_match_hf(tiny_qwen3, random_prompts) -> None:
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3), dtype=torch.float32).eval()
    llm = LLM(str(tiny_qwen3), **CHUNKED)
    prompts = random_prompts([1, 2, 17, 45], lm.config.vocab_size, seed=18)
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=4)
    # Twice: the second run must not let prefix-cache hits skip prompt positions.
    for _ in range(2):
        outs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            _check_prompt_logprobs(out.prompt_logprobs, prompt, _reference_logprobs(lm, prompt), 4)
            assert len(out.outputs[0].token_ids) == 3
    (plain,) = llm.generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)
    assert plain.prompt_logprobs is None
    # n > 1: computed once, for the request.
    (many,) = llm.generate(
        [prompts[2]], SamplingParams(n=2, max_tokens=2, prompt_logprobs=0), use_tqdm=False
    )
    ref = _reference_logprobs(lm, prompts[2])
    assert [next(iter(e)) for e in many.prompt_logprobs[1:]] == prompts[2][1:]
    for i, e in enumerate(many.prompt_logprobs[1:], start=1):
        assert len(e) == 1
        assert e[prompts[2][i]] == pytest.approx(ref[i - 1, prompts[2][i]].item(), abs=2e-5)


def test_prompt_logprobs_stream_once(tiny_qwen3, random_prompts) -> None:
    engine = LLMEngine(model=str(tiny_qwen3), **CHUNKED)
    prompt = random_prompts([40], 300, seed=19)[0]
    engine.add_request("s", prompt, SamplingParams(max_tokens=4, prompt_logprobs=1))
    seen = []
    while engine.has_unfinished_requests():
        seen += [o.prompt_logprobs for o in engine.step()]
    assert sum(p is not None for p in seen) == 1
    assert seen[0] is not None and len(seen[0]) == 40  # with the first token


def test_prompt_logprobs_validation() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


@pytest.mark.slow
def test_tensor_parallel_pooling_and_prompt_logprobs(tiny_qwen3, hf_base, random_prompts):
    """Under TP=2 the prompt-logprob rows are gathered like the sampled ones and rank 0
    pools its own (replicated) hidden states."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3), dtype=torch.float32).eval()
    prompts = random_prompts([37, 6], hf_base.config.vocab_size, seed=20)
    llm = LLM(str(tiny_qwen3), tensor_parallel_size=2, **CHUNKED)
    try:
        outs = llm.embed(prompts, PoolingParams(pooling_type="MEAN"), use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            _close(out.outputs.embedding, F.normalize(_hidden(hf_base, prompt).mean(0), dim=-1))
        params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
        for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
            _check_prompt_logprobs(out.prompt_logprobs, prompt, _reference_logprobs(lm, prompt), 2)
    finally:
        llm.shutdown()


def test_protocol_round_trip() -> None:
    """What a core process receives and sends back survives msgpack."""
    from pagemill.runtime.engine.protocol import (
        Codec,
        EngineCoreOutput,
        EngineCoreOutputs,
        EngineCoreRequest,
    )

    codec = Codec()
    params = PoolingParams(pooling_type="MEAN", normalize=True, dimensions=4)
    request = EngineCoreRequest(
        "e",
        [1, 2, 3],
        SamplingParams(temperature=0.0, max_tokens=1),
        1,
        None,
        [],
        0.5,
        pooling_params=params,
    )
    back = codec.decode(codec.encode(request))
    assert back == request and back.pooling_params == params
    out = EngineCoreOutputs(
        [
            EngineCoreOutput("e", [], pooled=[0.5, -0.25]),
            EngineCoreOutput("g", [7], prompt_logprobs=([[3, 1]], [[-0.5, -0.1]], [2])),
        ]
    )
    assert codec.decode(codec.encode(out)) == out


def test_preempted_requests_recompute_prompt_outputs(tiny_qwen3, hf_base, random_prompts):
    """A pool too small for the batch preempts requests mid-prompt and mid-generation: the
    recomputed prompt must give the same vectors and prompt logprobs, delivered once."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3), dtype=torch.float32).eval()
    vocab = hf_base.config.vocab_size
    # 2 (K, V) x 2 layers x 2 KV heads x head_dim 128 x 4 bytes = 4 KiB a token: 8 blocks.
    kwargs = {**CHUNKED, "kv_cache_memory_bytes": 8 * 16 * 4096}
    engine = LLMEngine(model=str(tiny_qwen3), max_model_len=128, **kwargs)
    gen_prompts = random_prompts([40, 30], vocab, seed=21)
    emb_prompts = random_prompts([45, 38], vocab, seed=22)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=25, prompt_logprobs=1)
    for i, p in enumerate(gen_prompts):
        engine.add_request(f"g{i}", p, params)
    for i, p in enumerate(emb_prompts):
        engine.add_request(f"e{i}", p, PoolingParams(pooling_type="MEAN"))
    prompt_logprobs: dict[str, list] = {}
    vectors = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if isinstance(o, EmbeddingRequestOutput):
                vectors[o.request_id] = o.outputs.embedding
            elif o.prompt_logprobs is not None:
                assert o.request_id not in prompt_logprobs
                prompt_logprobs[o.request_id] = o.prompt_logprobs
    assert engine.get_stats().num_preemptions > 0
    for i, p in enumerate(gen_prompts):
        _check_prompt_logprobs(prompt_logprobs[f"g{i}"], p, _reference_logprobs(lm, p), 1)
    for i, p in enumerate(emb_prompts):
        _close(vectors[f"e{i}"], F.normalize(_hidden(hf_base, p).mean(0), dim=-1))


def test_engine_config_runner_convert_and_pooler_config() -> None:
    from pagemill.runtime import EngineConfig

    assert EngineConfig().runner == "auto"
    assert EngineConfig(convert="embed").runner == "pooling"
    with pytest.raises(ValueError, match="runner='generate'"):
        EngineConfig(convert="embed", runner="generate")
    with pytest.raises(ValueError, match="runner"):
        EngineConfig(runner="draft")
    with pytest.raises(ValueError, match="not JSON"):
        EngineConfig(pooler_config="{mean}")
    with pytest.raises(ValueError, match="unsupported key"):
        EngineConfig(pooler_config='{"softmax": true}')
    with pytest.raises(ValueError, match="pooling_type"):
        EngineConfig(pooler_config='{"pooling_type": "STEP"}')
    assert EngineConfig.from_kwargs(pooler_config='{"pooling_type": "cls"}').pooler_config
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        PoolingParams(truncate_prompt_tokens=0)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_embedding_checkpoint_without_lm_head(
    tp, tmp_path, build_tiny_model, random_prompts
) -> None:
    """gte-Qwen2 / Qwen3-Embedding style: the base model's weights (no "model." prefix, no
    LM head) under a *ForCausalLM config. A pooling engine loads it (on every rank under
    tensor parallelism); others refuse it."""
    from transformers import AutoModel

    source = tmp_path / "lm"
    build_tiny_model(source, "qwen2", seed=4, tie_word_embeddings=False)
    base = AutoModel.from_pretrained(str(source), dtype=torch.float32).eval()
    folder = tmp_path / "embedder"
    base.save_pretrained(str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).is_file():
            (folder / name).write_bytes((source / name).read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["Qwen2ForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    prompt = random_prompts([25], base.config.vocab_size, seed=23)[0]
    if tp == 1:
        with pytest.raises(ValueError, match="lm_head"):
            LLM(str(folder), **CHUNKED)
    llm = LLM(str(folder), convert="embed", tensor_parallel_size=tp, **CHUNKED)
    try:
        (out,) = llm.embed([prompt], use_tqdm=False)
        _close(out.outputs.embedding, F.normalize(_hidden(base, prompt)[-1], dim=-1))
    finally:
        llm.shutdown()


def test_prompt_logprobs_of_a_long_chunk(tiny_qwen3, random_prompts) -> None:
    """One 300-token chunk: its logits are computed a slice of rows at a time."""
    from transformers import AutoModelForCausalLM

    from pagemill.runtime.worker import pooler

    lm = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3), dtype=torch.float32).eval()
    prompt = random_prompts([300], lm.config.vocab_size, seed=24)[0]
    assert len(prompt) > pooler._LOGPROB_SLICE
    llm = LLM(str(tiny_qwen3), **{**CHUNKED, "max_num_batched_tokens": 512})
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)
    _check_prompt_logprobs(out.prompt_logprobs, prompt, _reference_logprobs(lm, prompt), 3)
