"""EAGLE / EAGLE-3 speculation: heads saved in vLLM's checkpoint layout, loaded through
`speculative_config`, with greedy output checked token for token against transformers.

How the tests get acceptance (no trained head exists here): the target is a tiny random
Llama with small weights, its embedding rows scaled to unit RMS (so its first input norm,
weight one, is an identity), and the "mirror" heads are built from the target's own
weights. The EAGLE-1 mirror's `fc` passes the token embedding through and its layers are
the target's, so at position p it computes the target's pre-norm state at p + 1 (attending
to every earlier token but the first). The EAGLE-3 mirror has one more layer in front that
copies the normed embedding through attention (q = k = a scaled identity, so each position
attends to itself; v and o_proj identities; no MLP; its hidden input normed to zero), then
the target's layers, norm and LM head, the head's rows permuted and undone by `d2t`. Such
heads agree with the target most of the time, not always; the random heads agree rarely.
Either way the output must be the target's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pagemill.runtime import LLM, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)
H, HEADS, INTER = 64, 4, 128


@pytest.fixture(scope="module")
def target(build_tiny_model, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("eagle-target")
    # Smaller weights than the shared fixtures': a prediction that hangs on the first token
    # (which an EAGLE head never attends to) would make the mirror heads disagree often.
    model = build_tiny_model(
        folder, "llama", seed=5, num_key_value_heads=HEADS, initializer_range=0.05
    )
    with torch.no_grad():
        e = model.model.embed_tokens.weight
        e.div_(e.pow(2).mean(-1, keepdim=True).sqrt())
    model.save_pretrained(str(folder))
    return folder, model


def _config(model: torch.nn.Module, arch: str, layers: int, **extra) -> dict:
    c = model.config
    return {
        "architectures": [arch],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": INTER,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": False,
        **extra,
    }


def _save(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return str(folder)


def _target_layer(model: torch.nn.Module, i: int, as_index: int, prefix: str = "") -> dict:
    sd = model.model.layers[i].state_dict()
    return {f"{prefix}layers.{as_index}.{k}": v.clone() for k, v in sd.items()}


def _random_layer(i: int, qkv_in: int, gen: torch.Generator) -> dict:
    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.1

    p = f"layers.{i}."
    return {
        p + "self_attn.q_proj.weight": r(H, qkv_in),
        p + "self_attn.k_proj.weight": r(H, qkv_in),
        p + "self_attn.v_proj.weight": r(H, qkv_in),
        p + "self_attn.o_proj.weight": r(H, H),
        p + "mlp.gate_proj.weight": r(INTER, H),
        p + "mlp.up_proj.weight": r(INTER, H),
        p + "mlp.down_proj.weight": r(H, INTER),
        p + "input_layernorm.weight": torch.ones(H),
        p + "post_attention_layernorm.weight": torch.ones(H),
    }


def eagle1_mirror(model: torch.nn.Module, folder: Path) -> str:
    t = {"fc.weight": torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1)}
    for i in range(2):
        t.update(_target_layer(model, i, i))
    del t["layers.0.input_layernorm.weight"]  # EAGLE's first layer has none
    return _save(folder, _config(model, "EagleLlamaForCausalLM", 2), t)


def eagle1_random(model: torch.nn.Module, folder: Path) -> str:
    gen = torch.Generator().manual_seed(7)
    t = {"fc.weight": torch.randn(H, 2 * H, generator=gen) * 0.1, "fc.bias": torch.zeros(H)}
    t.update(_random_layer(0, H, gen))
    del t["layers.0.input_layernorm.weight"]
    return _save(folder, _config(model, "LlamaForCausalLM", 1), t)


def eagle3_mirror(model: torch.nn.Module, folder: Path, scale: float = 4.0) -> str:
    vocab = model.config.vocab_size
    eye, zero = torch.eye(H), torch.zeros(H, H)
    first = torch.cat([eye, zero], dim=1)
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(3))
    t = {
        "fc.weight": torch.zeros(H, 3 * H),
        "midlayer.self_attn.q_proj.weight": scale * first,
        "midlayer.self_attn.k_proj.weight": scale * first,
        "midlayer.self_attn.v_proj.weight": first,
        "midlayer.self_attn.o_proj.weight": eye,
        "midlayer.mlp.gate_proj.weight": torch.zeros(INTER, H),
        "midlayer.mlp.up_proj.weight": torch.zeros(INTER, H),
        "midlayer.mlp.down_proj.weight": torch.zeros(H, INTER),
        "midlayer.input_layernorm.weight": torch.ones(H),
        "midlayer.hidden_norm.weight": torch.zeros(H),  # the fused hidden reads as zero
        "midlayer.post_attention_layernorm.weight": torch.ones(H),
        "norm.weight": model.model.norm.weight.detach().clone(),
        "lm_head.weight": model.lm_head.weight.detach()[perm].clone(),
        "d2t": perm - torch.arange(vocab),
        "t2d": torch.ones(vocab, dtype=torch.bool),
    }
    for i in range(2):
        t.update(_target_layer(model, i, i + 1))
    config = _config(
        model,
        "LlamaForCausalLMEagle3",
        3,
        draft_vocab_size=vocab,
        target_hidden_size=H,
        norm_before_residual=True,
        eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 1]},
    )
    return _save(folder, config, t)


def eagle3_random(model: torch.nn.Module, folder: Path, draft_vocab: int = 40, d2t=True) -> str:
    gen = torch.Generator().manual_seed(11)
    vocab = model.config.vocab_size
    t = _random_layer(0, 2 * H, gen)
    t = {k.replace("layers.0.", "midlayer."): v for k, v in t.items()}
    t["midlayer.hidden_norm.weight"] = torch.ones(H)
    t["fc.weight"] = torch.randn(H, 3 * H, generator=gen) * 0.1
    t["norm.weight"] = torch.ones(H)
    t["lm_head.weight"] = torch.randn(draft_vocab, H, generator=gen)
    if d2t:
        ids = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
        t["d2t"] = ids - torch.arange(draft_vocab)
    config = _config(
        model, "Eagle3LlamaForCausalLM", 1, draft_vocab_size=draft_vocab,
        eagle_aux_hidden_state_layer_ids=[1, 0, 1],
    )  # fmt: skip
    return _save(folder, config, t)


def _llm(target_folder: Path, method: str, head: str, k: int = 3, **kw) -> LLM:
    kw.setdefault("kv_cache_memory_bytes", 4 << 20)
    kw.setdefault("max_num_batched_tokens", 32)
    return LLM(
        str(target_folder),
        dtype="float32",
        speculative_config={"method": method, "model": head, "num_speculative_tokens": k},
        **kw,
    )


def _greedy_equal(llm, model, prompts, max_tokens, hf_greedy) -> None:
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, **GREEDY), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, max_tokens)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_mirror_head_accepts_most_drafts_and_output_is_the_targets(
    method, target, hf_greedy, random_prompts, tmp_path
) -> None:
    folder, model = target
    build = eagle1_mirror if method == "eagle" else eagle3_mirror
    llm = _llm(folder, method, build(model, tmp_path / "head"))
    prompts = random_prompts([9, 30, 5, 41], model.config.vocab_size, seed=8)
    _greedy_equal(llm, model, prompts, 24, hf_greedy)
    stats = llm.llm_engine.get_stats()
    assert stats.spec_num_draft_tokens > 0
    assert stats.spec_num_accepted_tokens > 0.5 * stats.spec_num_draft_tokens
    assert stats.kv_cache_usage == 0.0


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_random_head_output_is_the_targets_chunked_and_prefix_cached(
    method, target, hf_greedy, random_prompts, tmp_path
) -> None:
    """Batched, prompts chunked by a 16-token budget, then again as prefix-cache hits (the
    head then sees no target features for the cached blocks)."""
    folder, model = target
    build = eagle1_random if method == "eagle" else eagle3_random
    llm = _llm(
        folder, method, build(model, tmp_path / "head"), max_num_batched_tokens=16,
        enable_prefix_caching=True,
    )  # fmt: skip
    prompts = random_prompts([9, 35, 5, 41], model.config.vocab_size, seed=9)
    _greedy_equal(llm, model, prompts, 16, hf_greedy)
    hits = llm.llm_engine.get_stats().prefix_cache_hits
    _greedy_equal(llm, model, prompts, 16, hf_greedy)
    stats = llm.llm_engine.get_stats()
    assert stats.prefix_cache_hits > hits
    assert stats.spec_num_draft_tokens > 0


def test_eagle3_survives_preemption(target, hf_greedy, random_prompts, tmp_path) -> None:
    folder, model = target
    head = eagle3_mirror(model, tmp_path / "head")
    # Target 2 layers x 4 KV heads x 16 x 2 x 4 bytes = 1024 B/token, head 3 layers: 1536.
    llm = _llm(folder, "eagle3", head, k=4, max_model_len=128,
               kv_cache_memory_bytes=8 * 16 * (1024 + 1536), max_num_batched_tokens=64)  # fmt: skip
    assert llm.llm_engine.num_blocks == 8
    prompts = random_prompts([30, 34, 52, 30], model.config.vocab_size, seed=4)
    _greedy_equal(llm, model, prompts, 40, hf_greedy)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.spec_num_accepted_tokens > 0


def test_head_pool_shares_the_kv_budget(target, tmp_path) -> None:
    folder, model = target
    budget = 1 << 20
    plain = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=budget)
    llm = _llm(folder, "eagle", eagle1_mirror(model, tmp_path / "head"),
               kv_cache_memory_bytes=budget)  # fmt: skip
    # Target 1024 B/token alone; with the 2-layer head's own pool, 2048 B/token in all.
    assert plain.llm_engine.num_blocks == budget // (16 * 1024)
    n = llm.llm_engine.num_blocks
    assert n == budget // (16 * 2048)
    proposer = llm.llm_engine.engine_core.spec.decoder.proposer
    target_pool = llm.llm_engine.engine_core.model_runner.kv_cache
    # The head's pool: the target's block ids, then one scratch block per sequence for the
    # drafts past the end of a table (k = 3), on top of an explicit budget.
    max_num_seqs = llm.llm_engine.engine_core.scheduler.config.max_num_seqs
    assert proposer.runner.kv_cache.num_blocks == n + max_num_seqs
    head_bytes = proposer.runner.kv_cache.nbytes * n // (n + max_num_seqs)
    assert head_bytes + target_pool.nbytes <= budget


def test_seeded_sampling_with_eagle3_repeats(target, random_prompts, tmp_path) -> None:
    folder, model = target
    llm = _llm(folder, "eagle3", eagle3_mirror(model, tmp_path / "head"))
    prompts = random_prompts([12, 20], model.config.vocab_size, seed=2)
    # A low temperature: this small-weight target's distributions are nearly flat at 0.8,
    # where a one-hot draft is seldom kept; here drafts are kept and rejected both.
    params = SamplingParams(max_tokens=20, temperature=0.08, top_k=20, seed=5, ignore_eos=True)

    def run() -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    first = run()
    assert run() == first
    stats = llm.llm_engine.get_stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


def test_refusals_name_the_problem(target, build_tiny_model, tmp_path) -> None:
    folder, model = target
    e1, e3 = eagle1_random(model, tmp_path / "e1"), eagle3_random(model, tmp_path / "e3")
    with pytest.raises(ValueError, match=r"is an eagle3 head.*set method 'eagle3'"):
        _llm(folder, "eagle", e3)
    no_map = eagle3_random(model, tmp_path / "no-d2t", d2t=False)
    with pytest.raises(ValueError, match="no d2t map"):
        _llm(folder, "eagle3", no_map)
    qwen3 = tmp_path / "qwen3"
    build_tiny_model(qwen3, "qwen3", num_key_value_heads=HEADS)
    with pytest.raises(ValueError, match=r"needs a Llama-family target.*Qwen3ForCausalLM"):
        _llm(qwen3, "eagle", e1)
    mistral = tmp_path / "mistral"
    build_tiny_model(mistral, "mistral", num_key_value_heads=HEADS, sliding_window=8)
    with pytest.raises(ValueError, match=r"sliding-window target \(MistralForCausalLM"):
        _llm(mistral, "eagle", e1)
    bad = json.loads((Path(e3) / "config.json").read_text())
    bad.pop("eagle_aux_hidden_state_layer_ids")  # vLLM's default (2, 1, -1) for 2 layers
    (Path(e3) / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"three target layer ids in \[0, 2\)"):
        _llm(folder, "eagle3", e3)
    with pytest.raises(ValueError, match="must name the EAGLE head"):
        _llm(folder, "eagle3", "")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_compiled_target_feeds_the_head(method, target, hf_greedy, random_prompts, tmp_path):
    """The target's compiled forward hands over its hidden states, and for EAGLE-3 the
    inputs of the head's target layers as a second output: the target stays compiled."""
    from pagemill.runtime.worker.compilation import ENFORCE_EAGER_ENV, compile_unavailable_reason

    reason = compile_unavailable_reason(torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)
    folder, model = target
    build = eagle1_mirror if method == "eagle" else eagle3_mirror
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(ENFORCE_EAGER_ENV, raising=False)
        llm = _llm(folder, method, build(model, tmp_path / "head"))
    runner = llm.llm_engine.engine_core.model_runner
    assert runner.compiled and runner._forward != runner.model.forward
    aux = runner.model.aux_hidden_state_layers
    assert aux == ((0, 1, 1) if method == "eagle3" else ())
    prompts = random_prompts([9, 30], model.config.vocab_size, seed=8)
    _greedy_equal(llm, model, prompts, 16, hf_greedy)
    stats = llm.llm_engine.get_stats()
    assert stats.spec_num_accepted_tokens > 0.5 * stats.spec_num_draft_tokens


