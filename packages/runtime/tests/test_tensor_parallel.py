"""Tensor parallelism (gloo, 2 CPU processes): TP=2 greedy output equals TP=1's token for
token — with chunked prefill, prefix-cache hits and preemption in the mix — and a worker
that fails stops the engine with a clear error instead of hanging it.

Each TP=2 engine spawns a worker process (a few seconds on the shared CI box), so each
test builds one and drives it through everything it has to show. A process holds one
tensor-parallel engine at a time (torch.distributed's default group): every test shuts
its engine down before the next starts.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from pagemill.runtime import LLM, EngineConfig, SamplingParams
from pagemill.runtime.distributed import ShardLayout, TensorParallelError, check_tensor_parallel
from pagemill.runtime.model_config import ModelConfig

GREEDY = dict(temperature=0.0, ignore_eos=True)
BLOCK = 16
MAX_LEN = 160


def _bytes_per_token(folder: Path, tp: int) -> int:
    c = ModelConfig.from_pretrained(folder)
    kv_heads = max(1, c.num_key_value_heads // tp)
    return 2 * c.num_hidden_layers * kv_heads * c.head_dim * 4  # fp32


def _engine(folder: Path, tp: int) -> LLM:
    # A pool of 14 blocks on every rank (the budget is per rank: half the heads, half the
    # bytes): too few for the batch below, so requests are preempted and recomputed.
    return LLM(
        str(folder),
        tensor_parallel_size=tp,
        dtype="float32",
        block_size=BLOCK,
        max_model_len=MAX_LEN,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        kv_cache_memory_bytes=14 * BLOCK * _bytes_per_token(folder, tp),
    )


def _run(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _workload(vocab: int, random_prompts) -> tuple[list[list[int]], list[int]]:
    prefix = random_prompts([40], vocab, seed=11)[0]
    others = random_prompts([70, 9, 55, 23], vocab, seed=12)
    prompts = [[*prefix, 5], *others, [*prefix, 9, 8, 7], prefix[:33]]
    return prompts, [20, 30, 12, 40, 25, 18, 22]


def _break_worker(llm: LLM, how: str) -> None:
    core = llm.llm_engine.engine_core
    if how == "raises":
        # A command the worker cannot run makes it raise, log and exit with status 1.
        with core.tp.exclusive():
            core.tp.broadcast_object(("no such command",))
    else:
        os.kill(core._workers.processes[0].pid, signal.SIGKILL)


@pytest.mark.parametrize(("fixture", "fault"), [("tiny_llama", "raises"), ("tiny_qwen2", "dies")])
def test_tp2_equals_tp1_until_a_worker_fails(fixture, fault, request, random_prompts) -> None:
    """One TP=2 engine each (a worker start costs seconds): greedy equality with TP=1 first,
    then a worker that raises (Llama) or dies (Qwen2) stops the engine with a clear error."""
    folder, _ = request.getfixturevalue(fixture)
    vocab = ModelConfig.from_pretrained(folder).vocab_size
    prompts, max_tokens = _workload(vocab, random_prompts)
    # The shared prefix is cached by a first request, then hit by the batch.
    warm = [[*prompts[0][:40], 3]], [2]
    tp1 = _engine(folder, 1)
    assert tp1.llm_engine.engine_core.tp is None  # TP=1: no group, the single-device step
    expected = _run(tp1, *warm) + _run(tp1, prompts, max_tokens)
    tp2 = _engine(folder, 2)
    try:
        assert tp1.llm_engine.num_blocks == tp2.llm_engine.num_blocks == 14
        got = _run(tp2, *warm) + _run(tp2, prompts, max_tokens)
        assert got == expected, f"{fixture}: TP=2 diverged from TP=1"
        stats = tp2.llm_engine.get_stats()
        assert stats.num_preemptions > 0
        assert stats.prefix_cache_hits >= 32
        assert stats.kv_cache_usage == 0.0
        # Prompts of 40-71 tokens under a 32-token budget were prefilled in chunks.
        assert max(map(len, prompts)) > 32

        engine = tp2.llm_engine
        worker = engine.engine_core._workers.processes[0]
        _break_worker(tp2, fault)
        engine.add_request("after", prompts[1], SamplingParams(max_tokens=4, **GREEDY))
        code = 1 if fault == "raises" else -9
        start = time.monotonic()
        with pytest.raises(
            TensorParallelError,
            match=rf"worker rank 1 \(pid {worker.pid}\) exited with code {code}",
        ):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < 30
    finally:
        start = time.monotonic()
        tp2.shutdown()
        assert time.monotonic() - start < 15
    assert not worker.is_alive()


# ---- refused at start-up, before any process starts ---------------------------------------------


def test_tp_that_does_not_divide_the_heads_is_refused(tiny_llama) -> None:
    folder, _ = tiny_llama  # 4 heads, 2 KV heads
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=3 cannot split LlamaForCausalLM: "
        r"num_attention_heads=4 is not divisible by it.*"
        r"sizes that work: 1, 2, 4",
    ):
        LLM(str(folder), tensor_parallel_size=3, dtype="float32")
    assert not torch.distributed.is_initialized()


def test_quantized_tp_is_refused() -> None:
    with pytest.raises(ValueError, match="quantization='int8' with tensor_parallel_size=2"):
        EngineConfig(quantization="int8", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig(tensor_parallel_size=0)


# ---- the layout, without processes ---------------------------------------------------------------


def _config(heads: int, kv: int, inter: int = 128, vocab: int = 301) -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": vocab,
            "hidden_size": 8 * heads,
            "intermediate_size": inter,
            "num_hidden_layers": 1,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
        }
    )


def test_kv_heads_split_or_replicated() -> None:
    split = [ShardLayout.create(_config(8, 4), 2, r) for r in range(2)]
    assert [s.q_heads for s in split] == [(0, 4), (4, 4)]
    assert [s.kv_heads for s in split] == [(0, 2), (2, 2)]
    # 2 KV heads over 4 ranks: each is replicated on the two ranks whose queries read it.
    rep = [ShardLayout.create(_config(8, 2), 4, r) for r in range(4)]
    assert [s.q_heads for s in rep] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [s.kv_heads for s in rep] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    local = rep[3].local_config(_config(8, 2))
    assert (
        local.num_attention_heads,
        local.num_key_value_heads,
        local.intermediate_size,
        local.vocab_size,
    ) == (2, 1, 32, 76)  # 301 padded to 304 rows, 76 a rank


def test_whole_projection_qk_norms_shard_with_their_heads() -> None:
    """OLMo 2's q/k norm weights (one per q or k row) are cut as q/k are; per-head norms
    (Qwen3's, one head_dim each) stay whole."""
    c = _config(4, 2)
    hd = c.head_dim
    q_rows, k_rows = torch.arange(4.0 * hd), torch.arange(2.0 * hd)
    for rank in range(2):
        s = ShardLayout.create(c, 2, rank)
        q = s.shard("model.layers.0.self_attn.q_norm.weight", q_rows)
        k = s.shard("model.layers.0.self_attn.k_norm.weight", k_rows)
        assert torch.equal(q, s.shard("model.layers.0.self_attn.q_proj.weight", q_rows))
        assert torch.equal(k, s.shard("model.layers.0.self_attn.k_proj.weight", k_rows))
        assert q.shape[0] == 2 * hd and k.shape[0] == hd
        per_head = torch.arange(float(hd))
        assert torch.equal(s.shard("model.layers.0.self_attn.q_norm.weight", per_head), per_head)


def test_fused_and_split_checkpoints_shard_alike() -> None:
    """Phi-3's pre-fused qkv / gate_up rows cut to the same rows as separate q/k/v, gate/up."""
    c = _config(4, 2)
    hd, inter = c.head_dim, c.intermediate_size
    q, k, v = (torch.randn(n * hd, c.hidden_size) for n in (4, 2, 2))
    gate, up = torch.randn(inter, c.hidden_size), torch.randn(inter, c.hidden_size)
    for rank in range(2):
        s = ShardLayout.create(c, 2, rank)
        split = torch.cat(
            [
                s.shard("model.layers.0.self_attn.q_proj.weight", q),
                s.shard("model.layers.0.self_attn.k_proj.weight", k),
                s.shard("model.layers.0.self_attn.v_proj.weight", v),
            ]
        )
        fused = s.shard("model.layers.0.self_attn.qkv_proj.weight", torch.cat([q, k, v]))
        assert torch.equal(split, fused)
        assert torch.equal(
            s.shard("model.layers.0.mlp.gate_up_proj.weight", torch.cat([gate, up])),
            torch.cat(
                [s.shard("x.mlp.gate_proj.weight", gate), s.shard("x.mlp.up_proj.weight", up)]
            ),
        )
        bias = torch.ones(c.hidden_size)
        assert s.shard("x.self_attn.o_proj.bias", bias).sum().item() == (
            c.hidden_size if rank == 0 else 0
        )


def test_check_tensor_parallel_names_every_problem() -> None:
    check_tensor_parallel(_config(4, 2), 2)
    check_tensor_parallel(_config(4, 1), 4)  # one KV head replicated on every rank
    with pytest.raises(ValueError, match="intermediate_size=129 is not divisible"):
        check_tensor_parallel(_config(4, 2, inter=129), 2)
    with pytest.raises(ValueError, match="num_key_value_heads=3 is neither"):
        check_tensor_parallel(_config(6, 3), 2)


# ---- the other families (slow: one TP=2 engine each) ------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch", ["mistral", "qwen3", "phi3", "gemma2", "gemma3", "smollm3", "olmo2", "granite"]
)
def test_other_families_tp2_equals_tp1(arch, tmp_path, build_tiny_model, random_prompts) -> None:
    folder = tmp_path / arch
    extra: dict = {"sliding_window": 12} if arch in ("mistral", "gemma2", "gemma3") else {}
    if arch == "olmo2":  # one KV head on both ranks: its k-norm statistics counted twice
        extra = {"num_key_value_heads": 1, "attention_bias": True}
    if arch == "granite":
        extra = {"embedding_multiplier": 3.0, "residual_multiplier": 0.5, "logits_scaling": 2.5}
    if arch == "smollm3":
        extra = {"no_rope_layer_interval": 2}
    build_tiny_model(folder, arch, seed=2, **extra)
    vocab = ModelConfig.from_pretrained(folder).vocab_size
    prompts, max_tokens = _workload(vocab, random_prompts)
    expected = _run(_engine(folder, 1), prompts, max_tokens)
    tp2 = _engine(folder, 2)
    try:
        assert _run(tp2, prompts, max_tokens) == expected
    finally:
        tp2.shutdown()


