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
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

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

    def __init__(self) -> None:
        self._compiled: dict[str, Callable[..., torch.Tensor]] = {}
        self._dtypes: frozenset[torch.dtype] = frozenset()
        self._scratch: torch.Tensor | None = None

    def serves(self, dtype: torch.dtype) -> bool:
        """Whether logits of `dtype` run compiled kernels."""
        return dtype in self._dtypes

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
        return bool(self._compiled)

    def compile(self, vocab: int, device: torch.device, dtypes: tuple[torch.dtype, ...]) -> float:
        """Compile both kernels and run them on throwaway rows of each logits dtype in
        `dtypes`; returns seconds. A failure is logged and leaves the eager kernels."""
        start = time.perf_counter()
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
