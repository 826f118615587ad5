"""Whole-row reductions of the sampler, written once for eager torch and torch.compile.

A random row's draw needs two facts about its whole vocabulary: the largest scaled logit
(z = logits / temperature) and, per block of `BLOCK` token ids, the sum of the candidate
tokens' weights exp(z - max). Eagerly each is several passes that write [rows, vocab] fp32
temporaries (convert, divide, subtract, exp, sum); compiled, inductor fuses each into one
read of the logits in their own dtype and writes only [rows] or [rows, vocab / BLOCK]. The
rest of a draw (choose a block, then a token inside it) touches `BLOCK` entries per row.

Candidates are what the sampler's rejection rounds leave (see `Sampler._draw_nucleus`):
the tokens that rank above a threshold token (`thr_z`, `thr_id`), ranks ordered as a sort
of the logits orders them: larger z first, equal z by smaller token id. Ranks compare z,
never the weights: z is one correctly rounded division, so eager code and compiled code
agree on every comparison (exp may differ by an ulp between them, which only moves a
weight by as much).

Rows are taken from `x` through `rows` (an index tensor), so a round over a few rows of a
large batch gathers inside the fused loop instead of copying them first.

On CPU the native passes (`pagemill.kernels.sampler_cpu`, C++ built at first use) serve
fp32 and bf16 logits first, compiled or not: one read of each row in its own dtype, no
temporaries, and the same code at every batch size (so a seeded row's weights do not
depend on whether its batch was large enough for the compiled graphs). torch.compile serves
the rest (other devices, or where no compiler can build the native code); eager torch
serves what neither does.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagemill.kernels import sampler_cpu

logger = logging.getLogger(__name__)

BLOCK = 256


def scaled_max(x: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """[n] fp32: the largest logit / temperature of each row of `x`."""
    return (x.float() / temperature.unsqueeze(1)).amax(dim=-1)


def block_sums(
    x: torch.Tensor,
    temperature: torch.Tensor,
    peak: torch.Tensor,
    thr_z: torch.Tensor,
    thr_id: torch.Tensor,
) -> torch.Tensor:
    """[n, ceil(vocab / BLOCK)] fp32: per block, the candidates' sum of exp(z - peak)."""
    z = x.float() / temperature.unsqueeze(1)
    w = torch.exp(z - peak.unsqueeze(1))
    # int32 ids: inductor's CPU loops vectorise int64 comparisons poorly (~2x slower).
    ids = torch.arange(z.shape[1], device=z.device, dtype=torch.int32).unsqueeze(0)
    tz, ti = thr_z.unsqueeze(1), thr_id.int().unsqueeze(1)
    w = torch.where((z > tz) | ((z == tz) & (ids < ti)), w, 0.0)
    pad = (-w.shape[1]) % BLOCK
    if pad:
        w = F.pad(w, (0, pad))
    return w.view(w.shape[0], -1, BLOCK).sum(dim=-1)


def block_sums_eager(
    x: torch.Tensor,
    temperature: torch.Tensor,
    peak: torch.Tensor,
    thr_z: torch.Tensor,
    thr_id: torch.Tensor,
    scratch: torch.Tensor,
) -> torch.Tensor:
    """`block_sums` in a few in-place passes over `scratch` ([n, >= vocab] fp32), with the
    threshold's comparisons skipped when no row has one (a first round)."""
    n, vocab = x.shape
    pad = (-vocab) % BLOCK
    w = scratch.view(-1)[: n * (vocab + pad)].view(n, vocab + pad)
    if pad:
        w[:, vocab:] = 0.0
    w = w[:, :vocab]
    # Converted into the buffer first: a mixed-dtype division would convert into a fresh
    # tensor of its own.
    w.copy_(x).div_(temperature.unsqueeze(1))
    if bool((thr_z > float("-inf")).any()):
        tz = thr_z.unsqueeze(1)
        drop = w < tz
        ties = w == tz
        if bool(ties.any()):
            ids = torch.arange(vocab, device=x.device).unsqueeze(0)
            drop |= ties & (ids >= thr_id.unsqueeze(1))
        w.sub_(peak.unsqueeze(1)).exp_().masked_fill_(drop, 0.0)
    else:
        w.sub_(peak.unsqueeze(1)).exp_()
    full = scratch.view(-1)[: n * (vocab + pad)].view(n, -1, BLOCK)
    return full.sum(dim=-1)


