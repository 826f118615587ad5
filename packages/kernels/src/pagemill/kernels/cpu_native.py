"""A native CPU kernel for paged decode attention, built on the host at first use.

The torch path gathers every request's K/V into a dense copy before its GEMMs; at batch
256 that copy is most of attention's time. `csrc/paged_decode_cpu.cpp` reads K/V in
place through the block table instead. It is plain C++ (no torch headers), compiled once
per machine with the host compiler (`-O3 -march=native -fopenmp`, a few seconds) into
the cache folder and called through ctypes with raw pointers. Without a compiler, or if
the build fails, `load()` returns None and the torch path runs (one warning).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from pagemill.kernels import native_build
from pagemill.kernels.kv_quant import decode_table, is_quantized_kv

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode_cpu.cpp"
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# The builder's name as this module has long exported it (benchmarks and kernels use it).
build_shared = native_build.build_shared


def build_library(
    source: Path, what: str, fallback: str, extra_flags: Sequence[str] = ()
) -> ctypes.CDLL | None:
    """`build_shared(source, ...)` loaded for ctypes; None where it gives none."""
    target = native_build.build_shared(source, what, fallback, extra_flags)
    return None if target is None else ctypes.CDLL(str(target))


# ---- shared by the packed-weight GEMV kernels (`gemv_q4_cpu`, `gemv_q8_cpu`) ---------------------

# The arithmetic a GEMV build runs (its `PAGEMILL_GEMV_ISA`), by the value `<symbol>_isa()` returns.
GEMV_ISA_NAMES = {0: "plain C++", 1: "AVX2", 2: "AVX-VNNI", 3: "AVX512-VNNI"}
GEMV_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def gemv_flags(isa: int | None = None) -> list[str]:
    """A GEMV kernel source's own flags; the torch operators' library compiles it with the
    same ones, so both libraries link one cached object."""
    flags = ["-ffp-contract=off"]  # the remainder plane rounds as the torch reference does
    if isa is not None:
        flags.append(f"-DPAGEMILL_GEMV_ISA={int(isa)}")
    return flags


def load_gemv(
    source: Path,
    symbol: str,
    argtypes: Sequence[type],
    what: str,
    fallback: str,
    isa: int | None = None,
) -> ctypes.CDLL | None:
    """A GEMV kernel library (`source`, entry point `symbol` returning a status int, and
    `<symbol>_isa()`) built for this CPU; `isa` forces one arithmetic (`GEMV_ISA_NAMES`;
    None: the best the host has). None where `build_library` gives none."""
    lib = build_library(source, what, fallback, gemv_flags(isa))
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    fn.restype = ctypes.c_int
    fn.argtypes = list(argtypes)
    isa_fn = getattr(lib, f"{symbol}_isa")
    isa_fn.restype = ctypes.c_int
    isa_fn.argtypes = []
    return lib


def check_planes(op: str, planes: int) -> None:
    if planes not in (1, 2):
        raise ValueError(f"{op} takes 1 or 2 activation planes, not {planes}")


def check_status(op: str, status: int) -> None:
    if status:
        raise RuntimeError(f"{op} refused its arguments (status {status})")


def register_gemv_op(
    name: str,
    impl: Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor],
    default_planes: int = 2,
) -> torch.library.Library:
    """`torch.ops.pagemill.<name>(x, blocks, n, planes=default_planes)` on `impl`: one opaque
    call per linear layer in a compiled graph, its output [rows of x, n] in x's dtype."""
    lib = torch.library.Library("pagemill", "FRAGMENT")
    lib.define(f"{name}(Tensor x, Tensor blocks, int n, int planes={default_planes}) -> Tensor")
    lib.impl(name, impl, "CPU")

    torch.library.register_fake(f"pagemill::{name}", _gemv_fake, lib=lib)
    return lib


_CSRC = Path(__file__).parent / "csrc"
# Set to 0 to keep the Python custom ops over ctypes (`torch.ops.pagemill.gemv_q4` / `gemv_q8`).
GEMV_OPS_ENV = "PAGEMILL_NATIVE_GEMV_OPS"
_gemv_ops_loaded = False


