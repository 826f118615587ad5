"""The native operators' C entry points for inductor's C++ wrapper (`cpu_native.c_shims`):
declared from the operators' schemas, exported by the loaded library, and called by a
compiled graph in place of `aoti_torch_call_dispatcher`, with the operators' own results
and errors."""

from __future__ import annotations

import ctypes
import os

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from pagemill.kernels import cpu_native
from pagemill.kernels import gemv_q4_cpu as g4
from pagemill.kernels import gemv_q8_cpu as g8

pytestmark = pytest.mark.skipif(
    not (cpu_native.load_gemv_ops() and cpu_native.load_attention_ops()),
    reason="no C++ compiler or torch headers for the operators",
)


def _native_op_names() -> set[str]:
    return {
        name.removeprefix("pagemill_native::")
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("pagemill_native::")
    }


def test_every_operator_of_the_library_has_an_exported_entry_point() -> None:
    # An operator added to the library without a shim fails here, not as a slower graph.
    assert set(cpu_native.C_SHIM_OPS) == _native_op_names()
    shims = cpu_native.c_shims()
    assert {op.name() for op in shims} == {f"pagemill_native::{n}" for n in cpu_native.C_SHIM_OPS}
    lib = ctypes.CDLL(str(cpu_native._torch_ops_loaded), mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
    for name in cpu_native.C_SHIM_OPS:
        assert hasattr(lib, f"aoti_torch_cpu_{name}"), name
    # global: found by a library that does not name this one (a compiled wrapper)
    assert hasattr(ctypes.CDLL(None), "aoti_torch_cpu_gemv_q4")


def test_declarations_follow_the_schemas() -> None:
    assert cpu_native.shim_declaration("gemv_q4") == (
        "AOTITorchError aoti_torch_cpu_gemv_q4(AtenTensorHandle x, AtenTensorHandle blocks, "
        "int64_t n, int64_t planes, AtenTensorHandle* ret0)"
    )
    assert "int32_t bf16_scales" in cpu_native.shim_declaration("gemm_q8_amx")
    decode = cpu_native.shim_declaration("paged_decode")
    assert "AtenTensorHandle* rows, double scale, int64_t window, double softcap" in decode
    # an operator returning nothing still takes the one null result handle inductor passes
    assert cpu_native.shim_declaration("write_kv_cache").endswith(
        "AtenTensorHandle slot_mapping, AtenTensorHandle* ret0)"
    )


def test_switch_turns_them_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_native.c_shims()
    monkeypatch.setenv(cpu_native.C_SHIMS_ENV, "0")
    assert cpu_native.c_shims() == {}


def _tiles() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (64, 96), generator=gen, dtype=torch.uint8)
    s = (torch.rand(64, 3, generator=gen) * 0.02 + 1e-3).half().float()
    m = (torch.randn(64, 3, generator=gen) * 0.01).half().float()
    t4 = g4.pack_q4_blocks(q, s, m + 8 * s, 32)
    q8 = torch.randint(-128, 128, (32, 96), generator=gen, dtype=torch.int8)
    t8 = g8.pack_q8_blocks(q8, (torch.rand(32, 3, generator=gen) * 0.02 + 1e-3).half().float())
    return t4, t8


def _compile_with_shims(f):  # type: ignore[no-untyped-def]
    torch._dynamo.reset()
    return torch.compile(
        f,
        fullgraph=True,
        options={"cpp_wrapper": True, "aot_inductor.custom_ops_to_c_shims": cpu_native.c_shims()},
    )


