"""The native CPU paths of an 8-bit KV cache against torch's own conversions.

The write (`pagemill_reshape_and_cache_quant`, as the C++ operator and through ctypes) must
store exactly the bytes `kv_quant.quantize` gives (torch's division, clamp and float8/int8
casts), and the decode kernel's AVX-512 path, which converts float8_e4m3fn, float8_e5m2
and int8 codes by their bits under a bf16 query, must give exactly what reading them
through the format's value table gives."""

from __future__ import annotations

import pytest
import torch

from pagemill.kernels import cpu_native
from pagemill.kernels.kv_cache import write_kv_cache_quant_cpu_native
from pagemill.kernels.kv_quant import quantize
from pagemill.kernels.ops import direct_kv_write

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]
DTYPES = [torch.bfloat16, torch.float32, torch.float16]

pytestmark = pytest.mark.skipif(cpu_native.load() is None, reason="no native CPU kernels here")


@pytest.fixture(params=["operator", "ctypes"])
def path(request, monkeypatch) -> str:
    if request.param == "ctypes":
        monkeypatch.setattr(cpu_native, "load_attention_ops", lambda: False)
    elif not cpu_native.load_attention_ops():
        pytest.skip("the C++ operators do not build here")
    return request.param


def _inputs(t: int, h: int, d: int, dtype: torch.dtype, fmt: torch.dtype) -> torch.Tensor:
    """Values over 20 decades (saturating, normal, subnormal and flushed to zero in every
    format), exact ties of the formats' steps, and the special values."""
    g = torch.Generator().manual_seed(t * d)
    x = torch.randn(t, h, d, generator=g) * torch.logspace(-14, 6, t)[:, None, None]
    ties = torch.tensor([1.0625, 1.1875, 0.5 + 2**-5, 2**-7 * 1.5, 2**-10 * 0.5, 2.5, -3.5, 448.0])
    x[1, 0, : ties.numel()] = ties
    special = [float("inf"), -float("inf"), 0.0, -0.0, 1e30, -1e30]
    if fmt != torch.int8:  # torch's NaN -> int8 is whatever the platform's cast gives
        special.append(float("nan"))
    x[0, 0, : len(special)] = torch.tensor(special)
    return x.to(dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scales", ["layer", "head", "none"])
@pytest.mark.parametrize("d", [64, 24])
def test_write_matches_quantize(path, fmt, dtype, scales, d) -> None:
    t, h = 200, 3
    k = _inputs(t, h, d, dtype, fmt)
    v = (_inputs(t, h, d, dtype, fmt).float() * -0.37).to(dtype)
    ks = vs = None
    if scales == "layer":
        ks, vs = torch.tensor(0.07), torch.tensor(1.3)
    elif scales == "head":
        ks, vs = torch.tensor([0.5, 2.0, 0.013]), torch.tensor([1.5, 0.25, 3.0])
    kc = torch.zeros(16, 16, h, d, dtype=fmt)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(256, generator=torch.Generator().manual_seed(1))[:t]
    slots[7] = -1
    assert write_kv_cache_quant_cpu_native(k, v, kc, vc, slots, ks, vs)
    keep = slots >= 0
    for src, cache, scale in ((k, kc, ks), (v, vc, vs)):
        got = cache.view(-1, h, d)[slots[keep]].view(torch.uint8)
        want = quantize(src[keep], scale, fmt).view(torch.uint8)
        assert torch.equal(got, want)
        untouched = torch.ones(256, dtype=torch.bool)
        untouched[slots[keep]] = False
        assert not cache.view(-1, h, d)[untouched].view(torch.uint8).any()


def test_write_refuses_a_slot_outside_the_cache(path) -> None:
    kc = torch.zeros(2, 4, 1, 16, dtype=torch.float8_e4m3fn)
    vc = torch.zeros_like(kc)
    k = torch.ones(3, 1, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="outside the cache"):
        write_kv_cache_quant_cpu_native(k, k, kc, vc, torch.tensor([0, 8, 1]), None, None)
    assert not kc.view(torch.uint8).any()  # nothing written, not even the valid slots


def test_write_declines_what_it_does_not_serve() -> None:
    kc = torch.zeros(2, 4, 1, 16, dtype=torch.float8_e4m3fn)
    k = torch.ones(3, 1, 16, dtype=torch.bfloat16)
    # A cache in the compute dtype, and rows that are not contiguous per head: not this write.
    dense = torch.zeros(2, 4, 1, 16, dtype=torch.bfloat16)
    slots = torch.tensor([0, 1, 2])
    assert not write_kv_cache_quant_cpu_native(k, k, dense, dense, slots, None, None)
    strided = torch.ones(3, 1, 32, dtype=torch.bfloat16)[:, :, ::2]
    assert not write_kv_cache_quant_cpu_native(strided, strided, kc, kc.clone(), slots, None, None)


def _all_codes_cache(fmt: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """Random bytes over every code of the format but its NaN/inf patterns (a saturated
    write never stores them, and NaN keys make every output NaN)."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (n,), generator=g, dtype=torch.int32).to(torch.uint8)
    if fmt == torch.float8_e4m3fn:
        b[(b & 0x7F) == 0x7F] = 0x3C
    elif fmt == torch.float8_e5m2:
        b[(b & 0x7C) == 0x7C] = 0x3B
    return b.view(fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_by_bits_equals_decode_by_table(monkeypatch, fmt, head_dim) -> None:
    """Under a bf16 query (the CPU's compute dtype; other queries read through the table)."""
    dtype = torch.bfloat16
    nb, bs, kvh, heads, s = 24, 16, 2, 6, 5
    kc = _all_codes_cache(fmt, nb * bs * kvh * head_dim, 1).view(nb, bs, kvh, head_dim)
    vc = _all_codes_cache(fmt, nb * bs * kvh * head_dim, 2).view(nb, bs, kvh, head_dim)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(s, heads, head_dim, generator=g).to(dtype)
    tables = torch.randperm(nb, generator=g)[: s * 4].view(s, 4).to(torch.int32).contiguous()
    lens = torch.tensor([1, 17, 40, 64, 33], dtype=torch.int32)
    # Small scales keep fp8's large codes from overflowing the scores.
    ks, vs = torch.tensor([0.003, 0.0011]), torch.tensor(0.02)
    lib = cpu_native.load()
    assert lib is not None

    def run() -> torch.Tensor:
        out = torch.empty_like(q)
        cpu_native.paged_decode(lib, q, kc, vc, out, tables, lens, None, 0.125, 0, 0.0, ks, vs)
        return out

    by_bits = run()
    monkeypatch.setattr(cpu_native, "load_attention_ops", lambda: False)
    monkeypatch.setattr(cpu_native, "KV_FORMAT_CODES", {})  # the kernel then reads the table
    by_table = run()
    assert torch.isfinite(by_table.float()).all()
    assert torch.equal(by_bits, by_table)


@pytest.mark.parametrize("fmt", FORMATS)
def test_traced_write_is_the_quantizing_operator(fmt) -> None:
    """A compiled graph puts the quantizing C++ write in place of the Python custom op."""
    if not cpu_native.load_attention_ops():
        pytest.skip("the C++ operators do not build here")
    kc = torch.zeros(4, 16, 2, 64, dtype=fmt)
    vc = torch.zeros_like(kc)
    k = torch.randn(3, 2, 64, dtype=torch.bfloat16)
    slots = torch.tensor([5, 17, 40])
    scale = torch.tensor(0.25)
    assert direct_kv_write(k, k, kc, vc, slots, scale, scale)
    want = quantize(k, scale, fmt).view(torch.uint8)
    assert torch.equal(kc.view(-1, 2, 64)[slots].view(torch.uint8), want)
