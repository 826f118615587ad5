"""Native CPU passes of the sampler (penalties, argmax, block sums, inverse-CDF pick, top-k),
built at first use.

`csrc/sampler_cpu.cpp` is plain C++ built like the decode attention kernel (see
`cpu_native`): once per machine into the cache folder, called through ctypes. It reads the
logits in their own dtype (fp32 or bf16) and reduces each row while it is in cache, where
torch makes a pass and an fp32 temporary per elementwise op. Without a compiler, or if the
build fails, `load()` returns None and the sampler's torch kernels run (one warning);
``PAGEMILL_NATIVE_CPU_KERNELS=0`` turns it off as it does the attention kernel.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Any

import torch

from pagemill.kernels.native_build import build_shared

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "sampler_cpu.cpp"
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def build() -> Path | None:
    """The library `load()` loads, built for this CPU (see `native_build`)."""
    return build_shared(_SOURCE, "the sampler's CPU kernels", "the sampler uses torch")


@functools.cache
def load() -> ctypes.CDLL | None:
    """The built library, or None when it cannot be built here (see the log)."""
    target = build()
    if target is None:
        return None
    lib = ctypes.CDLL(str(target))
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    row_args: list[type[Any]] = [i32, ptr, i64, ptr, i64, i64]  # dtype, x, stride, rows, n, vocab
    lib.pagemill_sampler_argmax.restype = i32
    lib.pagemill_sampler_argmax.argtypes = [*row_args, ptr, i32]
    lib.pagemill_sampler_block_sums.restype = i32
    lib.pagemill_sampler_block_sums.argtypes = [
        *row_args, ptr, ptr, i32, ptr, ptr, ptr, i64, i64, i32
    ]  # fmt: skip
    lib.pagemill_sampler_pick.restype = i32
    lib.pagemill_sampler_pick.argtypes = [
        *row_args, ptr, ptr, ptr, ptr, ptr, i64, i64, ptr, ptr, i32
    ]  # fmt: skip
    lib.pagemill_sampler_topk.restype = i32
    lib.pagemill_sampler_topk.argtypes = [*row_args, ptr, i64, ptr, ptr, i32]
    lib.pagemill_sampler_penalize.restype = i32
    lib.pagemill_sampler_penalize.argtypes = [
        i32, ptr, i64, ptr, i64, i32, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr,
        i32,
    ]  # fmt: skip
    return lib


def supports(x: torch.Tensor) -> bool:
    """Whether the native passes read these logits: CPU, fp32 or bf16, unit column stride."""
    return x.device.type == "cpu" and x.dtype in _DTYPE_CODES and x.dim() == 2 and x.stride(1) == 1


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check(status: int) -> None:
    if status != 0:
        raise RuntimeError(f"sampler CPU kernel failed with status {status}")


def _rows_of(x: torch.Tensor, rows: torch.Tensor | None) -> tuple[torch.Tensor | None, int]:
    if rows is None:
        return None, x.shape[0]
    rows = rows.to(torch.int64).contiguous()
    return rows, rows.numel()


def argmax(lib: ctypes.CDLL, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """[n] int64: torch.argmax(x[rows], dim=-1) (all rows when None), first maximum first."""
    rows, n = _rows_of(x, rows)
    out = torch.empty(n, dtype=torch.int64)
    _check(
        lib.pagemill_sampler_argmax(
            _DTYPE_CODES[x.dtype],
            x.data_ptr(),
            x.stride(0),
            _ptr(rows),
            n,
            x.shape[1],
            out.data_ptr(),
            torch.get_num_threads(),
        )
    )
    return out


def block_sums(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    rows: torch.Tensor | None,
    temperature: torch.Tensor,
    peak: torch.Tensor | None,
    thr_z: torch.Tensor | None,
    thr_id: torch.Tensor | None,
    block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(peak [n] fp32, sums [n, ceil(vocab / block)] fp32) over rows `rows` of `x`: the
    largest z = x / temperature per row (computed when `peak` is None) and, per block of
    token ids, the sum of exp(z - peak) over the candidates (every token without a
    threshold, else those ranked above (thr_z, thr_id))."""
    rows, n = _rows_of(x, rows)
    vocab = x.shape[1]
    nb = -(-vocab // block)
    temperature = temperature.to(torch.float32).contiguous()
    compute = peak is None
    peak = torch.empty(n) if peak is None else peak.to(torch.float32).contiguous().clone()
    if thr_z is not None:
        thr_z = thr_z.to(torch.float32).contiguous()
        thr_id = torch.as_tensor(thr_id).to(torch.int64).contiguous()
    sums = torch.empty(n, nb)
    _check(
        lib.pagemill_sampler_block_sums(
            _DTYPE_CODES[x.dtype],
            x.data_ptr(),
            x.stride(0),
            _ptr(rows),
            n,
            vocab,
            temperature.data_ptr(),
            peak.data_ptr(),
            int(compute),
            _ptr(thr_z),
            _ptr(thr_id),
            sums.data_ptr(),
            nb,
            block,
            torch.get_num_threads(),
        )
    )
    return peak, sums


def pick(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    rows: torch.Tensor | None,
    sums: torch.Tensor,
    u: torch.Tensor,
    temperature: torch.Tensor,
    peak: torch.Tensor,
    thr_z: torch.Tensor | None,
    thr_id: torch.Tensor | None,
    block: int,
) -> torch.Tensor:
    """[n] int64: per row, the token that uniform `u` (float64) draws by inverse CDF from
    the candidates whose block sums are `sums` (same thresholds as `block_sums`)."""
    rows, n = _rows_of(x, rows)
    sums = sums.to(torch.float32).contiguous()
    temperature = temperature.to(torch.float32).contiguous()
    peak = peak.to(torch.float32).contiguous()
    u = u.to(torch.float64).contiguous()
    if thr_z is not None:
        thr_z = thr_z.to(torch.float32).contiguous()
        thr_id = torch.as_tensor(thr_id).to(torch.int64).contiguous()
    out = torch.empty(n, dtype=torch.int64)
    _check(
        lib.pagemill_sampler_pick(
            _DTYPE_CODES[x.dtype],
            x.data_ptr(),
            x.stride(0),
            _ptr(rows),
            n,
            x.shape[1],
            temperature.data_ptr(),
            peak.data_ptr(),
            _ptr(thr_z),
            _ptr(thr_id),
            sums.data_ptr(),
            sums.shape[1],
            block,
            u.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
    )
    return out


def topk(
    lib: ctypes.CDLL, x: torch.Tensor, rows: torch.Tensor | None, temperature: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [n, k] fp32, ids [n, k] int64): the k best of z = x[rows] / temperature, in
    a sort's order (larger z first, equal z by smaller id), without a [n, vocab] result."""
    rows, n = _rows_of(x, rows)
    temperature = temperature.to(torch.float32).contiguous()
    values = torch.empty(n, k)
    ids = torch.empty(n, k, dtype=torch.int64)
    _check(
        lib.pagemill_sampler_topk(
            _DTYPE_CODES[x.dtype],
            x.data_ptr(),
            x.stride(0),
            _ptr(rows),
            n,
            x.shape[1],
            temperature.data_ptr(),
            k,
            values.data_ptr(),
            ids.data_ptr(),
            torch.get_num_threads(),
        )
    )
    return values, ids


def penalize(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    out: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
    histories: torch.Tensor | None,
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> None:
    """`out` (fp32, [n, vocab], unit column stride) = `x` (fp32 or bf16) with logit_bias
    added, then repetition, frequency and presence penalties applied at the ids each row
    has seen, in the torch path's order and arithmetic; `out` may be `x` itself (fp32).

    `histories` [n, 4] int64 per row: the address and length of its distinct prompt ids
    (int64; read only where repetition != 1) and of its output ids (int64), both kept
    alive by the caller; None when no row has a penalty. `bias` (offsets [n + 1], ids,
    values fp32): row r's biases are entries offsets[r] .. offsets[r + 1]; ids outside
    the vocabulary raise ValueError before anything is written."""
    n, vocab = x.shape
    if out.shape != x.shape or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError("penalize writes fp32 rows shaped like its input")
    in_place = out.data_ptr() == x.data_ptr()
    if in_place and x.dtype != torch.float32:
        raise ValueError("penalize converts bf16 logits into another tensor, not in place")
    rep = repetition.to(torch.float32).contiguous()
    freq = frequency.to(torch.float32).contiguous()
    pres = presence.to(torch.float32).contiguous()
    if histories is None:
        histories = torch.zeros(n, 4, dtype=torch.int64)
    h = histories.to(torch.int64).contiguous()
    if h.shape != (n, 4):
        raise ValueError(f"penalize needs [{n}, 4] histories, got {tuple(h.shape)}")
    cols = h.t().contiguous()  # prompt address, prompt length, output address, output length
    offsets = ids = values = None
    if bias is not None:
        offsets = bias[0].to(torch.int64).contiguous()
        ids = bias[1].to(torch.int64).contiguous()
        values = bias[2].to(torch.float32).contiguous()
    status = lib.pagemill_sampler_penalize(
        _DTYPE_CODES[x.dtype],
        x.data_ptr(),
        x.stride(0),
        out.data_ptr(),
        out.stride(0),
        int(not in_place),
        n,
        vocab,
        rep.data_ptr(),
        freq.data_ptr(),
        pres.data_ptr(),
        cols[0].data_ptr(),
        cols[1].data_ptr(),
        cols[2].data_ptr(),
        cols[3].data_ptr(),
        _ptr(offsets),
        _ptr(ids),
        _ptr(values),
        torch.get_num_threads(),
    )
    if status == -2:
        raise ValueError(f"a logit_bias token id is outside the vocabulary of {vocab}")
    _check(status)
