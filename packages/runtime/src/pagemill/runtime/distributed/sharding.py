"""Which slice of each weight a rank holds (Megatron-style), and the checkpoint cut to fit.

A rank's model is the same module as a single-device model, built from a *local* config:
``num_attention_heads / tp`` query heads, its KV heads, ``intermediate_size / tp`` MLP
columns and ``vocab / tp`` (padded) vocabulary rows. So the fused q|k|v and gate|up
`Linear`s are laid out per rank exactly as they are on one device — [q_r; k_r; v_r] and
[gate_r; up_r] — and the model's own loader fills them once each checkpoint tensor has
been cut to this rank's slice here:

* column-parallel (output rows split): q/k/v, gate/up (Phi-3's pre-fused qkv and gate_up
  are split into their pieces first, each piece cut, then re-joined);
* row-parallel (input columns split): o_proj and down_proj; their bias is added once, by
  rank 0 (the other ranks hold zeros), since the partial sums are all-reduced;
* vocab-parallel: embedding and LM head rows, the vocabulary padded with zero rows to a
  multiple of the ranks (the padded logits are cut off after the gather);
* replicated: norms (also Qwen3's per-head q/k norms), everything else — except OLMo 2's
  q/k norms, which span the whole projection and are cut like it;
* mixture-of-experts: every expert and the shared expert are cut by their own
  intermediate size like the dense MLP (gate/up/w1/w3 rows, down/w2 columns: see
  `layers.fused_moe`), the routers (``gate``, ``shared_expert_gate``) replicated;
  gpt-oss's stacked experts likewise (gate/up interleaved on the last axis, so a rank's
  columns are one contiguous run of pairs; the down bias once, by rank 0), its attention
  sinks with their query heads.

KV heads: with at least as many KV heads as ranks each rank holds ``kv / tp`` of them;
with fewer, each KV head is replicated on ``tp / kv`` ranks, the ones whose query heads
read it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import torch

from pagemill.runtime.model_config import ModelConfig
from pagemill.runtime.model_executor.quantization.formats import QuantizedRows, dequantize
from pagemill.runtime.moe_config import moe_spec


def check_tensor_parallel(config: ModelConfig, tp: int) -> None:
    """Refuse a split the model's shape does not allow, saying what would."""
    if tp == 1:
        return
    heads, kv, inter = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.intermediate_size,
    )
    problems = []
    if heads % tp:
        problems.append(f"num_attention_heads={heads} is not divisible by it")
    elif kv % tp and tp % kv:
        problems.append(f"num_key_value_heads={kv} is neither a multiple nor a divisor of it")
    if inter % tp:
        problems.append(f"intermediate_size={inter} is not divisible by it")
    moe = moe_spec(config.hf_config)
    expert_sizes = (
        {}
        if moe is None
        else {
            "the experts' intermediate size": moe.intermediate_size,
            "shared_expert_intermediate_size": moe.shared_intermediate_size,
        }
    )
    for what, size in expert_sizes.items():
        if size % tp:
            problems.append(f"{what} {size} is not divisible by it")
    if problems:
        ok = [
            n
            for n in range(1, heads + 1)
            if heads % n == 0
            and inter % n == 0
            and (kv % n == 0 or n % kv == 0)
            and all(size % n == 0 for size in expert_sizes.values())
        ]
        raise ValueError(
            f"tensor_parallel_size={tp} cannot split {config.architecture}: "
            + "; ".join(problems)
            + f" (sizes that work: {', '.join(map(str, ok))})"
        )