def _drafts_and_stats(llm, prompt, max_tokens, expected) -> tuple[list, int, int, int]:
    """One greedy request: the drafts proposed after each step, and the accepted, drafted
    and prefix-hit token counts it added."""
    proposer = llm.llm_engine.engine_core.spec.decoder.proposer
    seen: list[dict[str, list[int]]] = []
    propose = proposer.propose_requests

    def record(*args):
        drafts = propose(*args)
        if drafts:
            seen.append(drafts)
        return drafts

    before = llm.llm_engine.get_stats()
    proposer.propose_requests = record
    try:
        params = SamplingParams(max_tokens=max_tokens, **GREEDY)
        [out] = llm.generate([prompt], params, use_tqdm=False)
    finally:
        del proposer.propose_requests
    assert out.outputs[0].token_ids == expected
    after = llm.llm_engine.get_stats()
    return (
        [list(d.values()) for d in seen],
        after.spec_num_accepted_tokens - before.spec_num_accepted_tokens,
        after.spec_num_draft_tokens - before.spec_num_draft_tokens,
        after.prefix_cache_hits - before.prefix_cache_hits,
    )


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_prefix_hit_reads_the_heads_kv_of_the_cached_blocks(
    method, target, hf_greedy, random_prompts, tmp_path
) -> None:
    """The head's KV lives in the target's blocks, so a request whose prompt is mostly a
    prefix-cache hit sees the head KV written when those blocks were computed: the same
    prompt again gets the same drafts at every step. The random heads read the target's
    features (a mirror head ignores them), so a head cache written without them (zeros
    where the target skipped the cached prefix) drafts differently."""
    folder, model = target
    build = eagle1_random if method == "eagle" else eagle3_random
    llm = _llm(folder, method, build(model, tmp_path / "head"), enable_prefix_caching=True)
    [prompt] = random_prompts([90], model.config.vocab_size, seed=12)
    expected = hf_greedy(model, prompt, 16)
    first, _, drafted, _ = _drafts_and_stats(llm, prompt, 16, expected)
    again, _, _, hits = _drafts_and_stats(llm, prompt, 16, expected)
    assert drafted > 0 and hits >= 80  # five of the prompt's six blocks
    assert again == first