# ---- mixture-of-experts ----------------------------------------------------------------------


def test_experts_shard_by_their_own_intermediate_size() -> None:
    """Expert and shared-expert rows/columns are cut by their own size (not the dense MLP's);
    the routers stay whole; an expert size the ranks do not divide is refused by name."""
    raw = {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 24,
        "shared_expert_intermediate_size": 40,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    layout = ShardLayout.create(ModelConfig.from_dict(raw), 2, 1)
    p = "model.layers.0.mlp."
    up = torch.arange(24 * 32.0).view(24, 32)
    assert torch.equal(layout.shard(p + "experts.3.up_proj.weight", up), up[12:])
    down = torch.arange(32 * 24.0).view(32, 24)
    assert torch.equal(layout.shard(p + "experts.0.down_proj.weight", down), down[:, 12:])
    shared = torch.arange(40 * 32.0).view(40, 32)
    assert torch.equal(layout.shard(p + "shared_expert.gate_proj.weight", shared), shared[20:])
    router = torch.randn(4, 32)
    assert layout.shard(p + "gate.weight", router) is router
    assert layout.shard(p + "shared_expert_gate.weight", router[:1]).shape == (1, 32)
    w2 = torch.arange(32 * 24.0).view(32, 24)
    mixtral = "model.layers.0.block_sparse_moe.experts.1.w2.weight"
    assert torch.equal(layout.shard(mixtral, w2), w2[:, 12:])
    with pytest.raises(ValueError, match="the experts' intermediate size 24"):
        check_tensor_parallel(ModelConfig.from_dict(raw), 16)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2_moe", "olmoe"])
def test_moe_tp2_equals_tp1(arch, tmp_path, build_tiny_model, random_prompts) -> None:
    """Experts split by intermediate size, the router replicated: TP=2 routes as TP=1."""
    folder = tmp_path / arch
    extra: dict = dict(num_experts=8, num_experts_per_tok=2)
    if arch == "qwen2_moe":
        extra |= dict(moe_intermediate_size=32, shared_expert_intermediate_size=48)
    else:
        extra |= dict(intermediate_size=32)
    build_tiny_model(folder, arch, seed=2, **extra)
    vocab = ModelConfig.from_pretrained(folder).vocab_size
    prompts, max_tokens = _workload(vocab, random_prompts)
    expected = _run(_engine(folder, 1), prompts, max_tokens)
    tp2 = _engine(folder, 2)
    try:
        assert _run(tp2, prompts, max_tokens) == expected
    finally:
        tp2.shutdown()