def _torch_op_flags() -> tuple[list[str], list[str]]:
    """Compile and link flags of C++ torch operators: the running torch's headers, ABI and
    libraries, its version among the compile flags so that the build cache follows torch."""
    root = Path(torch.__file__).parent
    compile_flags = [
        "-std=c++20",  # torch's headers need it (the later -std wins)
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        f"-DPAGEMILL_TORCH_VERSION={torch.__version__}",
        f"-I{root / 'include'}",
        f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
    ]
    link_flags = [f"-L{root / 'lib'}", f"-Wl,-rpath,{root / 'lib'}", "-lc10", "-ltorch_cpu"]
    return compile_flags, link_flags


def build_torch_ops() -> Path | None:
    """The library of every CPU kernel as a C++ torch operator (`csrc/torch_ops_cpu.cpp`: the
    GEMV operators and the decode attention / KV write ones), built once per machine and
    torch; its path, or None where it cannot be built (one warning).

    One library, not one per family: compiling against torch's headers is most of a build,
    and one translation unit parses them once. The kernels themselves are the objects their
    ctypes libraries link, compiled with the same flags."""
    compile_flags, link_flags = _torch_op_flags()
    return native_build.build_shared(
        [
            (_CSRC / "torch_ops_cpu.cpp", ["-ffp-contract=off", *compile_flags]),
            (_CSRC / "gemv_q4_cpu.cpp", gemv_flags()),
            (_CSRC / "gemv_q8_cpu.cpp", gemv_flags()),
            _SOURCE,
        ],
        "the CPU kernels as torch operators",
        "calling them through Python custom ops and ctypes",
        link_flags=link_flags,
    )


_torch_ops_loaded: Path | None = None  # the operators' library this process loaded
_torch_ops_lock = threading.Lock()


def _load_torch_ops(use: str) -> bool:
    """Build and load `build_torch_ops`'s library, once per process; whether it is loaded.
    `use` names what falls back.

    Once, whatever the cache folder says later: a second copy of the library (the same
    build in another folder, as a test that points the cache elsewhere would find) would
    define the `pagemill_native` operators again, which torch aborts the process for."""
    global _torch_ops_loaded
    with _torch_ops_lock:
        if _torch_ops_loaded is not None:
            return True
        target = build_torch_ops()
        if target is None:
            return False
        try:
            torch.ops.load_library(str(target))
        except (OSError, RuntimeError) as e:
            logger.warning("loading %s failed (%s); %s", target, e, use)
            return False
        _torch_ops_loaded = target
        _export_c_shims(target)
        return True


# The operators with a C entry point in csrc/aoti_shims_cpu.cpp (inductor's C shim ABI); a
# graph compiled with a C++ wrapper calls these directly instead of going through
# `aoti_torch_call_dispatcher` (see `c_shims`).
C_SHIM_OPS = (
    "gemv_q4",
    "gemv_q8",
    "gemm_q4_amx",
    "gemm_q8_amx",
    "gemm_q4_amx_silu_mul",
    "paged_decode",
    "paged_decode_out",
    "write_kv_cache",
    "write_kv_cache_quant",
)
# An argument's C type in that ABI, by its schema type.
_SHIM_ARG_TYPES = {
    "Tensor": "AtenTensorHandle",
    "Optional[Tensor]": "AtenTensorHandle*",
    "int": "int64_t",
    "float": "double",
    "bool": "int32_t",
}
# Set to 0 to have compiled graphs call the operators through the dispatcher (to compare).
C_SHIMS_ENV = "PAGEMILL_NATIVE_C_SHIMS"
_c_shims_exported = False