def test_prefix_hit_keeps_the_mirror_heads_acceptance(
    target, hf_greedy, random_prompts, tmp_path
) -> None:
    folder, model = target
    llm = _llm(folder, "eagle", eagle1_mirror(model, tmp_path / "head"), enable_prefix_caching=True)
    [prompt] = random_prompts([90], model.config.vocab_size, seed=12)
    expected = hf_greedy(model, prompt, 24)
    _, accepted, drafted, _ = _drafts_and_stats(llm, prompt, 24, expected)
    assert drafted > 0 and accepted > 0.5 * drafted
    _, again, _, hits = _drafts_and_stats(llm, prompt, 24, expected)
    assert hits >= 80
    assert again >= accepted - 1


def _speculators(src: str, folder: Path, method: str) -> str:
    """The head at `src` in the speculators library's format: config nested under
    `transformer_layer_config` / `speculators_config`, EAGLE-1's `fusion_fc` and
    `transformer` names, EAGLE-3's `layers.0`."""
    from safetensors.torch import load_file

    config = json.loads((Path(src) / "config.json").read_text())
    tensors = load_file(str(Path(src) / "model.safetensors"))
    layer = {k: config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
             "num_key_value_heads", "vocab_size", "max_position_embeddings", "rms_norm_eps",
             "tie_word_embeddings")}  # fmt: skip
    layer.update(model_type="llama", num_hidden_layers=config["num_hidden_layers"])
    out = {
        "architectures": [f"{'Eagle3' if method == 'eagle3' else 'Eagle'}Speculator"],
        "speculators_model_type": method,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": method,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "target", "architectures": ["LlamaForCausalLM"]},
        },
    }
    if method == "eagle3":
        eagle = config.get("eagle_config") or {}
        aux = config.get("eagle_aux_hidden_state_layer_ids") or eagle.get(
            "eagle_aux_hidden_state_layer_ids"
        )
        out.update(
            draft_vocab_size=config["draft_vocab_size"],
            target_hidden_size=config.get("target_hidden_size", H),
            norm_before_residual=config.get("norm_before_residual", False),
            eagle_aux_hidden_state_layer_ids=aux,
        )
        tensors = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
    else:
        out["fusion_bias"] = "fc.bias" in tensors
        renamed = {}
        for k, v in tensors.items():
            k = k.replace("fc.", "fusion_fc.", 1) if k.startswith("fc.") else k
            renamed[k.replace("layers.0.", "transformer.", 1)] = v
        tensors = renamed
    return _save(folder, out, tensors)


