"""CPU prefill attention: the native causal kernel and the batched SDPA call, against naive
attention, in mixed batches (fresh prompts, chunks extending a cached prefix, decode rows)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import pagemill.kernels.attention_cpu as attention_cpu
from pagemill.kernels import cpu_native, paged_attention, plan_attention

# The batches and the float64 reference of test_attention.py (tests import by path here).
_spec = importlib.util.spec_from_file_location(
    "_attention_helpers", Path(__file__).with_name("test_attention.py")
)
assert _spec is not None and _spec.loader is not None
_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_helpers)
make_batch, naive_attention, rel_err = (
    _helpers.make_batch,
    _helpers.naive_attention,
    _helpers.rel_err,
)

# (query lengths, context lengths): runs of equal fresh prompts (batched), a decode row in
# between, chunks over a cached prefix, a fresh prompt of another length, a long one.
MIXED = (
    [20, 20, 20, 1, 7, 20, 20, 5, 5, 33, 1, 40],
    [20, 20, 20, 9, 7, 20, 30, 5, 5, 70, 100, 40],
)
FRESH = ([32] * 6, [32] * 6)
LONG = ([300, 17], [300, 517])
GQA = [(4, 4), (9, 3), (8, 2)]


def _native_built() -> bool:
    return cpu_native.load() is not None and attention_cpu._prefill_lib() is not None


def _cpu_has_avx512_bf16() -> bool:
    """What the native prefill is built on (`prefill_cpu.cpp`); without it the kernel says so
    and SDPA serves every prefill."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return "avx512_bf16" in flags.split()


def _plan(batch):
    q, k_cache, _, tables, qsl, lens = batch
    return plan_attention(
        qsl, lens, tables, k_cache_shape=tuple(k_cache.shape), num_heads=q.shape[1], dtype=q.dtype
    )


@pytest.fixture(params=["amx", "vector"])
def native_prefill(request, monkeypatch):
    """The native kernel on the matrix units (where usable) and on the vector units; SDPA
    must not run (a prefill that fell back to it would fail the test)."""
    if not _native_built():
        pytest.skip("the native CPU kernels could not be built here")
    if not _cpu_has_avx512_bf16():
        pytest.skip("no AVX512-BF16 on this CPU: SDPA serves prefill here")
    if request.param == "vector":
        monkeypatch.setenv("PAGEMILL_CPU_PREFILL_AMX", "0")

    def forbidden(*args, **kwargs):
        raise AssertionError("SDPA ran: the native prefill did not serve the step")

    monkeypatch.setattr(attention_cpu.F, "scaled_dot_product_attention", forbidden)
    return request.param


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA)
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("lens", [MIXED, FRESH, LONG], ids=["mixed", "fresh", "long"])
def test_native_prefill_matches_naive(native_prefill, num_heads, num_kv_heads, head_dim, lens):
    batch = make_batch(1, *lens, num_heads, num_kv_heads, head_dim, dtype=torch.bfloat16)
    plan = _plan(batch)
    assert plan.impl.native_prefill is not None
    scale = head_dim**-0.5
    got = paged_attention(*batch, scale, plan=plan)
    ref = naive_attention(*batch, scale)
    assert rel_err(got, ref) < 1e-2


def test_native_prefill_reads_strided_q_and_out(native_prefill):
    """q as a slice of a fused qkv output and out as a slice of a wider buffer."""
    q, k_cache, v_cache, tables, qsl, lens = make_batch(2, *MIXED, 9, 3, 64, dtype=torch.bfloat16)
    qkv = torch.randn(q.shape[0], 15, 64).to(torch.bfloat16)
    qkv[:, :9] = q
    wide = torch.zeros(q.shape[0], 12, 64, dtype=torch.bfloat16)
    batch = (qkv[:, :9], k_cache, v_cache, tables, qsl, lens)
    paged_attention(*batch, 0.125, out=wide[:, 2:11], plan=_plan(batch))
    ref = naive_attention(q, k_cache, v_cache, tables, qsl, lens, 0.125)
    assert rel_err(wide[:, 2:11], ref) < 1e-2
    assert not wide[:, :2].any() and not wide[:, 11:].any()


def test_native_prefill_matches_sdpa_closely(native_prefill, monkeypatch):
    """Within bf16 rounding of the SDPA path's result (both round the weights to bf16)."""
    batch = make_batch(3, *MIXED, 9, 3, 64, dtype=torch.bfloat16)
    got = paged_attention(*batch, 0.125, plan=_plan(batch))
    monkeypatch.undo()
    monkeypatch.setenv("PAGEMILL_NATIVE_PREFILL", "0")
    sdpa = paged_attention(*batch, 0.125, plan=_plan(batch))
    assert (got.float() - sdpa.float()).abs().max().item() <= 2**-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA)
def test_batched_sdpa_prefill_matches_naive(monkeypatch, dtype, num_heads, num_kv_heads):
    """Without the native kernel: runs of equal fresh prompts share one SDPA call."""
    monkeypatch.setenv("PAGEMILL_NATIVE_PREFILL", "0")
    calls = []
    sdpa = F.scaled_dot_product_attention

    def counting(q, *args, **kwargs):
        calls.append(q.dim())
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(attention_cpu.F, "scaled_dot_product_attention", counting)
    batch = make_batch(4, *MIXED, num_heads, num_kv_heads, dtype=dtype)
    plan = _plan(batch)
    assert [(b.start, b.n, b.q_len) for b in plan.impl.batches] == [(0, 3, 20), (108, 2, 5)]
    got = paged_attention(*batch, 0.2, plan=plan)
    ref = naive_attention(*batch, 0.2)
    assert rel_err(got, ref) < {torch.float32: 1e-5}.get(dtype, 2e-2)
    # two batched calls, five single prefills (the decode rows go elsewhere)
    assert calls.count(4) == 2 and calls.count(3) == 5


def test_fp8_cache_keeps_the_torch_prefill():
    """An 8-bit cache is not the native kernel's: the plan carries it, the call declines."""
    if not _native_built():
        pytest.skip("the native CPU kernels could not be built here")
    if not _cpu_has_avx512_bf16():
        pytest.skip("no AVX512-BF16 on this CPU: SDPA serves prefill here")
    q, k_cache, v_cache, tables, qsl, lens = make_batch(5, *MIXED, 9, 3, 64, dtype=torch.bfloat16)
    k8, v8 = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    got = paged_attention(q, k8, v8, tables, qsl, lens, 0.125)
    ref = naive_attention(q, k8.to(torch.bfloat16), v8.to(torch.bfloat16), tables, qsl, lens, 0.125)
    assert rel_err(got, ref) < 2e-2


@pytest.mark.parametrize("name", ["PAGEMILL_NATIVE_PREFILL", "PAGEMILL_CPU_PREFILL_AMX"])
def test_prefill_switches_refuse_other_values(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A value the switches do not know is refused at import (a subprocess) and per read."""
    import subprocess
    import sys

    env = {**os.environ, name: "yes"}
    proc = subprocess.run(
        [sys.executable, "-c", "import pagemill.kernels.attention_cpu"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and f"{name} must be 0 or 1" in proc.stderr
    monkeypatch.setenv(name, "off")
    with pytest.raises(ValueError, match=f"{name} must be 0 or 1"):
        attention_cpu._switch(name)
    monkeypatch.setenv(name, "0")
    assert not attention_cpu._switch(name)