def pick_in_blocks(
    x: torch.Tensor,
    rows: torch.Tensor | None,
    sums: torch.Tensor,
    u: torch.Tensor,
    temperature: torch.Tensor,
    peak: torch.Tensor,
    thr_z: torch.Tensor,
    thr_id: torch.Tensor,
) -> torch.Tensor:
    """[n] token ids: per row, the first candidate whose running weight exceeds u x the
    row's candidate mass, from the row kernels' `sums` ([n, blocks]) and the chosen
    block's own weights, recomputed here as `block_sums` computes them.

    Sums are float64 from the blocks on. Rounding may put the target past the last block
    (or column) with any weight: it then takes that last one; a weight of 0 is never
    chosen. Within the block the target is placed as a share of the block's mass: its
    `sums` entry is an fp32 sum, ~1e-7 of itself away from the float64 sum of the weights
    walked here, and a remainder measured against one but walked against the other
    skipped the block's last candidates for a u near 1.
    """
    n, nb = sums.shape
    vocab = x.shape[1]
    cum = sums.double().cumsum(dim=-1)
    target = (u * cum[:, -1]).unsqueeze(1)
    b = torch.searchsorted(cum, target, right=True)
    idx = torch.arange(nb, device=x.device)
    b = torch.minimum(b, torch.where(sums > 0, idx, 0).amax(dim=-1, keepdim=True))
    before = torch.where(b > 0, cum.gather(1, (b - 1).clamp_min(0)), 0.0)
    cols = b * BLOCK + torch.arange(BLOCK, device=x.device)
    valid = cols < vocab
    cols = cols.clamp_max(vocab - 1)
    row_ids = torch.arange(n, device=x.device) if rows is None else rows
    z = x[row_ids.unsqueeze(1), cols].float() / temperature.unsqueeze(1)
    w = torch.exp(z - peak.unsqueeze(1))
    tz, ti = thr_z.unsqueeze(1), thr_id.unsqueeze(1)
    keep = valid & ((z > tz) | ((z == tz) & (cols < ti)))
    w = torch.where(keep, w, 0.0)
    icum = w.double().cumsum(dim=-1)
    block_sum = sums.gather(1, b).double()
    share = torch.where(block_sum > 0, (target - before) / block_sum, 0.0)
    j = torch.searchsorted(icum, share * icum[:, -1:], right=True)
    inner = torch.arange(BLOCK, device=x.device)
    j = torch.minimum(j, torch.where(w > 0, inner, 0).amax(dim=-1, keepdim=True))
    return (b * BLOCK + j).squeeze(1)


# The kernels over some rows of `x`, as compiled: the gather fuses into the loop. Each is
# its own code object, which dynamo caches graphs by.
def _scaled_max_of_rows(
    x: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor
) -> torch.Tensor:
    return scaled_max(x[rows], temperature)