def _pytorch_bin(src: str, folder: Path) -> str:
    """The head at `src` as the EAGLE repos ship it: config.json and pytorch_model.bin."""
    from safetensors.torch import load_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text((Path(src) / "config.json").read_text())
    torch.save(load_file(str(Path(src) / "model.safetensors")), folder / "pytorch_model.bin")
    return str(folder)


@pytest.mark.parametrize(
    "method,fmt", [("eagle", "speculators"), ("eagle3", "speculators"), ("eagle3", "bin")]
)
def test_checkpoint_formats_load_the_same_head(
    method, fmt, target, hf_greedy, random_prompts, tmp_path
) -> None:
    """A head saved in the speculators format or as pytorch_model.bin drafts exactly what
    the same head in vLLM's layout drafts (EAGLE-1 as a one-layer random head: the
    speculators format has one decoder layer)."""
    folder, model = target
    if method == "eagle":
        base = eagle1_random(model, tmp_path / "base")
    else:
        base = eagle3_mirror(model, tmp_path / "base")
    other = (
        _speculators(base, tmp_path / "other", method)
        if fmt == "speculators"
        else _pytorch_bin(base, tmp_path / "other")
    )
    [prompt] = random_prompts([20], model.config.vocab_size, seed=6)
    expected = hf_greedy(model, prompt, 12)
    drafts = []
    for head in (base, other):
        llm = _llm(folder, method, head)
        seen, _, drafted, _ = _drafts_and_stats(llm, prompt, 12, expected)
        assert drafted > 0
        drafts.append(seen)
    assert drafts[0] == drafts[1]


