"""GGUF mixture-of-experts files served on CPU in bf16 keep their expert rows packed.

The fused op against a plain-torch reference (each token through its experts, one by one,
with the weights dequantized as the kernel reads them); tiny random Qwen3-MoE / OLMoE
models written as llama.cpp writes them (`test_gguf_moe.write_moe_gguf`) with Q4_0, Q8_0
or Q4_K experts: served packed, their logits and greedy tokens against the same file with
packed experts off (dequantized to dense bf16) and against transformers on the weights the
file holds; and the experts' resident bytes against the file's.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pagemill.kernels import fused_moe_int4_cpu, topk_softmax
from pagemill.runtime import LLM
from pagemill.runtime.model_executor.layers import Linear
from pagemill.runtime.model_executor.layers.fused_moe import FusedMoE
from pagemill.runtime.model_executor.quantization import weight_report
from pagemill.runtime.model_executor.quantization.formats import (
    Int4Groups,
    Int8Blocks,
    int4_planes,
    pack_int4,
)

_spec = importlib.util.spec_from_file_location(
    "gguf_moe_writer", Path(__file__).with_name("test_gguf_moe.py")
)
assert _spec is not None and _spec.loader is not None
_moe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_moe)

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
QT = gguf.GGMLQuantizationType


# ---- the op against a per-token reference ---------------------------------------------------


def _random_rows(kind: str, n: int, k: int, gen: torch.Generator) -> Int4Groups | Int8Blocks:
    scales = torch.rand(n, k // 32, generator=gen) * 0.02 + 0.005
    if kind == "int4":
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        zeros = (torch.rand(n, k // 32, generator=gen) - 0.5) * 0.05
        return Int4Groups(q, scales, zeros, 32, "Q4_1")
    q8 = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    return Int8Blocks(q8, scales * 0.1, 32, "Q8_0")


def _pack(experts: list[list[Int4Groups | Int8Blocks]]) -> tuple[Any, ...]:
    packed = [int4_planes(rows) for rows in experts]
    qs, szs = zip(*(pack_int4(q, s, z, torch.bfloat16) for q, s, z, _, _ in packed))
    return torch.stack(qs), torch.stack(szs), packed[0][3], packed[0][4]


# (gate, up, down): Q4_K_M files mix int4 gate/up with Q6_K (int8-block) down stacks.
KINDS = [
    ("int4", "int4", "int4"),
    ("int8", "int8", "int8"),
    ("int4", "int8", "int8"),
    ("int4", "int4", "int8"),
]


@pytest.mark.parametrize("kinds", KINDS)
@pytest.mark.parametrize("one_expert", [False, True])
def test_fused_moe_int4_matches_a_per_token_loop(kinds, one_expert) -> None:
    """Every token through its top-k experts one at a time, the weights dequantized with
    the scales in bf16 (what the kernel reads), products in fp32."""
    gen = torch.Generator().manual_seed(0)
    e, h, inter, t, k = 6, 64, 32, 9, 2
    gate_kind, up_kind, down_kind = kinds
    w13_rows = [
        [_random_rows(gate_kind, inter, h, gen), _random_rows(up_kind, inter, h, gen)]
        for _ in range(e)
    ]
    w2_rows = [[_random_rows(down_kind, h, inter, gen)] for _ in range(e)]
    q13, sz13, g13, p13 = _pack(w13_rows)
    q2, sz2, g2, p2 = _pack(w2_rows)
    x = torch.randn(t, h, generator=gen).bfloat16()
    logits = torch.randn(t, e, generator=gen)
    if one_expert:  # every token's top pick is expert 3
        logits[:, 3] += 10
    weights, ids = topk_softmax(logits, k, True)

    got = fused_moe_int4_cpu(x, q13, sz13, q2, sz2, weights, ids, [g13, g2], [p13, p2])
    op = torch.ops.pagemill.fused_moe_int4(
        x, q13, sz13, q2, sz2, weights, ids, [g13, g2], [p13, p2]
    )
    assert torch.equal(got, op)

    w13 = [torch.cat([r.dequantize(torch.bfloat16) for r in rows]).float() for rows in w13_rows]
    w2 = [rows[0].dequantize(torch.bfloat16).float() for rows in w2_rows]
    want = torch.zeros(t, h)
    for i in range(t):
        for j in range(k):
            ex = int(ids[i, j])
            gate_up = (x[i].float() @ w13[ex].T).bfloat16().float()
            act = (torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]).bfloat16()
            want[i] += float(weights[i, j]) * (act.float() @ w2[ex].T).bfloat16().float()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


# ---- whole models from GGUF files -----------------------------------------------------------


def _q4_k_blocks(data: np.ndarray) -> np.ndarray:
    """Random Q4_K blocks shaped like `data` (the `gguf` package cannot quantize Q4_K): nibbles
    and 6-bit scales/mins random, d and dmin fp16 fields giving weights of about N(0, 0.05)."""
    rng = np.random.default_rng(int(data.size) % 1000)
    *lead, k = data.shape
    rows = int(np.prod(lead))
    raw = rng.integers(0, 256, (rows, k // 256, 144), dtype=np.uint8)
    for at, scale in ((0, 2e-3), (2, 1e-3)):
        values = np.abs(rng.standard_normal((rows, k // 256, 1)) * scale).astype(np.float16)
        raw[..., at : at + 2] = values.view(np.uint8)
    return raw.reshape(*lead, -1)


QWEN3_MOE = dict(_moe.QWEN3_MOE, num_hidden_layers=2)
# case -> (HF family, GGUF arch, file type, Q4_K experts?, tiny config, planes of w13 / w2)
CASES: dict[str, tuple[str, str, Any, bool, dict[str, Any], list[int]]] = {
    "qwen3moe-Q4_0": ("qwen3_moe", "qwen3moe", QT.Q4_0, False, QWEN3_MOE, [1, 1]),
    "qwen3moe-Q8_0": ("qwen3_moe", "qwen3moe", QT.Q8_0, False, QWEN3_MOE, [2, 2]),
    # Q4_K rows are 256 long: hidden and expert intermediate sizes of 256.
    "qwen3moe-Q4_K": (
        "qwen3_moe",
        "qwen3moe",
        QT.Q8_0,
        True,
        dict(QWEN3_MOE, hidden_size=256, moe_intermediate_size=256, num_attention_heads=4),
        [1, 1],
    ),
    "mixtral-Q4_0": (
        "mixtral",
        "llama",
        QT.Q4_0,
        False,
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
        [1, 1],
    ),
    "olmoe-Q4_0": (
        "olmoe",
        "olmoe",
        QT.Q4_0,
        False,
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
            norm_topk_prob=False,
            num_hidden_layers=2,
        ),
        [1, 1],
    ),
}


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PAGEMILL_CACHE_DIR", str(tmp_path / "cache"))


def _expert_file_bytes(path: Path) -> int:
    reader = gguf.GGUFReader(str(path))
    return sum(int(t.n_bytes) for t in reader.tensors if "_exps." in t.name)


@pytest.mark.parametrize("key", list(CASES))
def test_packed_experts_generate_like_dense_ones(
    tmp_path, key, monkeypatch, build_tiny_model, random_prompts, all_logits
) -> None:
    family, arch, qtype, q4_k, overrides, planes = CASES[key]
    # The experts are what is held to transformers here: the attention layers keep PyTorch's
    # int4 kernel, whose bf16 activations stay within the bound below. int8 activations
    # (`gemv_q4`) move the router's inputs by more, and a tiny random MoE's router then
    # flips experts against the fp32 reference at whole positions.
    monkeypatch.setattr(Linear, "int8_activations", 0)
    hf_dir = tmp_path / "hf"
    build_tiny_model(hf_dir, family, seed=7, **overrides)
    path = tmp_path / "gguf" / f"tiny-{key}.gguf"
    path.parent.mkdir()
    blocks = (QT.Q4_K, _q4_k_blocks) if q4_k else None
    ref_dir = _moe.write_moe_gguf(hf_dir, path, family, arch, qtype, blocks)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(ref_dir), dtype=torch.float32
    ).eval()
    ref16 = copy.deepcopy(ref).to(torch.bfloat16)

    def serve() -> LLM:
        return LLM(
            str(path),
            dtype="bfloat16",
            kv_cache_memory_bytes=1 << 22,
            enforce_eager=True,
            cpu_dense_weights="never",
        )

    packed = serve()
    model = packed.llm_engine.engine_core.model_runner.model
    held = 0
    for layer in model.layers:
        experts = layer.mlp.experts
        assert experts.packed and experts.planes == planes, (experts.source, experts.planes)
        assert experts.w13_weight is None and experts.w2_weight is None
        held += experts.packed_nbytes()
    # Resident expert bytes are the file's: 4.5 -> 5 bits a weight for int4 groups of 32
    # (a bf16 scale and zero), 8.5 -> 10 for Q8_0's two planes.
    file_bytes = _expert_file_bytes(path)
    assert file_bytes <= held <= 1.2 * file_bytes, (held, file_bytes)
    report = weight_report(model)
    assert report.packed_bytes >= held and "experts" in report.summary()

    prompts = random_prompts([5, 23], ref.config.vocab_size, seed=4)
    runner = packed.llm_engine.engine_core.model_runner
    got_packed = all_logits(runner, prompts)
    out_packed = [o.outputs[0].token_ids for o in packed.generate(prompts, _moe.GREEDY)]
    del packed, model, runner

    monkeypatch.setattr(FusedMoE, "pack_gguf_experts", False)
    dense = serve()
    runner = dense.llm_engine.engine_core.model_runner
    assert runner.model.layers[0].mlp.experts.w13_weight.dtype == torch.bfloat16
    got_dense = all_logits(runner, prompts)
    out_dense = [o.outputs[0].token_ids for o in dense.generate(prompts, _moe.GREEDY)]

    ours: list[float] = []
    dense_err: list[float] = []
    theirs: list[float] = []
    apart: list[torch.Tensor] = []
    with torch.no_grad():
        for prompt, p, d in zip(prompts, got_packed, got_dense):
            want = ref(torch.tensor([prompt])).logits[0]
            ours.append(float((p.float() - want).abs().max()))
            dense_err.append(float((d.float() - want).abs().max()))
            half = ref16(torch.tensor([prompt])).logits[0].float()
            theirs.append(float((half - want).abs().max()))
            apart.append((p.float() - d.float()).abs().amax(dim=-1))
    # Packed and dense bf16 (the same weights; the kernel reads the scales in bf16) apart,
    # and each against transformers' fp32, within a small multiple of what transformers
    # errs in bf16 — the bound the dense models' packed layers are held to.
    bound = 2.5 * max(theirs)
    # A router near-tie may pick another expert at one position (bf16 inputs that differ in
    # the last bit): that one row is left out.
    flips = [int((rows > bound).sum()) for rows in apart]
    assert max(flips) <= 1, (apart, theirs)
    assert max(dense_err) <= bound, (dense_err, theirs)
    if not any(flips):
        assert max(ours) <= bound, (ours, theirs)
    assert out_packed == out_dense


@pytest.mark.slow  # a compile of the step
def test_packed_experts_in_a_compiled_step(tmp_path, build_tiny_model, random_prompts) -> None:
    """The compiled forward holds the packed experts as the opaque op: the same greedy
    tokens as eager steps."""
    family, arch, qtype, _, overrides, _ = CASES["qwen3moe-Q4_0"]
    build_tiny_model(tmp_path / "hf", family, seed=7, **overrides)
    path = tmp_path / "gguf" / "tiny.gguf"
    path.parent.mkdir()
    _moe.write_moe_gguf(tmp_path / "hf", path, family, arch, qtype)
    prompts = random_prompts([5, 23], 320, seed=4)  # the tiny tokenizer's vocabulary
    outs = []
    for eager in (True, False):
        llm = LLM(str(path), dtype="bfloat16", kv_cache_memory_bytes=1 << 22, enforce_eager=eager)
        assert llm.llm_engine.engine_core.model_runner.model.layers[0].mlp.experts.packed
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, _moe.GREEDY)])
    assert outs[0] == outs[1]
