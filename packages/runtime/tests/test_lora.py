"""Many LoRA adapters at once: greedy tokens against peft's merged model, on a tiny random
Llama with random adapters made by peft itself (different ranks, alphas, targets, rsLoRA)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pagemill.runtime import LLM, SamplingParams
from pagemill.runtime.lora import LoRARequest

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, targets, rslora)
ADAPTERS: dict[str, tuple[int, int, list[str], bool]] = {
    "all-r4": (4, 8, ALL, False),
    "qv-r8": (8, 32, ["q_proj", "v_proj"], False),
    "mlp-r16-rs": (16, 12, ["o_proj", "gate_proj", "up_proj", "down_proj"], True),
}


def make_adapter(
    base: torch.nn.Module,
    folder: Path,
    rank: int,
    alpha: int,
    targets,
    rslora,
    seed: int,
    **extra: Any,
) -> torch.nn.Module:
    """Save a random peft adapter for a copy of `base`; returns peft's merged model."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets,
        use_rslora=rslora,
        init_lora_weights=False,  # random A and B: the delta is not zero
        lora_dropout=0.0,
        **extra,
    )
    model = peft.get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():  # large enough to change greedy tokens
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    model.save_pretrained(str(folder))
    return model.merge_and_unload().eval()


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory, build_tiny_model):
    folder = tmp_path_factory.mktemp("lora-base")
    base = build_tiny_model(folder, "llama")
    merged, requests = {}, {}
    for i, (name, (r, alpha, targets, rs)) in enumerate(ADAPTERS.items()):
        path = tmp_path_factory.mktemp(f"adapter-{name}")
        merged[name] = make_adapter(base, path, r, alpha, targets, rs, seed=10 + i)
        requests[name] = LoRARequest(name, i + 1, str(path))
    return folder, base, merged, requests


def _engine(folder: Path, **kw: Any) -> LLM:
    opts: dict[str, Any] = dict(
        dtype="float32",
        enable_lora=True,
        max_loras=3,
        max_lora_rank=16,
        kv_cache_memory_bytes=4 << 20,
    )
    opts.update(kw)
    return LLM(str(folder), **opts)


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def test_each_adapter_and_the_base_in_one_batch_match_peft_merged(
    lora_setup, hf_greedy, random_prompts
) -> None:
    folder, base, merged, requests = lora_setup
    prompts = random_prompts([7, 19, 12, 30], base.config.vocab_size, seed=3)
    names = [None, *ADAPTERS]
    llm = _engine(folder)
    # Every prompt under every adapter and the base: all of it shares steps.
    jobs = [(p, n) for p in prompts for n in names]
    outs = llm.generate(
        [p for p, _ in jobs],
        GREEDY,
        use_tqdm=False,
        lora_request=[None if n is None else requests[n] for _, n in jobs],
    )
    seen_changed = set()
    for (prompt, name), out in zip(jobs, outs):
        want = hf_greedy(base if name is None else merged[name], prompt, 10)
        assert out.outputs[0].token_ids == want, (name, prompt)
        if name is not None and want != hf_greedy(base, prompt, 10):
            seen_changed.add(name)
    assert seen_changed == set(ADAPTERS)  # every adapter changed some answer: it is applied
    # The same requests run one adapter at a time give the same tokens.
    for name in ADAPTERS:
        alone = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests[name])
        mixed = [o for (_, n), o in zip(jobs, outs) if n == name]
        assert [o.outputs[0].token_ids for o in alone] == [o.outputs[0].token_ids for o in mixed]


def test_one_slot_three_adapters_evict_and_reload(lora_setup, hf_greedy, random_prompts) -> None:
    folder, base, merged, requests = lora_setup
    prompts = random_prompts([9, 14], base.config.vocab_size, seed=5)
    llm = _engine(folder, max_loras=1, max_cpu_loras=1)
    manager = llm.llm_engine.engine_core.model_runner.lora
    assert manager is not None
    order = [*ADAPTERS, *ADAPTERS]  # twice round: every adapter comes back after eviction
    for name in order:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests[name])
        for prompt, out in zip(prompts, outs):
            assert out.outputs[0].token_ids == hf_greedy(merged[name], prompt, 10), name
        assert list(manager.slot_of) == [requests[name].lora_int_id]
        assert len(manager.cpu) == 1
    # All three at once: the scheduler runs them one adapter at a time.
    jobs = [(p, n) for n in ADAPTERS for p in prompts]
    outs = llm.generate(
        [p for p, _ in jobs],
        GREEDY,
        use_tqdm=False,
        lora_request=[requests[n] for _, n in jobs],
    )
    for (prompt, name), out in zip(jobs, outs):
        assert out.outputs[0].token_ids == hf_greedy(merged[name], prompt, 10), name


def test_prefix_cache_is_never_shared_between_adapters(lora_setup, random_prompts) -> None:
    folder, base, _, requests = lora_setup
    prompt = random_prompts([50], base.config.vocab_size, seed=7)[0]
    llm = _engine(folder)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    a, b = requests["all-r4"], requests["qv-r8"]
    assert (
        llm.generate([prompt], one, use_tqdm=False, lora_request=a)[0].metrics.num_cached_tokens
        == 0
    )
    # Same adapter again: the prompt's full blocks hit (the test can see a hit).
    assert (
        llm.generate([prompt], one, use_tqdm=False, lora_request=a)[0].metrics.num_cached_tokens
        >= 32
    )
    assert (
        llm.generate([prompt], one, use_tqdm=False, lora_request=b)[0].metrics.num_cached_tokens
        == 0
    )
    assert llm.generate([prompt], one, use_tqdm=False)[0].metrics.num_cached_tokens == 0