def test_checkpoint_refusals(target, tmp_path) -> None:
    import argparse

    folder, model = target
    base = eagle1_random(model, tmp_path / "base")
    hass = _speculators(base, tmp_path / "hass", "eagle")
    config = json.loads((Path(hass) / "config.json").read_text())
    (Path(hass) / "config.json").write_text(json.dumps({**config, "layernorms": True}))
    with pytest.raises(ValueError, match="HASS heads"):
        _llm(folder, "eagle", hass)
    (Path(hass) / "config.json").write_text(json.dumps({**config, "speculators_model_type": "mlp"}))
    with pytest.raises(ValueError, match="speculators_model_type 'mlp' is not an EAGLE head"):
        _llm(folder, "eagle", hass)
    pickled = Path(_pytorch_bin(base, tmp_path / "pickled"))
    state = torch.load(pickled / "pytorch_model.bin")
    torch.save({**state, "extra": argparse.Namespace(x=1)}, pickled / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"does not load as plain tensors \(torch.load with"):
        _llm(folder, "eagle", str(pickled))


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available()
    or __import__("os").environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
    reason="needs a CUDA device and compiled (not interpreted) Triton",
)
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_verify_steps_replay_cuda_graphs(method, target, hf_greedy, random_prompts, tmp_path):
    """On a GPU with graphs on, the verify steps (k + 1 tokens per request) replay their
    own graphs, whose hidden states (and EAGLE-3's layer inputs) feed the head: the same
    greedy tokens as transformers, and the mirror head's drafts still mostly accepted."""
    from pagemill.runtime.worker.compilation import ENFORCE_EAGER_ENV

    folder, model = target
    build = eagle1_mirror if method == "eagle" else eagle3_mirror
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(ENFORCE_EAGER_ENV, raising=False)
        llm = _llm(folder, method, build(model, tmp_path / "head"), device="cuda",
                   enforce_eager=False, max_num_seqs=8, max_num_batched_tokens=64,
                   max_model_len=128)  # fmt: skip
    graphs = llm.llm_engine.engine_core.model_runner.graphs
    assert graphs is not None and graphs.verify_buckets == [1, 2, 4, 8]
    prompts = random_prompts([9, 30, 5, 41, 12], model.config.vocab_size, seed=8)
    _greedy_equal(llm, model, prompts, 24, hf_greedy)
    assert graphs.verify_replays > 0
    stats = llm.llm_engine.get_stats()
    assert stats.spec_num_accepted_tokens > 0.5 * stats.spec_num_draft_tokens
