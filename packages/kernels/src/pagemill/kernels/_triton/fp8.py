"""fp8 (and int8) KV bytes <-> floats with integer and fp32 arithmetic only.

Triton's own float8 casts need sm_89+ for e4m3 (sm_80 serves fp8e5/fp8e4b15 only), and
the interpreter's cast drops the carry when rounding crosses a power of two. The cache is
therefore handed to the kernels as uint8 and converted here: exact on every target, and
round-to-nearest-even like torch's cast (saturation is the caller's clamp).
"""

import triton
import triton.language as tl


@triton.jit
def fp8_encode(x, E4M3: tl.constexpr):
    """fp32 ``x`` (already clamped to the format's range) to the fp8 byte, RTNE."""
    MANT: tl.constexpr = 3 if E4M3 else 2
    BIAS: tl.constexpr = 7 if E4M3 else 15
    a = tl.abs(x)
    sign = (x.to(tl.uint32, bitcast=True) >> 24) & 0x80  # -0.0 keeps its sign
    # Normal numbers: round the fp32 mantissa to MANT bits (nearest, ties to even).
    u = a.to(tl.uint32, bitcast=True)
    drop: tl.constexpr = 23 - MANT
    u = u + ((1 << (drop - 1)) - 1) + ((u >> drop) & 1)
    exp = (u >> 23).to(tl.int32) - 127 + BIAS
    normal = ((exp.to(tl.uint32) << MANT) | ((u >> drop) & ((1 << MANT) - 1))) & 0x7F
    # Subnormals: multiples of 2^(1 - BIAS - MANT); the magic-number add rounds to even.
    k = (a * (2.0 ** (BIAS + MANT - 1)) + 8388608.0) - 8388608.0
    sub = k.to(tl.uint32)
    byte = tl.where(a < 2.0 ** (1 - BIAS), sub, normal)
    return (sign | byte).to(tl.uint8)


@triton.jit
def fp8_decode(b, E4M3: tl.constexpr):
    """The fp8 byte ``b`` (uint8) as fp16 (exact: every fp8 value is an fp16), its bits
    placed in an fp16's; no fp32 hop, which costs registers in the attention loop."""
    h = b.to(tl.uint16)
    if E4M3:
        # e4m3 bits shifted into fp16 read 2^(15 - 7) too small (normals and subnormals).
        bits = ((h & 0x80) << 8) | ((h & 0x7F) << 7)
        return bits.to(tl.float16, bitcast=True) * 256.0
    else:
        return (h << 8).to(tl.float16, bitcast=True)


@triton.jit
def int8_encode(x):
    """fp32 ``x`` (already clamped to +-127) to the int8 code's byte, round half to even as
    ``torch.round``: adding and removing 1.5 * 2^23 leaves an fp32 with no fraction bits,
    and the fp32 add itself rounds to nearest even."""
    r = (x + 12582912.0) - 12582912.0
    return r.to(tl.int32).to(tl.int8).to(tl.uint8, bitcast=True)


@triton.jit
def kv_encode(x, E4M3: tl.constexpr, INT8: tl.constexpr):
    """A quantized KV cache's byte for the clamped fp32 ``x``: an int8 code or an fp8 value."""
    if INT8:
        return int8_encode(x)
    else:
        return fp8_encode(x, E4M3)


@triton.jit
def kv_decode(b, E4M3: tl.constexpr, INT8: tl.constexpr):
    """A quantized KV cache's byte ``b`` (uint8) as fp16, exactly (int8 codes and fp8
    values alike are fp16 numbers)."""
    if INT8:
        return b.to(tl.int8, bitcast=True).to(tl.float16)
    else:
        return fp8_decode(b, E4M3)