def test_a_compiled_graph_calls_the_shims_with_the_operators_results() -> None:
    t4, t8 = _tiles()
    amx = g4.amx_available() and g8.gemm_amx_available()
    ops = torch.ops.pagemill_native

    def f(x, kc, vc, fc, tables, lens, slots, scale, rows, sinks):  # type: ignore[no-untyped-def]
        # each output on its own: a sum of several would be rounded once by a fused loop
        # and after each add by eager torch
        y = ops.gemv_q4(x, t4, 48)
        extra = [ops.gemm_q4_amx(x, t4, 48, 2)]  # AMX, or gemv_q4 without
        z = ops.gemv_q8(x, t8, 32, 1)
        if amx:
            extra += [ops.gemm_q8_amx(x, t8, 32, True), ops.gemm_q4_amx_silu_mul(x, t4, 64)]
        k = y[:, :48].reshape(-1, 3, 16).repeat(1, 1, 4).to(kc.dtype)  # [3, 3, 64]
        v = (k.float() * 0.5).to(kc.dtype)
        ops.write_kv_cache(k, v, kc, vc, slots)
        ops.write_kv_cache_quant(k, v, fc, fc, slots, scale, None)  # K then V into one cache
        q = z.reshape(-1, 1, 32).repeat(1, 9, 2).to(kc.dtype)  # [3, 9, 64]
        a = ops.paged_decode(q, kc, vc, tables, lens, None, 0.125)
        b = torch.empty_like(q)
        ops.paged_decode_out(q, kc, vc, tables, lens, None, 0.125, 0, 0.0, None, None, None, b)
        # every optional argument given: rows, a window, softcap, fp8 scales, sinks
        c = ops.paged_decode(q, fc, fc, tables, lens, rows, 0.125, 5, 2.0, scale, scale, sinks)
        return y, z, a, b, c, *extra

    def inputs():  # type: ignore[no-untyped-def]
        gen = torch.Generator().manual_seed(1)
        kc = torch.randn(4, 16, 3, 64, generator=gen).to(torch.bfloat16)
        return (
            torch.randn(3, 96, generator=gen).to(torch.bfloat16),
            kc,
            kc.clone() * 2,
            torch.zeros(4, 16, 3, 64, dtype=torch.float8_e4m3fn),
            torch.tensor([[2, 0], [1, 3], [3, 2]], dtype=torch.int32),
            torch.tensor([20, 7, 32], dtype=torch.int32),
            torch.tensor([2 * 16 + 4, 16 + 6, 3 * 16 + 15]),  # each request's last token
            torch.tensor(0.25),
            torch.tensor([2, 0, 1]),
            torch.randn(9, generator=gen),
        )

    want_args, got_args = inputs(), inputs()
    want = f(*want_args)
    got, code = run_and_get_code(_compile_with_shims(f), *got_args)
    source = "\n".join(code)
    for name in cpu_native.C_SHIM_OPS:
        if amx or name not in ("gemm_q8_amx", "gemm_q4_amx_silu_mul"):
            assert f"aoti_torch_cpu_{name}(" in source, name
    assert "aoti_torch_call_dispatcher" not in source
    for g, w in zip(got, want):  # the operators' outputs, not reduced (inductor's order)
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    for w, g in zip(want_args[1:4], got_args[1:4]):  # the caches the graph wrote
        assert torch.equal(w.view(torch.uint8), g.view(torch.uint8))
    torch._dynamo.reset()


def test_an_operator_error_in_a_shim_fails_the_call_and_writes_nothing() -> None:
    def f(k, kc, vc, slots):  # type: ignore[no-untyped-def]
        torch.ops.pagemill_native.write_kv_cache(k * 2, k, kc, vc, slots)
        return kc.sum()

    k = torch.ones(2, 3, 64, dtype=torch.bfloat16)
    kc = torch.zeros(4, 16, 3, 64, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    compiled = _compile_with_shims(f)
    assert compiled(k, kc, vc, torch.tensor([1, 5])).item() == 2 * 2 * 3 * 64
    kc.zero_()
    vc.zero_()
    with pytest.raises(RuntimeError):
        compiled(k, kc, vc, torch.tensor([1, 64]))  # slot 64: outside a 64-slot cache
    assert not kc.any() and not vc.any()
    torch._dynamo.reset()


def test_the_profiler_sees_each_call_as_its_operator() -> None:
    from torch.profiler import ProfilerActivity, profile

    t4, _ = _tiles()

    def f(x):  # type: ignore[no-untyped-def]
        y = torch.ops.pagemill_native.gemv_q4(x, t4, 48)
        return torch.ops.pagemill_native.gemv_q4(torch.cat([y, y], -1), t4, 48)

    compiled = _compile_with_shims(f)
    x = torch.randn(2, 96)
    compiled(x)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = compiled(x)
    assert sum(e.name == "pagemill_native::gemv_q4" for e in prof.events()) == 2
    torch.testing.assert_close(got, f(x), rtol=0, atol=0)
    torch._dynamo.reset()


def test_the_table_pickles_as_the_compile_cache_needs() -> None:
    # The table travels in the inductor config a compiled graph is cached with; an
    # OpOverload does not pickle, and a graph whose config does not is never saved (every
    # warm start would trace again).
    import pickle

    shims = cpu_native.c_shims()
    again = pickle.loads(pickle.dumps(shims))
    assert again == shims and type(again) is type(shims)