def test_lora_request_without_enable_lora_is_refused(lora_setup) -> None:
    folder, _, _, requests = lora_setup
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=1 << 20)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=requests["all-r4"])


def _peft_folder(base, tmp_path: Path, **config: Any) -> Path:
    make_adapter(
        base, tmp_path, config.pop("r", 4), 8, config.pop("targets", ALL), False, seed=1, **config
    )
    return tmp_path


@pytest.mark.parametrize(
    ("kind", "match"),
    [
        ("dora", "DoRA"),
        ("rank", "exceeds max_lora_rank"),
        ("embed", "not supported"),
        ("modules_to_save", "modules_to_save"),
        ("bin", "adapter_model.safetensors"),
    ],
)
def test_unsupported_adapters_are_refused_by_name(lora_setup, tmp_path, kind, match) -> None:
    from pagemill.runtime.lora.peft import LoRAError, load_peft_adapter

    _, base, _, _ = lora_setup
    if kind == "dora":
        folder = _peft_folder(base, tmp_path, use_dora=True)
    elif kind == "rank":
        folder = _peft_folder(base, tmp_path, r=32)
    elif kind == "embed":
        folder = _peft_folder(base, tmp_path, targets=["q_proj", "embed_tokens"])
    elif kind == "modules_to_save":
        folder = _peft_folder(base, tmp_path, modules_to_save=["lm_head"])
    else:
        folder = _peft_folder(base, tmp_path)
        (folder / "adapter_model.safetensors").unlink()
    c = base.config
    shapes = {}
    for i in range(c.num_hidden_layers):
        kv = c.num_key_value_heads * c.hidden_size // c.num_attention_heads
        for name, fan in (
            ("q_proj", (c.hidden_size, c.hidden_size)),
            ("k_proj", (c.hidden_size, kv)),
            ("v_proj", (c.hidden_size, kv)),
            ("o_proj", (c.hidden_size, c.hidden_size)),
            ("gate_proj", (c.hidden_size, c.intermediate_size)),
            ("up_proj", (c.hidden_size, c.intermediate_size)),
            ("down_proj", (c.intermediate_size, c.hidden_size)),
        ):
            shapes[(i, name)] = fan
    with pytest.raises(LoRAError, match=match):
        load_peft_adapter("x", 1, str(folder), shapes, 16, torch.float32)
    json.loads((folder / "adapter_config.json").read_text())  # a real peft folder


def test_packed_base_weights_take_the_dense_delta() -> None:
    """An int4-packed Linear adds the same delta as a dense one (the adapter stays dense)."""
    from pagemill.runtime.lora.layers import LoRALayer, LoRAStepMapping
    from pagemill.runtime.model_executor.layers import Linear
    from pagemill.runtime.model_executor.quantization.scheme import WeightScheme

    torch.manual_seed(0)
    w = torch.randn(64, 128)
    x = torch.randn(5, 128)
    lin = Linear(128, 64, False, torch.float32)
    lin.scheme = WeightScheme("int4", group_size=32)
    lin.load_rows(0, w)
    assert lin.weight_format == "int4"
    base = lin(x)
    mapping = LoRAStepMapping(2, 16, torch.device("cpu"))
    lin.lora = LoRALayer(128, [64], 2, 8, mapping, torch.float32, torch.device("cpu"))
    a, b = torch.randn(4, 128), torch.randn(64, 4)
    lin.lora.set_slot(1, {0: (a, b)})
    mapping.set(torch.tensor([1, -1, 1, 0, -1]))
    got = lin(x)
    want = base.clone()
    want[[0, 2]] += x[[0, 2]] @ a.t() @ b.t()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_compiled_step_serves_adapters_and_base_together(
    lora_setup, hf_greedy, random_prompts, monkeypatch
) -> None:
    """The compiled CPU forward (adapters swapped in after compilation) gives peft's tokens."""
    from pagemill.runtime.worker.compilation import compile_unavailable_reason

    if compile_unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip("no compiled CPU step here")
    monkeypatch.setenv("PAGEMILL_ENFORCE_EAGER", "0")
    folder, base, merged, requests = lora_setup
    llm = _engine(folder, max_loras=2, enforce_eager=False)
    assert llm.llm_engine.engine_core.model_runner.compiled
    prompts = random_prompts([6, 21], base.config.vocab_size, seed=9)
    names = [None, *ADAPTERS]
    jobs = [(p, n) for p in prompts for n in names]
    outs = llm.generate(
        [p for p, _ in jobs],
        GREEDY,
        use_tqdm=False,
        lora_request=[None if n is None else requests[n] for _, n in jobs],
    )
    for (prompt, name), out in zip(jobs, outs):
        want = hf_greedy(base if name is None else merged[name], prompt, 10)
        assert out.outputs[0].token_ids == want, name


def test_lora_request_crosses_the_process_boundary() -> None:
    """The engine-core request record carries the adapter through msgpack (engine process)."""
    from pagemill.runtime.engine.protocol import Codec, EngineCoreRequest

    codec = Codec()
    lora = LoRARequest("sql", 3, "/adapters/sql")
    sent = EngineCoreRequest("r", [1, 2], SamplingParams(), 5, None, [], 0.0, lora_request=lora)
    got = codec.decode(codec.encode(sent))
    assert isinstance(got, EngineCoreRequest) and got.lora_request == lora
    plain = EngineCoreRequest("r", [1, 2], SamplingParams(), 5, None, [], 0.0)
    assert codec.decode(codec.encode(plain)).lora_request is None
    for bad in (("", 1, "/p"), ("a", 0, "/p"), ("a", 1, "")):
        with pytest.raises(ValueError, match="LoRARequest"):
            LoRARequest(*bad)
