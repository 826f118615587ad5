"""4-bit weights times int8-quantized activations on the CPU, built on the host at first use.

A decode step of a small model reads every weight once and computes little with it: its
time is the time to stream the weights. A large batch is bound by the dot products
instead, where one `vpdpbusd` does 64 multiply-adds against a bf16 GEMM's 32: with one
activation plane the same kernel can beat the dense bf16 copy at any batch (two planes
double the integer work: about even with it), which is why the runtime times it against
that copy per machine (`quantization/crossover.py`) rather than switching at a fixed size.
`csrc/gemv_q4_cpu.cpp` streams blocks of 32 int4 values with their scale and min
interleaved (`pack_q4_blocks`), quantizes each row of x to int8 per block of 32 once per
call, and does the dot products in integer SIMD (VNNI, AVX2 or plain C++), the way
llama.cpp runs Q4_1 against Q8_1. The int8 rounding of the
activations is the one approximation (the weights' own values are exact: fp16 or fp32
scales as the checkpoint had them); `gemv_q4_torch` computes the same arithmetic in plain
torch, with or without that rounding.

`gemm_q4_amx` multiplies the same tiles on the AMX units for batches: AMX-INT8 on the same
int8 activations (equal to `gemv_q4` to the bit), or AMX-BF16 on weight blocks decompressed
to bf16 on the way in (the dense bf16 product without keeping a dense copy). On an AMX
machine `gemv_q4` itself runs on the AMX-INT8 tiles from a few rows of x up (decode steps of
a few users: the GEMV's work grows with every row and plane, the tiles' much less), the
same bits either way, so callers need no switch of their own (`set_amx_rows`,
PAGEMILL_CPU_GEMV_AMX=0 turns it off).

Built like `cpu_native` (host compiler, -march=native, cached per machine and source, ctypes;
`load()` is None without a compiler). A compiled graph holds one opaque call per linear
layer: `torch.ops.pagemill_native.gemv_q4`, the same kernel as a C++ torch operator
(`cpu_native.load_gemv_ops`), or where that cannot be built `torch.ops.pagemill.gemv_q4`,
a Python custom op over `gemv_q4`.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import torch

from pagemill.kernels.cpu_native import (
    GEMV_DTYPE_CODES,
    GEMV_ISA_NAMES,
    build_shared,
    check_planes,
    check_status,
    gemv_flags,
    load_gemv,
    register_gemv_op,
)

_SOURCE = Path(__file__).parent / "csrc" / "gemv_q4_cpu.cpp"
_WHAT, _FALLBACK = "the int4 CPU GEMV kernel", "using PyTorch's int4 kernel"
QK = 32  # inputs per block
ROWS = 16  # output rows per tile
QS_BYTES = ROWS * QK // 2
ISA_NAMES = GEMV_ISA_NAMES


def build() -> Path | None:
    """The library `load()` loads, built for this CPU (see `native_build`)."""
    return build_shared(_SOURCE, _WHAT, _FALLBACK, gemv_flags())


@functools.cache
def load(isa: int | None = None) -> ctypes.CDLL | None:
    """The kernel library built for this CPU (`isa` forces a path: see `ISA_NAMES`; None
    picks the best the host has), or None when it cannot be built here (see the log)."""
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    return load_gemv(
        _SOURCE,
        "pagemill_gemv_q4",
        [i32, ptr, i64, ptr, i32, ptr, i64, i64, i64, i64, i32, i32],
        _WHAT,
        _FALLBACK,
        isa,
    )


def available() -> bool:
    return load() is not None


# ---- the block layout ------------------------------------------------------------------------


def pack_q4_blocks(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Int4 groups (w = (q - 8) * scale + zero, q uint8 [N, K] in 0..15, scales/zeros fp32
    [N, K / group_size]) as the kernel's tiles: uint8 [ceil(N / 16), K / 32, B].

    w = d * q + m with d = scale, m = zero - 8 * scale. Each (tile of 16 output rows, block
    of 32 inputs) holds the 16 rows' d, then their m, then 256 bytes of nibbles (see the
    kernel source for their order); B = 320 with fp16 d and m when fp16 reproduces every
    weight exactly (GGUF Q4_0/Q4_1 always do), else 384 with fp32. Rows past N are zero.
    """
    n, k = q.shape
    if k % QK or group_size % QK:
        raise ValueError(f"in_features {k} / group size {group_size} is not a multiple of {QK}")
    rep = group_size // QK
    d = scales.float().repeat_interleave(rep, dim=1)
    z = zeros.float().repeat_interleave(rep, dim=1)
    m = z - 8.0 * d
    d16, m16 = d.half(), m.half()
    # fp16 is exact when it gives back the scale and, through the zero point's own formula,
    # the zero.
    exact16 = bool(
        torch.equal(d16.float(), d)
        and torch.equal(m16.float() + 8.0 * d16.float(), z)
        and torch.isfinite(m16).all()
    )
    nb, tiles = k // QK, -(-n // ROWS)
    pad = tiles * ROWS - n
    dm = torch.stack([d16, m16] if exact16 else [d, m])  # [2, N, nb]
    qp = q.to(torch.uint8)
    if pad:
        dm = torch.cat([dm, dm.new_zeros(2, pad, nb)], dim=1)
        qp = torch.cat([qp, qp.new_zeros(pad, k)])
    # [2, tiles, 16, nb] -> [tiles, nb, 2, 16]
    dm = dm.view(2, tiles, ROWS, nb).permute(1, 3, 0, 2).contiguous()
    # nibbles: q[r, 4j + t] low, q[r, 16 + 4j + t] high, stored at byte (j, r, t)
    qv = qp.view(tiles, ROWS, nb, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)  # tiles nb half j r t
    qs = (qv[:, :, 0] | (qv[:, :, 1] << 4)).reshape(tiles, nb, QS_BYTES)
    return torch.cat([dm.view(torch.uint8).view(tiles, nb, -1), qs], dim=-1).contiguous()


