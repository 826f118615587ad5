"""GGUF Q8_0 weights times int8-quantized activations on the CPU, built on the host at first use.

A Q8_0 LM head (SmolLM2's is 49152 x 576) is the largest single weight a small model's
decode step streams, and it runs on the few sampled rows only: its time is the time to
read it. `csrc/gemv_q8_cpu.cpp` streams the blocks of 32 int8 values with their fp16 scale
next to them (`pack_q8_blocks`, the same bytes per weight as the GGUF file), quantizes each
row of x to int8 per block of 32 once per call, and does the dot products in integer SIMD
(VNNI, AVX2 or plain C++), the way llama.cpp runs Q8_0 against Q8_0. The activations'
rounding is the one approximation (the weights and their fp16 scales are exact); with two
planes (`gemv_q4_cpu.quantize_activations`) it is ~max|x| / 64516 per block.
`gemv_q8_torch` computes the same arithmetic in plain torch.

On a machine with AMX-INT8 the kernel itself sends calls of a few rows and more
(`amx_min_rows()`) to the matrix units: the vector kernel's integers and float steps, so the
same bits, in far fewer instructions per row of x; `PAGEMILL_CPU_GEMV_AMX=0` keeps every
call on the vector kernel. Callers change nothing.

For batches (an LM head over a whole step's rows) `gemm_q8_amx` multiplies the same tiles on
the AMX-BF16 units: each block made into bf16 (d * q, exact in fp32, rounded once: the values
a dense bf16 copy made from the tiles holds; with `bf16_scales` d is rounded to bf16 first, as
in an embedding dequantized with bf16 scales, so a tied head matches its embedding) and x
rounded to bf16, fp32 sums. That is the dense bf16 product (summation order aside) from half
the bytes and without a dense copy.

Built like `cpu_native` (host compiler, -march=native, cached per machine and source, ctypes;
`load()` is None without a compiler). Callers reach it as `torch.ops.pagemill_native.gemv_q8`
(a C++ torch operator, `cpu_native.load_gemv_ops`) or else `torch.ops.pagemill.gemv_q8`
(a Python custom op over `gemv_q8`).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pagemill.kernels.cpu_native import (
    GEMV_DTYPE_CODES,
    build_shared,
    check_planes,
    check_status,
    gemv_flags,
    load_gemv,
    register_gemv_op,
)
from pagemill.kernels.cpu_native import GEMV_ISA_NAMES as ISA_NAMES
from pagemill.kernels.gemv_q4_cpu import quantize_activations

__all__ = [
    "ISA_NAMES",
    "QK",
    "ROWS",
    "amx_available",
    "amx_min_rows",
    "available",
    "dequantize_q8_blocks",
    "gemm_amx_available",
    "gemm_q8_amx",
    "gemm_q8_amx_torch",
    "gemm_q8_amx_weights",
    "gemv_q8",
    "gemv_q8_torch",
    "load",
    "pack_q8_blocks",
    "packable",
    "picks_amx",
    "unpack_q8_blocks",
]

_SOURCE = Path(__file__).parent / "csrc" / "gemv_q8_cpu.cpp"
_WHAT, _FALLBACK = "the Q8_0 CPU GEMV kernel", "serving Q8_0 rows as int4x2"
QK = 32  # inputs per block
ROWS = 16  # output rows per tile
QS_BYTES = ROWS * QK
BLOCK_BYTES = 2 * ROWS + QS_BYTES


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
        "pagemill_gemv_q8",
        [i32, ptr, i64, ptr, ptr, i64, i64, i64, i64, i32, i32],
        _WHAT,
        _FALLBACK,
        isa,
    )


def available() -> bool:
    return load() is not None


def _path_lib(lib: ctypes.CDLL | None) -> ctypes.CDLL | None:
    """`lib` with its chosen-kernel entry typed (builds before it have none)."""
    if lib is None or not hasattr(lib, "pagemill_gemv_q8_path"):
        return None
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    fn = lib.pagemill_gemv_q8_path
    fn.restype = i32
    fn.argtypes = [i32, ptr, i64, ptr, ptr, i64, i64, i64, i64, i32, i32, i32]
    lib.pagemill_gemv_q8_amx_available.restype = i32
    lib.pagemill_gemv_q8_amx_min_rows.restype = i64
    lib.pagemill_gemv_q8_picks_amx.restype = i32
    lib.pagemill_gemv_q8_picks_amx.argtypes = [i64]
    return lib


def amx_available(lib: ctypes.CDLL | None = None) -> bool:
    """Whether calls can run on the AMX units here: AMX-INT8 in the build (compiler and
    -march), on the CPU, and the kernel's permission for the tiles' state."""
    typed = _path_lib(lib or load())
    return typed is not None and bool(typed.pagemill_gemv_q8_amx_available())


def amx_min_rows(lib: ctypes.CDLL | None = None) -> int:
    """The fewest rows of x `gemv_q8` sends to the AMX units (0: it never does)."""
    typed = _path_lib(lib or load())
    return 0 if typed is None else int(typed.pagemill_gemv_q8_amx_min_rows())


def picks_amx(m_rows: int, lib: ctypes.CDLL | None = None) -> bool:
    """Whether `gemv_q8` (amx=None) runs `m_rows` rows of x on the AMX units now (the
    build, the machine, the row count and `PAGEMILL_CPU_GEMV_AMX`)."""
    typed = _path_lib(lib or load())
    return typed is not None and bool(typed.pagemill_gemv_q8_picks_amx(m_rows))


# ---- the block layout ------------------------------------------------------------------------


def packable(q: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether `pack_q8_blocks` holds these rows exactly: blocks of 32 and scales fp16
    represents (GGUF Q8_0's always are)."""
    return (
        q.dim() == 2
        and q.shape[1] % QK == 0
        and tuple(scales.shape) == (q.shape[0], q.shape[1] // QK)
        and bool(torch.equal(scales.float().half().float(), scales.float()))
    )


def pack_q8_blocks(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Int8 blocks (w = q * scale, q int8 [N, K], scales [N, K / 32] that fp16 holds exactly)
    as the kernel's tiles: uint8 [ceil(N / 16), K / 32, 544].

    Each (tile of 16 output rows, block of 32 inputs) holds the 16 rows' fp16 scales, then
    512 bytes of int8 values, byte (j, r, t) = q[r, 4j + t] (see the kernel source). Rows
    past N are zero."""
    if not packable(q, scales):
        raise ValueError(
            f"Q8 tiles take int8 [N, 32 * nb] with fp16-exact scales [N, nb]; got "
            f"q {tuple(q.shape)}, scales {tuple(scales.shape)} (or scales fp16 cannot hold)"
        )
    n, k = q.shape
    nb, tiles = k // QK, -(-n // ROWS)
    pad = tiles * ROWS - n
    d = scales.float().half()
    qp = q.to(torch.int8)
    if pad:
        d = torch.cat([d, d.new_zeros(pad, nb)])
        qp = torch.cat([qp, qp.new_zeros(pad, k)])
    d = d.view(tiles, ROWS, nb).permute(0, 2, 1).contiguous()  # [tiles, nb, 16]
    qs = qp.view(tiles, ROWS, nb, 8, 4).permute(0, 2, 3, 1, 4)  # tiles nb j r t
    qs = qs.reshape(tiles, nb, QS_BYTES).view(torch.uint8)
    return torch.cat([d.view(torch.uint8), qs], dim=-1).contiguous()


def unpack_q8_blocks(blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], d fp32 [N, K / 32]) of `pack_q8_blocks`' tiles."""
    tiles, nb, width = blocks.shape
    if width != BLOCK_BYTES:
        raise ValueError(f"Q8 tiles are {BLOCK_BYTES} bytes per block, got {width}")
    d = blocks[:, :, : 2 * ROWS].contiguous().view(torch.float16).float()  # [tiles, nb, 16]
    d = d.permute(0, 2, 1).reshape(tiles * ROWS, nb)
    qs = blocks[:, :, 2 * ROWS :].contiguous().view(torch.int8).view(tiles, nb, 8, ROWS, 4)
    q = qs.permute(0, 3, 1, 2, 4).reshape(tiles * ROWS, nb * QK)
    return q[:n], d[:n]


def dequantize_q8_blocks(blocks: torch.Tensor, n: int) -> torch.Tensor:
    """The fp32 weight [N, K] the tiles hold."""
    q, d = unpack_q8_blocks(blocks, n)
    nb = d.shape[1]
    return (q.view(n, nb, QK).float() * d[..., None]).reshape(n, nb * QK)


# ---- compute -----------------------------------------------------------------------------------


def gemv_q8_torch(
    x: torch.Tensor, blocks: torch.Tensor, n: int, planes: int = 2, quantize: bool = True
) -> torch.Tensor:
    """Plain-torch `gemv_q8`: x [M, K] · W[N, K]ᵀ in x's dtype, with x rounded to int8 per
    block as the kernel does (`quantize`, `planes`), or in fp32 against the exact weights."""
    if not quantize:
        return (x.float() @ dequantize_q8_blocks(blocks, n).T).to(x.dtype)
    q, d = unpack_q8_blocks(blocks, n)
    nb = d.shape[1]
    xq, dx, _ = quantize_activations(x, planes)
    dots = torch.einsum("mbj,nbj->mnb", xq.view(-1, nb, QK), q.view(n, nb, QK).float())
    return (dots * d[None] * dx[:, None]).sum(-1).to(x.dtype)


def supports(x: torch.Tensor, blocks: torch.Tensor, n: int) -> bool:
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.dtype in GEMV_DTYPE_CODES
        and blocks.dtype == torch.uint8
        and blocks.dim() == 3
        and blocks.shape[2] == BLOCK_BYTES
        and x.shape[1] == blocks.shape[1] * QK
        and 0 <= n <= blocks.shape[0] * ROWS
    )


def _checked_operands(
    name: str, x: torch.Tensor, blocks: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x and blocks as the kernels read them (rows of x contiguous, the tiles packed) and
    the output to fill; a clear error for what the kernels do not take."""
    if not supports(x, blocks, n):
        raise ValueError(
            f"{name} takes CPU fp32/bf16 x [M, 32 * nb] and uint8 tiles [>= N / 16, nb, "
            f"{BLOCK_BYTES}] for N = {n}; got x {tuple(x.shape)} {x.dtype}, "
            f"blocks {tuple(blocks.shape)} {blocks.dtype}"
        )
    if x.stride(1) != 1:
        x = x.contiguous()
    return x, blocks.contiguous(), torch.empty(x.shape[0], n, dtype=x.dtype)


def gemv_q8(
    x: torch.Tensor,
    blocks: torch.Tensor,
    n: int,
    lib: ctypes.CDLL | None = None,
    threads: int = 0,
    planes: int = 2,
    amx: bool | None = None,
) -> torch.Tensor:
    """x [M, K] (fp32 or bf16) · W[N, K]ᵀ -> [M, N] in x's dtype, on the native kernel
    (`lib`: a `load()` result; default the host's best). `threads` 0: torch's intra-op
    thread count. `planes` 1: x rounded to int8 per block of 32 (llama.cpp's rounding);
    2 (default): plus a second int8 plane for the remainder. `amx` None: the kernel picks
    (see the module); True / False: the AMX units / the vector kernel at any row count (True
    raises where `amx_available()` is False)."""
    check_planes("gemv_q8", planes)
    lib = lib or load()
    if lib is None:
        raise RuntimeError("the Q8_0 CPU GEMV kernel is not built on this machine")
    x, blocks, y = _checked_operands("gemv_q8", x, blocks, n)
    m_rows, k = x.shape
    args = (
        GEMV_DTYPE_CODES[x.dtype],
        x.data_ptr(),
        x.stride(0),
        blocks.data_ptr(),
        y.data_ptr(),
        n,
        m_rows,
        n,
        k,
        threads or torch.get_num_threads(),
        planes,
    )
    if amx is None:
        status = lib.pagemill_gemv_q8(*args)
    else:
        typed = _path_lib(lib)
        if typed is None:
            raise RuntimeError("this gemv_q8 build cannot choose its kernel")
        status = typed.pagemill_gemv_q8_path(*args, int(amx))
        if status == 4:
            raise RuntimeError("gemv_q8 cannot run on AMX units here (see amx_available())")
    check_status("gemv_q8_cpu", status)
    return y


# ---- batches on the AMX-BF16 tiles -----------------------------------------------------------

# pagemill_gemm_q8_amx's status where the build or the machine has no AMX-BF16.
_NO_AMX = 4


def _gemm_lib(lib: ctypes.CDLL | None) -> ctypes.CDLL | None:
    """`lib` with its `pagemill_gemm_q8_amx` typed (builds before it have none)."""
    if lib is None or not hasattr(lib, "pagemill_gemm_q8_amx"):
        return None
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    fn = lib.pagemill_gemm_q8_amx
    fn.restype = i32
    fn.argtypes = [i32, ptr, i64, ptr, ptr, i64, i64, i64, i64, i32, i32]
    lib.pagemill_gemm_q8_amx_available.restype = i32
    return lib


def gemm_amx_available(lib: ctypes.CDLL | None = None) -> bool:
    """Whether `gemm_q8_amx` runs here: AMX-BF16 in the build (the compiler and
    `-march=native`) and on the machine, and the kernel's leave to use the tiles' state."""
    typed = _gemm_lib(lib or load())
    return typed is not None and bool(typed.pagemill_gemm_q8_amx_available())


def gemm_q8_amx(
    x: torch.Tensor,
    blocks: torch.Tensor,
    n: int,
    lib: ctypes.CDLL | None = None,
    threads: int = 0,
    bf16_scales: bool = False,
) -> torch.Tensor:
    """x [M, K] (fp32 or bf16) · W[N, K]ᵀ -> [M, N] in x's dtype on the AMX-BF16 tiles, for
    batches (32 rows of x per tile pass). Each weight block becomes bf16 (d * q rounded once;
    `bf16_scales`: d rounded to bf16 first, as a bf16 embedding dequantized with bf16 scales
    holds it) and x is rounded to bf16, with fp32 sums: `gemm_q8_amx_torch`'s product,
    summation order aside. Raises where `gemm_amx_available()` is False (callers keep
    another path there)."""
    typed = _gemm_lib(lib or load())
    if typed is None or not typed.pagemill_gemm_q8_amx_available():
        raise RuntimeError(
            "gemm_q8_amx needs AMX-BF16 (in the build and on this CPU, with the kernel's "
            "leave to use the tiles); see gemm_amx_available()"
        )
    x, blocks, y = _checked_operands("gemm_q8_amx", x, blocks, n)
    m_rows, k = x.shape
    status = typed.pagemill_gemm_q8_amx(
        GEMV_DTYPE_CODES[x.dtype],
        x.data_ptr(),
        x.stride(0),
        blocks.data_ptr(),
        y.data_ptr(),
        n,
        m_rows,
        n,
        k,
        threads or torch.get_num_threads(),
        int(bf16_scales),
    )
    if status == _NO_AMX:
        raise RuntimeError("gemm_q8_amx cannot run on AMX-BF16 units here")
    check_status("gemm_q8_amx", status)
    return y


def gemm_q8_amx_weights(blocks: torch.Tensor, n: int, bf16_scales: bool = False) -> torch.Tensor:
    """The bf16 weights [N, K] `gemm_q8_amx` multiplies: bf16(d * q), d first rounded to bf16
    with `bf16_scales`."""
    q, d = unpack_q8_blocks(blocks, n)
    if bf16_scales:
        d = d.to(torch.bfloat16).float()
    nb = d.shape[1]
    return (q.view(n, nb, QK).float() * d[..., None]).reshape(n, nb * QK).to(torch.bfloat16)


def gemm_q8_amx_torch(
    x: torch.Tensor, blocks: torch.Tensor, n: int, bf16_scales: bool = False
) -> torch.Tensor:
    """Plain-torch `gemm_q8_amx`: its bf16 weights (`gemm_q8_amx_weights`), x rounded to
    bf16, fp32 sums."""
    w = gemm_q8_amx_weights(blocks, n, bf16_scales).float()
    return (x.to(torch.bfloat16).float() @ w.T).to(x.dtype)


# ---- the op a compiled graph calls ---------------------------------------------------------------


def _gemv_q8_op(x: torch.Tensor, blocks: torch.Tensor, n: int, planes: int = 2) -> torch.Tensor:
    return gemv_q8(x, blocks, n, planes=planes)


_LIB = register_gemv_op("gemv_q8", _gemv_q8_op)