def _block_sums_of_rows(x: torch.Tensor, rows: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
    return block_sums(x[rows], *args)


_COMPILED: dict[str, Callable[..., torch.Tensor]] = {}


def _compiled(name: str) -> Callable[..., torch.Tensor]:
    """One torch.compile wrapper per kernel and process: its graphs serve every sampler."""
    fn = _COMPILED.get(name)
    if fn is None:
        plain = _scaled_max_of_rows if name == "scaled_max" else _block_sums_of_rows
        fn = _COMPILED[name] = torch.compile(plain, dynamic=True, fullgraph=True)
    return fn


class RowKernels:
    """`scaled_max` and `block_sums` over some rows of the logits: compiled once `compile`
    has built them, eager before (and where compiling is unavailable).

    Compiling costs seconds (inductor's on-disk cache makes a later start cheaper), so it
    happens at start-up beside the model's own compile, never inside a request's step. The
    row count is a dynamic dimension, so one graph serves every batch; torch would
    specialise a count of 1 into a graph of its own, so a single row of a larger batch is
    padded to two, and a batch of one row runs eagerly.
    """

    def __init__(self, native: bool = True) -> None:
        self._compiled: dict[str, Callable[..., torch.Tensor]] = {}
        self._dtypes: frozenset[torch.dtype] = frozenset()
        self._scratch: torch.Tensor | None = None
        self._want_native = native
        self._native_built = False

    def _native(self, x: torch.Tensor) -> ctypes.CDLL | None:
        """The native library when it serves `x` (built at the first CPU call: seconds,
        once per machine; later starts load it from the cache folder)."""
        if not self._want_native or not sampler_cpu.supports(x):
            return None
        return sampler_cpu.load()

    def serves(self, x: torch.Tensor) -> bool:
        """Whether logits like `x` run in one pass in their own dtype (native or compiled
        kernels), so converting them to fp32 first would only add a pass."""
        return x.dtype in self._dtypes or self._native(x) is not None

    def topk(
        self, x: torch.Tensor, rows: torch.Tensor | None, temperature: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, ids) [n, k]: the k best z = x[rows] / temperature of each row, in a
        sort's order; only where `native_reads(x)` (torch's topk serves the rest)."""
        lib = self._native(x)
        assert lib is not None, "topk needs the native kernels (see native_reads)"
        return sampler_cpu.topk(lib, x, rows, temperature, k)

    def native_reads(self, x: torch.Tensor) -> bool:
        """Whether the native kernels read logits like `x` (in their own dtype): `argmax`
        is then fast on any of them, and `topk` available."""
        return self._native(x) is not None

    def argmax(self, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[n] int64: the argmax of rows `rows` of `x` (all when None)."""
        lib = self._native(x)
        if lib is not None:
            return sampler_cpu.argmax(lib, x, rows)
        return (x if rows is None else x[rows]).argmax(dim=-1)

    def _use_compiled(self, x: torch.Tensor) -> bool:
        # Logits of a dtype that was not compiled would be traced in the middle of a step.
        return x.dtype in self._dtypes and x.shape[0] > 1

    def _scratch_for(self, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        """A reused fp32 buffer of at least rows x cols (fresh large tensors cost page
        faults on every call)."""
        buf = self._scratch
        if buf is None or buf.numel() < rows * cols or buf.device != device:
            buf = self._scratch = torch.empty(rows * cols, device=device)
        return buf

    @property
    def compiled(self) -> bool:
        """Whether compiled code serves: the native CPU library or inductor's graphs."""
        return bool(self._compiled) or self._native_built

    def compile(self, vocab: int, device: torch.device, dtypes: tuple[torch.dtype, ...]) -> float:
        """Compile both kernels and run them on throwaway rows of each logits dtype in
        `dtypes`; returns seconds. A failure is logged and leaves the eager kernels.

        On CPU the native library serves those dtypes before any graph would: it is built
        (or loaded from the cache folder) instead, so a start traces nothing for the
        sampler and the first step does not build it."""
        start = time.perf_counter()
        native_dtypes = (torch.float32, torch.bfloat16)
        if self._want_native and device.type == "cpu" and all(d in native_dtypes for d in dtypes):
            self._native_built = sampler_cpu.load() is not None
            if self._native_built:
                return time.perf_counter() - start
        fns = {name: _compiled(name) for name in ("scaled_max", "block_sums")}
        try:
            # In inference mode, as the sampler runs: dynamo guards on grad mode and on
            # whether a tensor is an inference tensor (the engine's logits are).
            with torch.inference_mode():
                self._warm_up(fns, vocab, device, dtypes)
        except Exception:  # a slower sampler is better than no engine
            logger.warning("sampler: compiling its row kernels failed; eager", exc_info=True)
            return time.perf_counter() - start
        self._compiled = fns
        self._dtypes = frozenset(dtypes)
        return time.perf_counter() - start

    @staticmethod
    def _warm_up(
        fns: dict[str, Callable[..., torch.Tensor]],
        vocab: int,
        device: torch.device,
        dtypes: tuple[torch.dtype, ...],
    ) -> None:
        for dtype in dtypes:
            # Distinct tensors for distinct arguments: dynamo guards on aliasing.
            x = torch.zeros(3, vocab, dtype=dtype, device=device)
            rows = torch.arange(2, device=device)
            t = torch.ones(2, device=device)
            peak = fns["scaled_max"](x, rows, t)
            thr_z = torch.full((2,), float("-inf"), device=device)
            thr_id = torch.full((2,), vocab, device=device)
            fns["block_sums"](x, rows, t, peak, thr_z, thr_id)

    def _call(
        self, name: str, x: torch.Tensor, rows: torch.Tensor | None, *args: torch.Tensor
    ) -> torch.Tensor:
        """Compiled kernel `name` over rows `rows` of `x` (all when None); `x` has more
        than one row (a one-row batch would need graphs of its own, see the class
        docstring: it runs eagerly, where that costs little)."""
        compiled = self._compiled[name]
        if rows is None:
            rows = torch.arange(x.shape[0], device=x.device)
        # Dynamo guards on whether each tensor is an inference tensor: the small ones are
        # made so (the sampler runs in inference mode), as the graphs were built.
        small = [a if a.is_inference() else a.clone() for a in (rows, *args)]
        if rows.numel() != 1:
            return compiled(x, *small)
        two = [a.repeat(2) for a in small]  # see the class docstring
        return compiled(x, *two)[:1]

    def scaled_max(
        self, x: torch.Tensor, rows: torch.Tensor | None, temperature: torch.Tensor
    ) -> torch.Tensor:
        lib = self._native(x)
        if lib is not None:
            return sampler_cpu.block_sums(lib, x, rows, temperature, None, None, None, BLOCK)[0]
        if self._use_compiled(x):
            return self._call("scaled_max", x, rows, temperature)
        xr = x if rows is None else x[rows]
        n, vocab = xr.shape
        z = self._scratch_for(n, vocab + BLOCK, x.device)[: n * vocab].view(n, vocab)
        return z.copy_(xr).div_(temperature.unsqueeze(1)).amax(dim=-1)

    def block_sums(
        self,
        x: torch.Tensor,
        rows: torch.Tensor | None,
        temperature: torch.Tensor,
        peak: torch.Tensor,
        thr_z: torch.Tensor,
        thr_id: torch.Tensor,
    ) -> torch.Tensor:
        lib = self._native(x)
        if lib is not None:
            return sampler_cpu.block_sums(lib, x, rows, temperature, peak, thr_z, thr_id, BLOCK)[1]
        if self._use_compiled(x):
            return self._call("block_sums", x, rows, temperature, peak, thr_z, thr_id)
        xr = x if rows is None else x[rows]
        n, vocab = xr.shape
        scratch = self._scratch_for(n, vocab + BLOCK, x.device)
        return block_sums_eager(xr, temperature, peak, thr_z, thr_id, scratch)

    def first_round(
        self, x: torch.Tensor, rows: torch.Tensor | None, temperature: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(`scaled_max`, `block_sums` of every token): a first round's two reductions.
        Eagerly in one buffer, so the logits are converted and divided once."""
        lib = self._native(x)
        if lib is not None:
            return sampler_cpu.block_sums(lib, x, rows, temperature, None, None, None, BLOCK)
        n = x.shape[0] if rows is None else rows.numel()
        vocab = x.shape[1]
        thr_z = torch.full((n,), float("-inf"), device=x.device)
        thr_id = torch.full((n,), vocab, dtype=torch.long, device=x.device)
        if self._use_compiled(x):
            peak = self.scaled_max(x, rows, temperature)
            return peak, self.block_sums(x, rows, temperature, peak, thr_z, thr_id)
        xr = x if rows is None else x[rows]
        pad = (-vocab) % BLOCK
        buf = self._scratch_for(n, vocab + BLOCK, x.device)[: n * (vocab + pad)]
        w = buf.view(n, vocab + pad)
        if pad:
            w[:, vocab:] = 0.0
        w = w[:, :vocab]
        peak = w.copy_(xr).div_(temperature.unsqueeze(1)).amax(dim=-1)
        w.sub_(peak.unsqueeze(1)).exp_()
        return peak, buf.view(n, -1, BLOCK).sum(dim=-1)

    def pick(
        self,
        x: torch.Tensor,
        rows: torch.Tensor | None,
        sums: torch.Tensor,
        u: torch.Tensor,
        temperature: torch.Tensor,
        peak: torch.Tensor,
        thr_z: torch.Tensor,
        thr_id: torch.Tensor,
    ) -> torch.Tensor:
        """[n] tokens drawn by uniforms `u` from the candidates whose block sums are `sums`
        (see `pick_in_blocks`)."""
        lib = self._native(x)
        if lib is not None:
            return sampler_cpu.pick(lib, x, rows, sums, u, temperature, peak, thr_z, thr_id, BLOCK)
        return pick_in_blocks(x, rows, sums, u, temperature, peak, thr_z, thr_id)