def unpack_q4_blocks(
    blocks: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [N, K], d fp32 [N, K / 32], m fp32 [N, K / 32]) of `pack_q4_blocks`' tiles."""
    tiles, nb, width = blocks.shape
    sb = (width - QS_BYTES) // (2 * ROWS)
    dm = blocks[:, :, : width - QS_BYTES].contiguous()
    dm = dm.view(torch.float16 if sb == 2 else torch.float32).float()  # [tiles, nb, 32]
    dm = dm.view(tiles, nb, 2, ROWS).permute(2, 0, 3, 1).reshape(2, tiles * ROWS, nb)
    qs = blocks[:, :, width - QS_BYTES :].reshape(tiles, nb, 4, ROWS, 4)
    halves = torch.stack([qs & 15, qs >> 4], dim=2)  # tiles nb half j r t
    q = halves.permute(0, 4, 1, 2, 3, 5).reshape(tiles * ROWS, nb * QK)
    return q[:n], dm[0, :n], dm[1, :n]


def dequantize_q4_blocks(blocks: torch.Tensor, n: int) -> torch.Tensor:
    """The fp32 weight [N, K] the tiles hold."""
    q, d, m = unpack_q4_blocks(blocks, n)
    nb = d.shape[1]
    w = q.view(n, nb, QK).float() * d[..., None] + m[..., None]
    return w.reshape(n, nb * QK)


# ---- compute -----------------------------------------------------------------------------------