@dataclass(frozen=True)
class ShardLayout:
    """Rank `rank` of `size`: the heads, MLP columns and vocabulary rows it holds."""

    rank: int
    size: int
    head_dim: int
    q_heads: tuple[int, int]  # [first, first + count)
    kv_heads: tuple[int, int]
    num_kv_heads: int  # the full model's, to cut k/v rows
    intermediate: tuple[int, int]
    vocab_size: int  # the full model's
    vocab_per_rank: int

    @classmethod
    def create(cls, config: ModelConfig, size: int, rank: int) -> ShardLayout:
        check_tensor_parallel(config, size)
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        nq = heads // size
        if kv >= size:
            nkv, kv_first = kv // size, rank * (kv // size)
        else:  # replicated: rank r's query heads all read KV head r * kv // size
            nkv, kv_first = 1, rank * kv // size
        ni = config.intermediate_size // size
        per_rank = -(-config.vocab_size // size)
        return cls(
            rank,
            size,
            config.head_dim,
            (rank * nq, nq),
            (kv_first, nkv),
            kv,
            (rank * ni, ni),
            config.vocab_size,
            per_rank,
        )

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The config this rank's module is built from (its slice of every split size)."""
        return replace(
            config,
            num_attention_heads=self.q_heads[1],
            num_key_value_heads=self.kv_heads[1],
            intermediate_size=self.intermediate[1],
            vocab_size=self.vocab_per_rank,
        )

    # ---- cutting checkpoint tensors ------------------------------------------------------------

    def _rows(self, first_head: int, count: int) -> slice:
        return slice(first_head * self.head_dim, (first_head + count) * self.head_dim)

    def _q(self) -> slice:
        return self._rows(*self.q_heads)

    def _kv(self) -> slice:
        return self._rows(*self.kv_heads)

    def _mlp(self) -> slice:
        first, count = self.intermediate
        return slice(first, first + count)

    def _vocab(self, t: torch.Tensor) -> torch.Tensor:
        start = self.vocab_start
        part = t[start : start + self.vocab_per_rank]
        short = self.vocab_per_rank - part.shape[0]
        if short:
            part = torch.cat([part, part.new_zeros(short, *part.shape[1:])])
        return part

    def _expert(self, module: str, t: torch.Tensor) -> torch.Tensor:
        """An expert's (or the shared expert's) slice: its own intermediate size / ranks."""
        if module in ("gate_proj", "up_proj", "w1", "w3"):
            n = t.shape[0] // self.size
            return t[self.rank * n : (self.rank + 1) * n]
        if module in ("down_proj", "w2"):
            n = t.shape[1] // self.size
            return t[:, self.rank * n : (self.rank + 1) * n]
        raise ValueError(f"unknown expert tensor {module!r}")

    def _stacked_experts(self, kind: str, t: torch.Tensor) -> torch.Tensor:
        """gpt-oss's [E, H, 2I] gate|up (pairs interleaved), [E, 2I] bias, [E, I, H] down
        and [E, H] down bias (see `models.gpt_oss`)."""
        if kind in ("gate_up_proj", "gate_up_proj_bias"):
            n = t.shape[-1] // self.size
            return t[..., self.rank * n : (self.rank + 1) * n]
        if kind == "down_proj":
            n = t.shape[1] // self.size
            return t[:, self.rank * n : (self.rank + 1) * n]
        if kind == "down_proj_bias":
            return t if self.rank == 0 else torch.zeros_like(t)
        raise ValueError(f"unknown stacked expert tensor {kind!r}")

    def shard(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name` (a view, or a new tensor)."""
        leaf = name.rsplit(".", 2)
        module, kind = (leaf[-2], leaf[-1]) if len(leaf) >= 2 else ("", leaf[-1])
        if module == "experts":  # gpt-oss: every expert stacked in one tensor
            return self._stacked_experts(kind, t)
        if ".experts." in name or ".shared_expert." in name:
            return self._expert(module, t)
        if kind == "sinks":  # gpt-oss: one per query head
            first, count = self.q_heads
            return t[first : first + count]
        if module in ("q_proj",):
            return t[self._q()]
        if module in ("k_proj", "v_proj"):
            return t[self._kv()]
        if module in ("gate_proj", "up_proj"):
            return t[self._mlp()]
        if module == "qkv_proj":  # Phi-3: [q; k; v] rows in one tensor
            hd = self.head_dim
            q_rows = t.shape[0] - 2 * self.num_kv_heads * hd
            q, k, v = t.split([q_rows, self.num_kv_heads * hd, self.num_kv_heads * hd])
            return torch.cat([q[self._q()], k[self._kv()], v[self._kv()]])
        if module == "gate_up_proj":  # Phi-3: [gate; up]
            gate, up = t.chunk(2)
            return torch.cat([gate[self._mlp()], up[self._mlp()]])
        if module in ("q_norm", "k_norm") and t.shape[0] != self.head_dim:
            # OLMo 2 normalises whole projections: a rank holds its heads' part.
            return t[self._q() if module == "q_norm" else self._kv()]
        if module in ("o_proj", "down_proj"):
            if kind == "bias":  # added once: by rank 0 after the partial sums meet
                return t if self.rank == 0 else torch.zeros_like(t)
            return t[:, self._q() if module == "o_proj" else self._mlp()]
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return self._vocab(t)
        return t


def shard_checkpoint(
    weights: Iterable[tuple[str, torch.Tensor | QuantizedRows]],
    layout: ShardLayout,
    dtype: torch.dtype,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint as this rank's model expects it: every tensor cut to its slice.

    Quantized rows (a GGUF checkpoint) are dequantized first: packed int4/int8 groups are
    not split across ranks, so under tensor parallelism a GGUF model is served dense.
    """
    for name, t in weights:
        if not isinstance(t, torch.Tensor):
            t = dequantize(t, dtype)
        yield name, layout.shard(name, t).contiguous()