def _export_c_shims(target: Path) -> None:
    """Make the loaded library's symbols global (`RTLD_NOLOAD | RTLD_GLOBAL` reopens it in
    place), so that a compiled wrapper loaded later resolves its calls to the shims there.
    `torch.ops.load_library` opens it local to itself, where no other library sees them."""
    global _c_shims_exported
    try:
        lib = ctypes.CDLL(str(target), mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
        _c_shims_exported = all(hasattr(lib, f"aoti_torch_cpu_{name}") for name in C_SHIM_OPS)
    except (OSError, AttributeError) as e:  # AttributeError: no RTLD_NOLOAD on this OS
        logger.warning("the CPU operators' C entry points are not exported (%s)", e)
        _c_shims_exported = False


def c_shims() -> dict[torch._ops.OpOverload, list[str]]:
    """Inductor's `aot_inductor.custom_ops_to_c_shims` for the loaded operators: each
    operator's C entry point, which a graph compiled with a C++ wrapper then calls directly.
    Through `aoti_torch_call_dispatcher` every call looks the operator up by name and boxes
    its arguments and result; a batch-1 decode step makes a few hundred of them, each moving
    little data. Empty where the library is not loaded, its symbols are not exported, or
    `PAGEMILL_NATIVE_C_SHIMS=0`: the graphs then go through the dispatcher, as before.

    A graph compiled with these holds calls to the symbols, so the library must be loaded
    (and exported) before such a graph is loaded from a cache: every path to a compiled
    forward builds the layers, which load the library, first."""
    if not _c_shims_exported or os.environ.get(C_SHIMS_ENV, "1") == "0":
        return {}
    return _shim_table(C_SHIM_OPS)


class _ShimTable(dict):
    """`c_shims`'s mapping, picklable: it travels in the inductor config a compiled graph is
    cached with (the compile cache's packages pickle their backends' configs), and an
    OpOverload key does not pickle; this one pickles as its operators' names, and is rebuilt
    from them (the library loaded, as it is before any cached graph loads)."""

    def __reduce__(self) -> tuple[Any, tuple[tuple[str, ...]]]:
        return _shim_table, (tuple(op.name().removeprefix("pagemill_native::") for op in self),)


def _shim_table(names: Sequence[str]) -> _ShimTable:
    ops = torch.ops.pagemill_native
    return _ShimTable({getattr(ops, name).default: [shim_declaration(name)] for name in names})


def shim_declaration(name: str) -> str:
    """The C declaration of operator `name`'s entry point, from its schema, in the form
    inductor's C++ wrapper calls it: the arguments in order (see `_SHIM_ARG_TYPES`), then
    one `AtenTensorHandle*` per result (one, passed null, for an operator returning
    nothing). csrc/aoti_shims_cpu.cpp defines each to match."""
    schema = getattr(torch.ops.pagemill_native, name).default._schema
    args = []
    for a in schema.arguments:
        kind = str(a.type)
        if kind not in _SHIM_ARG_TYPES:
            raise TypeError(f"pagemill_native::{name}: no C shim type for {a.name}: {kind}")
        args.append(f"{_SHIM_ARG_TYPES[kind]} {a.name}")
    for i in range(max(1, len(schema.returns))):
        args.append(f"AtenTensorHandle* ret{i}")
    return f"AOTITorchError aoti_torch_cpu_{name}({', '.join(args)})"


@functools.cache
def load_gemv_ops() -> bool:
    """Build (once per machine and torch) and load `torch.ops.pagemill_native.gemv_q4` /
    `gemv_q8` / `gemm_q4_amx` / `gemm_q8_amx`, the GEMV kernels as C++ torch operators;
    whether they are loaded.

    A call through them costs what any aten op's dispatch does, where the Python custom ops
    add a Python function and a ctypes call to each of a decode step's hundred-odd calls.
    The build compiles against torch's headers (longer than the ctypes builds: a cost of the
    first start on a machine); when it cannot, the Python custom ops serve (one warning)."""
    global _gemv_ops_loaded
    if _gemv_ops_loaded:  # a library of operators loads once per process
        return True
    if os.environ.get(GEMV_OPS_ENV, "1") == "0":
        return False
    if not _load_torch_ops("calling the GEMV kernels through Python"):
        return False
    for name in ("gemv_q4", "gemv_q8", "gemm_q4_amx", "gemm_q8_amx"):
        torch.library.register_fake(f"pagemill_native::{name}", _gemv_fake)
    from pagemill.kernels.gemv_q4_cpu import gemm_q4_amx_silu_mul_fake

    torch.library.register_fake("pagemill_native::gemm_q4_amx_silu_mul", gemm_q4_amx_silu_mul_fake)
    _gemv_ops_loaded = True
    return True


def _gemv_fake(x: torch.Tensor, blocks: torch.Tensor, n: int, planes: int = 2) -> torch.Tensor:
    return x.new_empty(x.shape[0], n)


# ---- paged decode attention ---------------------------------------------------------------------

# Set to 0 to call the decode kernel and the KV write through ctypes only.
ATTENTION_OPS_ENV = "PAGEMILL_NATIVE_ATTENTION_OPS"
_attention_ops_loaded = False


@functools.cache
def load_attention_ops() -> bool:
    """Build (once per machine and torch) and load `torch.ops.pagemill_native.paged_decode` /
    `paged_decode_out` / `write_kv_cache` / `write_kv_cache_quant`, the decode kernel and the
    KV write (into a cache in the compute dtype, or quantizing into an fp8/int8 one) as C++
    torch operators; whether they are loaded.

    One call through them costs an aten op's dispatch, where the ctypes path converts two dozen
    Python arguments per call, once per layer. Built like `load_gemv_ops` (the same library);
    when it cannot be, the ctypes path serves (one warning)."""
    global _attention_ops_loaded
    if _attention_ops_loaded:  # a library of operators loads once per process
        return True
    if os.environ.get(ATTENTION_OPS_ENV, "1") == "0":
        return False
    if not _load_torch_ops("calling the decode kernel through ctypes"):
        return False
    torch.library.register_fake("pagemill_native::paged_decode", _paged_decode_fake)
    torch.library.register_fake("pagemill_native::paged_decode_out", _paged_decode_out_fake)
    torch.library.register_fake("pagemill_native::write_kv_cache", _write_kv_cache_fake)
    torch.library.register_fake("pagemill_native::write_kv_cache_quant", _write_kv_cache_fake)
    _attention_ops_loaded = True
    return True


def attention_ops_loaded() -> bool:
    """Whether `load_attention_ops` loaded the operators in this process (it builds nothing:
    safe to call while dynamo traces, which reads the flag into the graph)."""
    return _attention_ops_loaded


def _paged_decode_fake(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _paged_decode_out_fake(*args: object, **kwargs: object) -> None:
    return None


def _write_kv_cache_fake(*args: object, **kwargs: object) -> None:
    return None


def build() -> Path | None:
    """The decode kernel's ctypes library built for this CPU (see `native_build`)."""
    return native_build.build_shared(_SOURCE, "the CPU decode kernel", "using the torch path")


@functools.cache
def load() -> ctypes.CDLL | None:
    """The built kernel library, or None when it cannot be built here (see the log)."""
    target = build()
    if target is None:
        return None
    lib = ctypes.CDLL(str(target))
    fn = lib.pagemill_paged_decode
    fn.restype = ctypes.c_int
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    fn.argtypes = [
        i32,
        ptr,
        ptr,
        ptr,
        ptr,
        ptr,
        i64,
        ptr,
        ptr,
        i64,
        i32,
        i32,
        i32,
        i32,
        i64,
        i64,
        i64,
        i64,
        ctypes.c_float,
        i32,
        ctypes.c_float,
        i32,
        ptr,
        ptr,
        ptr,
        i64,
        ptr,
        i32,
    ]
    return lib


# The kernels' codes of the 8-bit cache formats they convert by their bits (kv_format of
# `pagemill_paged_decode` and `pagemill_reshape_and_cache_quant`); other byte formats are
# read through their value table.
KV_FORMAT_CODES = {torch.float8_e4m3fn: 2, torch.float8_e5m2: 3, torch.int8: 4}


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the native kernel serves these tensors (CPU, a float dtype, dense layouts;
    the cache in q's dtype or in fp8)."""
    return q.device.type == "cpu" and q.stride(2) == 1 and supports_cache(q.dtype, k_cache)


def supports_cache(dtype: torch.dtype, k_cache: torch.Tensor) -> bool:
    """`supports` for any query of `dtype` laid out as it takes them (CPU, its last
    dimension contiguous): what can be known of a layer before a step."""
    return (
        dtype in DTYPE_CODES
        and k_cache.device.type == "cpu"
        and (k_cache.dtype == dtype or is_quantized_kv(k_cache.dtype))
        and k_cache.is_contiguous()
        and k_cache.shape[1] <= 256
        and k_cache.shape[3] <= 256
    )


def paged_decode(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    rows: torch.Tensor | None,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Attention of one query token per request into `out` (at `rows`, else row = request).

    `window` > 0 attends to each request's last `window` positions only (the walk starts
    at the window's first block, so a windowed layer reads only its window); `softcap` > 0
    caps the scaled scores as ``softcap * tanh(s / softcap)``. An fp8 cache is read as
    bytes (by their bits on the AVX-512 path under a bf16 q for float8_e4m3fn, float8_e5m2
    and int8, else through the format's value table), times ``k_scale``/``v_scale`` (CPU
    fp32, 0-dim: the layer's one scale, or contiguous [num_kv_heads]: one per KV head;
    None: 1.0). ``sinks`` (contiguous fp32 [num_heads], None: none) start each head's
    softmax with the sink's logit in its max and a 1 in its sum (see `paged_attention`).

    `block_tables` [S, W] and `seq_lens` [S] are contiguous int32, `rows` [S] int64; the
    caller (the planner) guarantees every table reaches its context.
    """
    if lib is load() and load_attention_ops():
        # The same kernel as a torch operator: no ctypes conversions (`load_attention_ops`).
        torch.ops.pagemill_native.paged_decode_out(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            rows,
            scale,
            window,
            softcap,
            k_scale,
            v_scale,
            sinks,
            out,
        )
        return
    num_seqs = block_tables.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    lut = decode_table(k_cache.dtype) if is_quantized_kv(k_cache.dtype) else None
    k_scale, v_scale, scale_stride = kernel_scales(k_scale, v_scale, num_kv_heads)
    status = lib.pagemill_paged_decode(
        DTYPE_CODES[q.dtype],
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        out.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        None if rows is None else rows.data_ptr(),
        num_seqs,
        q.shape[1],
        num_kv_heads,
        head_dim,
        block_size,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        float(scale),
        int(window),
        float(softcap),
        torch.get_num_threads(),
        None if lut is None else lut.data_ptr(),
        k_scale.data_ptr(),
        v_scale.data_ptr(),
        scale_stride,
        None if sinks is None else sinks.data_ptr(),
        KV_FORMAT_CODES.get(k_cache.dtype, 0),
    )
    if status:
        raise RuntimeError(f"paged_decode_cpu refused its arguments (status {status})")


_ONE = torch.ones((), dtype=torch.float32)


def kernel_scales(
    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The K and V scales as the kernel reads them, with their shared stride over KV heads
    (0: one per layer, read in place, no copy; 1: one per head). Mixed granularities (rare:
    a checkpoint with per-head K and per-tensor V) repeat the per-layer one."""
    if k_scale is None and v_scale is None:  # every layer of a cache in the compute dtype
        return _ONE, _ONE, 0
    k = _ONE if k_scale is None else k_scale
    v = _ONE if v_scale is None else v_scale
    for name, s in (("k_scale", k), ("v_scale", v)):
        if s.device.type != "cpu" or s.dtype != torch.float32:
            raise ValueError(f"{name} must be a CPU fp32 tensor, got {s.dtype} on {s.device}")
        if s.dim() != 0 and (s.shape != (num_kv_heads,) or not s.is_contiguous()):
            raise ValueError(
                f"{name} must be 0-dim or contiguous [{num_kv_heads}], got {tuple(s.shape)}"
            )
    if k.dim() == v.dim():
        return k, v, int(k.dim())
    return k.expand(num_kv_heads).contiguous(), v.expand(num_kv_heads).contiguous(), 1