def quantize_activations(
    x: torch.Tensor, planes: int = 2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(xq [M, K], dx [M, K / 32], sx [M, K / 32]): x ≈ xq * dx per block of 32, dx =
    max|x| / 127, sx each block's exact sum. One plane: xq = q1, integers in -127..127. Two
    planes: the remainder x - q1 * dx rounded again in steps of dx / 254 (q2, in -127..127),
    xq = q1 + q2 / 254 (the kernel sums q1 and q2 dots in integers, then combines them)."""
    m_rows, k = x.shape
    xb = x.float().view(m_rows, k // QK, QK)
    dx = xb.abs().amax(dim=-1) / 127.0
    inv = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))[..., None]
    xq = torch.round(xb * inv)
    if planes == 2:
        rest = xb - xq * dx[..., None]
        xq = xq + torch.round(rest * (inv * 254.0)).clamp_(-127, 127) / 254.0
    return xq.view(m_rows, k), dx, xb.sum(dim=-1)


def gemv_q4_torch(
    x: torch.Tensor, blocks: torch.Tensor, n: int, planes: int = 2, quantize: bool = True
) -> torch.Tensor:
    """Plain-torch `gemv_q4`: x [M, K] · W[N, K]ᵀ in x's dtype, with x rounded to int8 per
    block as the kernel does (`quantize`, `planes`), or in fp32 against the exact weights."""
    if not quantize:
        return (x.float() @ dequantize_q4_blocks(blocks, n).T).to(x.dtype)
    q, d, m = unpack_q4_blocks(blocks, n)
    nb = d.shape[1]
    xq, dx, sx = quantize_activations(x, planes)
    dots = torch.einsum("mbj,nbj->mnb", xq.view(-1, nb, QK), q.view(n, nb, QK).float())
    y = (dots * d[None] * dx[:, None]).sum(-1) + sx @ m.T
    return y.to(x.dtype)


def supports(x: torch.Tensor, blocks: torch.Tensor, n: int) -> bool:
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.dtype in GEMV_DTYPE_CODES
        and blocks.dtype == torch.uint8
        and blocks.dim() == 3
        and blocks.shape[2] in (QS_BYTES + 4 * ROWS, QS_BYTES + 8 * ROWS)
        and x.shape[1] == blocks.shape[1] * QK
        and 0 <= n <= blocks.shape[0] * ROWS
    )


def gemv_q4(
    x: torch.Tensor,
    blocks: torch.Tensor,
    n: int,
    lib: ctypes.CDLL | None = None,
    threads: int = 0,
    planes: int = 2,
) -> torch.Tensor:
    """x [M, K] (fp32 or bf16) · W[N, K]ᵀ -> [M, N] in x's dtype, on the
    native kernel (`lib`: a `load()` result; default the host's best). `threads` 0: torch's
    intra-op thread count. `planes` 1: x rounded to int8 per block of 32 (llama.cpp's Q8
    rounding, error up to max|x| / 254 per element); 2 (default): plus a second int8 plane
    for the remainder (error up to max|x| / 64516), twice the integer work for the same
    weight bytes."""
    check_planes("gemv_q4", planes)
    lib = lib or load()
    if lib is None:
        raise RuntimeError("the int4 CPU GEMV kernel is not built on this machine")
    if not supports(x, blocks, n):
        raise ValueError(
            f"gemv_q4 takes CPU fp32/bf16 x [M, 32 * nb] and uint8 tiles [>= N / 16, nb, "
            f"{QS_BYTES + 4 * ROWS}|{QS_BYTES + 8 * ROWS}] for N = {n}; "
            f"got x {tuple(x.shape)} {x.dtype}, blocks {tuple(blocks.shape)} {blocks.dtype}"
        )
    y, status = _call(lib.pagemill_gemv_q4, x, blocks, n, threads, planes)
    check_status("gemv_q4_cpu", status)
    return y


def _call(
    fn: Any, x: torch.Tensor, blocks: torch.Tensor, n: int, threads: int, planes: int
) -> tuple[torch.Tensor, int]:
    """y = x · Wᵀ through `pagemill_gemv_q4` or `pagemill_gemm_q4_amx` (one signature);
    (y, the kernel's status)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    blocks = blocks.contiguous()
    m_rows, k = x.shape
    y = torch.empty(m_rows, n, dtype=x.dtype)
    status = fn(
        GEMV_DTYPE_CODES[x.dtype],
        x.data_ptr(),
        x.stride(0),
        blocks.data_ptr(),
        (blocks.shape[2] - QS_BYTES) // (2 * ROWS),
        y.data_ptr(),
        n,
        m_rows,
        n,
        k,
        threads or torch.get_num_threads(),
        planes,
    )
    return y, status


# ---- the same product on the AMX tiles ----------------------------------------------------------

# pagemill_gemm_q4_amx's status where the build or the machine has no AMX-INT8.
_NO_AMX = 4


def _amx_lib(lib: ctypes.CDLL | None) -> ctypes.CDLL | None:
    lib = lib or load()
    if lib is None or not hasattr(lib, "pagemill_gemm_q4_amx"):
        return None
    fn = lib.pagemill_gemm_q4_amx
    fn.restype = ctypes.c_int
    fn.argtypes = lib.pagemill_gemv_q4.argtypes
    lib.pagemill_gemm_q4_amx_available.restype = ctypes.c_int
    return lib


def amx_available(lib: ctypes.CDLL | None = None) -> bool:
    """Whether `gemm_q4_amx` runs on the matrix units here: AMX-INT8 in the build (the
    compiler and `-march=native`) and on the machine, and the kernel's leave to use the
    tiles' state. Elsewhere `gemm_q4_amx` is `gemv_q4`."""
    lib = _amx_lib(lib)
    return lib is not None and bool(lib.pagemill_gemm_q4_amx_available())


def set_amx_rows(rows: int | None, lib: ctypes.CDLL | None = None) -> int | None:
    """Where `gemv_q4` (the ctypes kernel `lib`, default the host's) runs on the AMX-INT8 tiles
    instead of the AVX-512 GEMV, the same result to the bit: None from a row count per
    `planes` measured for this machine (the default), 0 never, n from n rows of x; returns the
    previous setting. The default comes from PAGEMILL_CPU_GEMV_AMX ("0": never). The C++
    operator (`torch.ops.pagemill_native.gemv_q4`) is another library: it follows the
    environment only."""
    fn = _amx_rows_fn(lib, "pagemill_gemv_q4_set_amx_rows")
    if fn is None:
        return 0
    prev = int(fn(-1 if rows is None else max(0, rows)))
    return None if prev < 0 else prev


def amx_rows(planes: int = 2, lib: ctypes.CDLL | None = None) -> int:
    """The row count from which `gemv_q4` with `planes` runs on the AMX tiles here (0: never,
    or no AMX in the build or on the machine); see `set_amx_rows`."""
    fn = _amx_rows_fn(lib, "pagemill_gemv_q4_amx_rows")
    return 0 if fn is None else int(fn(planes))


def _amx_rows_fn(lib: ctypes.CDLL | None, name: str) -> Any:
    lib = lib or load()
    fn = getattr(lib, name, None) if lib is not None else None
    if fn is not None:
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int]
    return fn


def gemm_q4_amx(
    x: torch.Tensor,
    blocks: torch.Tensor,
    n: int,
    lib: ctypes.CDLL | None = None,
    threads: int = 0,
    planes: int = 0,
) -> torch.Tensor:
    """x [M, K] · W[N, K]ᵀ on the AMX tiles, for batches (16 or 32 rows of x per tile
    pass: fewer rows pay for a full pass, where the GEMV pays per row).

    `planes` 1 or 2: AMX-INT8 on `gemv_q4`'s int8 activations, the same result as `gemv_q4`
    to the bit. 0 (default): AMX-BF16 on each weight block decompressed to bf16 (d * q + m
    rounded as the dense bf16 copy is) and x rounded to bf16, fp32 sums: the dense bf16
    product without a dense copy. Without AMX (`amx_available`) the same products run on
    `gemv_q4` (planes 1, 2) or in torch through a dequantized copy (0: slow; check first)."""
    if planes not in (0, 1, 2):
        raise ValueError(f"gemm_q4_amx takes 0, 1 or 2 activation planes, not {planes}")
    amx = _amx_lib(lib)
    if amx is None or not supports(x, blocks, n) or not amx.pagemill_gemm_q4_amx_available():
        return _gemm_q4_fallback(x, blocks, n, lib, threads, planes)
    y, status = _call(amx.pagemill_gemm_q4_amx, x, blocks, n, threads, planes)
    if status == _NO_AMX:
        return _gemm_q4_fallback(x, blocks, n, lib, threads, planes)
    check_status("gemm_q4_amx", status)
    return y


def _gemm_q4_fallback(
    x: torch.Tensor,
    blocks: torch.Tensor,
    n: int,
    lib: ctypes.CDLL | None,
    threads: int,
    planes: int,
) -> torch.Tensor:
    if planes:
        return gemv_q4(x, blocks, n, lib, threads, planes)  # raises where x or blocks do not fit
    if not supports(x, blocks, n):
        raise ValueError(
            f"gemm_q4_amx takes CPU fp32/bf16 x [M, 32 * nb] and uint8 tiles for N = {n}; "
            f"got x {tuple(x.shape)} {x.dtype}, blocks {tuple(blocks.shape)} {blocks.dtype}"
        )
    w = dequantize_q4_blocks(blocks, n).to(torch.bfloat16)
    return torch.nn.functional.linear(x.to(torch.bfloat16), w).to(x.dtype)


# ---- the gate | up product with silu(gate) * up in its epilogue -------------------------------


def silu_mul_reference(y: torch.Tensor) -> torch.Tensor:
    """silu(g) * u of a gate | up product y [M, 2I] in y's dtype as the fused kernel rounds
    it: g and u as y holds them, the activation and the product in fp32, one rounding (what
    a compiled graph's fused loop computes, where eager torch rounds silu(g) on its own)."""
    i = y.shape[-1] // 2
    g, u = y[..., :i].float(), y[..., i:].float()
    return (g / (1.0 + torch.exp(-g)) * u).to(y.dtype)


def silu_mul_fusable(n: int) -> bool:
    """Whether a gate | up layer of `n` outputs splits into whole tiles of gate rows and of up
    rows (the fused kernel pairs gate tile t with up tile t)."""
    return n > 0 and n % (2 * ROWS) == 0


def gemm_q4_amx_silu_mul(
    x: torch.Tensor,
    blocks: torch.Tensor,
    n: int,
    lib: ctypes.CDLL | None = None,
    threads: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """silu(x Wgᵀ) * (x Wuᵀ) [M, n / 2] in x's dtype for a gate | up layer W [n, K] (gate
    rows first): `gemm_q4_amx`'s bf16 product (planes 0) with the activation applied to its
    fp32 tiles while they are in L1, as `silu_mul_reference` of the product. `out`: a [M, n /
    2] tensor of x's dtype with unit column stride to write into. Without AMX
    (`amx_available`) the unfused torch computation serves."""
    if not silu_mul_fusable(n):
        raise ValueError(f"gemm_q4_amx_silu_mul needs N a positive multiple of {2 * ROWS}, not {n}")
    amx = _amx_lib(lib)
    fn = getattr(amx, "pagemill_gemm_q4_amx_silu_mul", None) if amx is not None else None
    if (
        amx is None
        or fn is None
        or not supports(x, blocks, n)
        or not amx.pagemill_gemm_q4_amx_available()
    ):
        y = silu_mul_reference(_gemm_q4_fallback(x, blocks, n, lib, threads, 0))
        return y if out is None else out.copy_(y)
    fn.restype = ctypes.c_int
    fn.argtypes = amx.pagemill_gemv_q4.argtypes[:-1]
    if x.stride(1) != 1:
        x = x.contiguous()
    blocks = blocks.contiguous()
    m_rows, k = x.shape
    if out is None:
        out = torch.empty(m_rows, n // 2, dtype=x.dtype)
    elif out.shape != (m_rows, n // 2) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(
            f"out must be [{m_rows}, {n // 2}] {x.dtype} with unit column stride, got "
            f"{tuple(out.shape)} {out.dtype} strides {out.stride()}"
        )
    status = fn(
        GEMV_DTYPE_CODES[x.dtype],
        x.data_ptr(),
        x.stride(0),
        blocks.data_ptr(),
        (blocks.shape[2] - QS_BYTES) // (2 * ROWS),
        out.data_ptr(),
        out.stride(0),
        m_rows,
        n,
        k,
        threads or torch.get_num_threads(),
    )
    check_status("gemm_q4_amx_silu_mul", status)
    return out


def gemm_q4_amx_silu_mul_fake(x: torch.Tensor, blocks: torch.Tensor, n: int) -> torch.Tensor:
    """The meta kernel of `torch.ops.pagemill_native.gemm_q4_amx_silu_mul`: [M, n / 2]."""
    return x.new_empty(x.shape[0], n // 2)


# ---- the op a compiled graph calls ---------------------------------------------------------------


def _gemv_q4_op(x: torch.Tensor, blocks: torch.Tensor, n: int, planes: int = 2) -> torch.Tensor:
    return gemv_q4(x, blocks, n, planes=planes)


def _gemm_q4_amx_op(x: torch.Tensor, blocks: torch.Tensor, n: int, planes: int = 0) -> torch.Tensor:
    return gemm_q4_amx(x, blocks, n, planes=planes)


_LIB = register_gemv_op("gemv_q4", _gemv_q4_op)
_AMX_LIB = register_gemv_op("gemm_q4_amx", _gemm_q4_amx_op, default_planes=0)
