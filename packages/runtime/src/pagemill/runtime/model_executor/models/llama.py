"""Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2, SmolLM2) on pagemill kernels.

One module serves them all: the families differ only in configuration (rope scaling,
q/k/v biases, tied embeddings, head counts, Mistral's sliding window). Q/K/V and gate/up
are fused into one matmul each, since on a GPU one larger GEMM beats three small ones; the
loader splices Hugging Face's separate tensors into the fused weights. Its attention and
MLP are the shared layers of the other families too (`qwen3`, `phi3`, `gemma`), which set
what differs: q/k norms, partial RoPE, score scale and soft-cap, the activation.

The forward takes the flattened batch of a step (no padding, prefill and decode mixed) and
returns hidden states; logits are computed separately and only for the rows that sample.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagemill.kernels import (
    apply_rotary,
    paged_attention,
    rms_norm,
    rope_cos_sin,
    silu_and_mul,
    write_kv_cache,
)
from pagemill.kernels.ops import direct_decode, direct_decode_serves, direct_kv_write
from pagemill.kernels.rotary import apply_rotary_qk
from pagemill.runtime.distributed.parallel_layers import (
    row_parallel_linear,
    vocab_parallel_embedding,
)
from pagemill.runtime.distributed.parallel_state import TensorParallelGroup
from pagemill.runtime.model_config import ModelConfig
from pagemill.runtime.model_executor.gathered_params import gathered_view
from pagemill.runtime.model_executor.layers import Linear
from pagemill.runtime.model_executor.layers.prepacked import prepacked_linear
from pagemill.runtime.model_executor.quantization.formats import QuantizedRows, dequantize
from pagemill.runtime.model_executor.quantization.scheme import WeightScheme
from pagemill.runtime.worker.attention_metadata import AttentionMetadata

if TYPE_CHECKING:
    from pagemill.runtime.worker.kv_cache import LayerKVScales


# A forward's output: the final hidden states, and the auxiliary layers' inputs when asked.
ForwardOutput = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    # A compiled graph reads the weight from the model's one gathered tensor
    # (`gathered_params`): one graph input for every norm instead of one each.
    gathered_params = ("weight",)

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(size, dtype=dtype)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        weight = gathered_view(self, "weight") if torch.compiler.is_compiling() else None
        return rms_norm(x, self.weight if weight is None else weight, self.eps, residual)


class LlamaAttention(nn.Module):
    """Fused QKV, RoPE, paged attention, output projection.

    ``window`` (> 0: sliding-window layer) and ``softcap`` (> 0: Gemma 2's score cap) are
    this layer's and go to the attention op as plain numbers; ``scale`` defaults to
    ``head_dim ** -0.5``; ``qk_norm`` adds per-head RMSNorms on q and k before RoPE (Qwen3,
    Gemma 3). Only the first ``config.rotary_dim`` dimensions of each head rotate.
    Under tensor parallelism ``config`` is the rank's (its heads) and ``o_proj`` is
    row-parallel: its all-reduce is the layer's one exchange.
    """

    # Rotate q and k in one pass on CPU where nothing sits between the projection and the
    # rotation (`_rotates_qk_together`); a class-wide switch (in the compile cache's key)
    # so `benchmarks/step_ab.py --variant rotary-split` can compare both graphs.
    rotate_qk_together = True
    # In a compiled graph, call the C++ KV-write and decode operators directly where they
    # serve (`_compiled_attention`); False keeps the Python custom ops everywhere. A
    # class-wide switch (in the compile cache's key) for `benchmarks/step_ab.py --variant
    # python-ops`.
    direct_native_ops = True
    # In a compiled graph, slice the caches out of the pool they are views of (`_graph_kv`):
    # one graph input for every layer's K and V instead of two a layer, each costing every
    # call. A class-wide switch for `benchmarks/step_ab.py --variant per-layer-inputs`.
    read_kv_from_pool = True

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        *,
        window: int = 0,
        softcap: float = 0.0,
        scale: float | None = None,
        qk_norm: bool = False,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rotary_dim = config.rotary_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.scale = self.head_dim**-0.5 if scale is None else float(scale)
        self.window = int(window)
        self.softcap = float(softcap)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype) if qk_norm else None
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, config.attention_bias, dtype
        )
        self.o_proj = row_parallel_linear(
            self.q_size, config.hidden_size, config.o_proj_bias, dtype, tp
        )
        # Bound by the model runner once the KV pool exists (views into KVStorage).
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # The pool both caches are views of, and where ((element offset, shape) of K, of V),
        # when they are (bind_kv_caches): what a compiled graph reads them from.
        self.kv_pool: torch.Tensor | None = None
        self.kv_pool_slots: tuple[tuple[int, tuple[int, ...]], ...] = ()
        self.kv_scales: LayerKVScales | None = None  # read by an fp8 KV cache only
        # Attention sinks (gpt-oss): one fp32 logit per query head, set by models that have them.
        self.sinks: nn.Parameter | None = None
        # The KV cache group whose block table this layer reads (bind_kv_caches).
        self.kv_group = 0
        # A decode-only step's block tables [max seqs, max blocks] and context lengths
        # [max seqs] (int32) for the C++ decode operator in a compiled graph: buffers the
        # model runner binds (shared by a group's layers) and fills before such a step.
        # Attributes, not inputs: their sizes never change, so they add no symbols, and
        # the graph takes the step's first rows by its token count.
        self.decode_tables: torch.Tensor | None = None
        self.decode_lens: torch.Tensor | None = None

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        cos_sin: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("KV cache not bound: call LlamaForCausalLM.bind_kv_caches first")
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self._rotates_qk_together(qkv):
            qk = qkv[:, : self.q_size + self.kv_size]
            qk = qk.reshape(t, self.num_heads + self.num_kv_heads, self.head_dim)
            q, k = apply_rotary_qk(positions, qk, self.num_heads, cos_sin)
        else:
            q, k = self._norm_projections(q, k)
            q = q.reshape(t, self.num_heads, self.head_dim)
            k = k.reshape(t, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self._rotate(positions, q, k, cos_sin)
        if meta.groups is not None:
            meta = meta.groups[self.kv_group]
        ks = vs = None
        if self.kv_scales is not None:
            if self.kv_scales.pending and not torch.compiler.is_compiling():
                self.kv_scales.calculate(k, v)
            ks, vs = self.kv_scales.k_scale, self.kv_scales.v_scale
        if torch.compiler.is_compiling():
            out = self._compiled_attention(q, k, v, t, meta, ks, vs)
        else:
            plan = meta.attention_plan()
            write_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping, ks, vs)
            out = paged_attention(
                q,
                self.k_cache,
                self.v_cache,
                plan.block_tables,
                plan.query_start_loc,
                plan.seq_lens,
                self.scale,
                plan=plan,
                window=self.window,
                softcap=self.softcap,
                k_scale=ks,
                v_scale=vs,
                sinks=self.sinks,
            )
        return self.o_proj(out.reshape(t, self.q_size))

    def _compiled_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        t: int,
        meta: AttentionMetadata,
        ks: torch.Tensor | None,
        vs: torch.Tensor | None,
    ) -> torch.Tensor:
        """The KV write and attention as the graph calls them: the C++ operators with plain
        tensors where they serve (the write on CPU caches in the compute dtype or fp8/int8;
        attention on decode-only steps, `meta.native_decode`), else one custom op each (see
        pagemill.kernels.ops), the attention op with the step's plan."""
        k_cache, v_cache = self._graph_kv()
        direct = self.direct_native_ops
        if not (direct and direct_kv_write(k, v, k_cache, v_cache, meta.slot_mapping, ks, vs)):
            torch.ops.pagemill.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, ks, vs)
        if (
            direct
            and meta.native_decode
            and self.decode_tables is not None
            and self.decode_lens is not None
        ):
            out = direct_decode(
                q,
                k_cache,
                v_cache,
                self.decode_tables[:t],
                self.decode_lens[:t],
                self.scale,
                self.window,
                self.softcap,
                ks,
                vs,
                self.sinks,
            )
            if out is not None:
                return out
        if meta.plan is None:
            # The runner defers the plan only where every layer's cache suits the C++
            # decode operator (`serves_native_decode`): tracing a plan built here is not
            # possible.
            raise RuntimeError(
                "a decode step without an attention plan reached a layer whose tensors the "
                "C++ decode operator does not take"
            )
        return torch.ops.pagemill.paged_attention(
            q,
            k_cache,
            v_cache,
            meta.plan,
            self.scale,
            self.window,
            self.softcap,
            ks,
            vs,
            self.sinks,
        )

    def _graph_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The caches as a compiled graph reads them: slices of the pool they are views of
        (one graph input for every layer's caches, `read_kv_from_pool`), else themselves."""
        assert self.k_cache is not None and self.v_cache is not None
        pool = self.kv_pool
        if not self.read_kv_from_pool or pool is None:
            return self.k_cache, self.v_cache
        (k_start, k_shape), (v_start, v_shape) = self.kv_pool_slots
        return (
            pool[k_start : k_start + math.prod(k_shape)].view(k_shape),
            pool[v_start : v_start + math.prod(v_shape)].view(v_shape),
        )

    def serves_native_decode(self, dtype: torch.dtype) -> bool:
        """Whether a compiled decode-only step (`AttentionMetadata.native_decode`) runs this
        layer on the C++ decode operator whatever the batch, so the step needs no plan."""
        return (
            self.direct_native_ops
            and self.decode_tables is not None
            and self.decode_lens is not None
            and self.k_cache is not None
            and self.v_cache is not None
            and direct_decode_serves(dtype, self.k_cache, self.v_cache, self.sinks)
        )

    def bind_pool(self, pool: torch.Tensor | None) -> None:
        """Note where the bound caches lie in `pool` when both are contiguous views of it (a
        1-D pool, e.g. `KVCache.pool`); otherwise the graph reads the caches themselves."""
        self.kv_pool, self.kv_pool_slots = None, ()
        k, v = self.k_cache, self.v_cache
        if pool is None or k is None or v is None or pool.dim() != 1:
            return
        slots = []
        for t in (k, v):
            start, rem = divmod(t.data_ptr() - pool.data_ptr(), pool.element_size())
            if (
                rem
                or t.dtype != pool.dtype
                or not t.is_contiguous()
                or not 0 <= start <= pool.numel() - t.numel()
            ):
                return
            slots.append((start, tuple(t.shape)))
        self.kv_pool, self.kv_pool_slots = pool, tuple(slots)

    def _rotates_qk_together(self, qkv: torch.Tensor) -> bool:
        """Whether q and k rotate as one tensor of heads straight from the projection
        (`apply_rotary_qk`): on CPU, for full RoPE with nothing between the projection
        and the rotation (no q/k norms, no subclass's own norms or rotation)."""
        cls = type(self)
        return (
            self.rotate_qk_together
            and qkv.device.type == "cpu"
            and self.rotary_dim == self.head_dim
            and self.q_norm is None
            and cls._norm_projections is LlamaAttention._norm_projections
            and cls._rotate is LlamaAttention._rotate
        )

    def _norm_projections(
        self, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Norms over the whole q and k projections, before the heads split (OLMo 2)."""
        return q, k

    def _rotate(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.rotary_dim
        if r == 0:  # a layer without positions (SmolLM3's NoPE layers)
            return q, k
        if r == self.head_dim:
            return apply_rotary(positions, q, k, cos_sin)
        # Partial RoPE (Phi-3 family): the leading r dimensions rotate, the rest pass.
        qr, kr = apply_rotary(positions, q[..., :r], k[..., :r], cos_sin)
        return torch.cat((qr, q[..., r:]), dim=-1), torch.cat((kr, k[..., r:]), dim=-1)


class LlamaMLP(nn.Module):
    """Gated MLP with fused gate|up: ``down(act(gate(x)) * up(x))``; ``act_and_mul`` is
    SiLU (Llama) or tanh-GELU (Gemma's GeGLU). Under tensor parallelism ``config`` holds
    the rank's MLP columns and ``down_proj`` is row-parallel."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        act_and_mul: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * inter, config.mlp_bias, dtype)
        self.down_proj = row_parallel_linear(inter, config.hidden_size, config.mlp_bias, dtype, tp)
        self.act_and_mul = act_and_mul
        # SiLU goes through the gate | up layer, which can apply it inside its own product
        # (`Linear.act_and_mul_forward`); other activations stay a step of their own.
        self.fused_act = "silu" if act_and_mul is silu_and_mul else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_act is not None:
            return self.down_proj(self.gate_up_proj.act_and_mul_forward(x, self.fused_act))
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    # Qwen3 sets this: per-head RMSNorm on q and k.
    qk_norm = False

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        layer: int = 0,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(
            config, dtype, window=config.layer_window(layer), qk_norm=self.qk_norm, tp=tp
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = self._make_mlp(config, dtype, layer, tp)

    def _make_mlp(
        self, config: ModelConfig, dtype: torch.dtype, layer: int, tp: TensorParallelGroup | None
    ) -> nn.Module:
        """The layer's MLP (mixture-of-experts models put a sparse block here)."""
        return LlamaMLP(config, dtype, tp=tp)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried separately so each norm fuses the preceding add.
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, cos_sin, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderLayer(Protocol):
    """What `LlamaForCausalLM` reads of each of its layers (every ``layer_cls`` has it)."""

    input_layernorm: RMSNorm
    self_attn: LlamaAttention
    post_attention_layernorm: RMSNorm
    mlp: LlamaMLP


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head. Build it on the target device: `with torch.device(d): ...`.

    Subclasses swap ``layer_cls`` and extend `_targets` (checkpoint names) where their
    layers or checkpoints differ.

    With a tensor-parallel group ``tp``, ``config`` is this rank's share of the model
    (`distributed.sharding.ShardLayout.local_config`): its heads, MLP columns and vocabulary
    rows. The embedding is then vocab-parallel and `compute_logits` returns this rank's
    vocabulary columns, which the model runner gathers.
    """

    layer_cls: type[nn.Module] = LlamaDecoderLayer

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        max_position: int,
        tp: TensorParallelGroup | None = None,
        aux_hidden_state_layers: Sequence[int] = (),
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.tp = tp
        # Layers whose inputs the forward also returns (EAGLE-3's features): a plain
        # attribute read when tracing, so compiled graphs and CUDA graphs include them.
        self.aux_hidden_state_layers: tuple[int, ...] = tuple(aux_hidden_state_layers)
        self.embed_tokens = _param(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            self.layer_cls(config, dtype, i, tp=tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else _param(config.vocab_size, config.hidden_size, dtype=dtype)
        )
        # Set by the loader for a pooling-only engine: a checkpoint may lack the LM head.
        self.pooling_only = False
        # The LM head as a Linear when it is served in another format (quantized); set by
        # `serve_lm_head_as` before the weights load. None: logits from lm_head_weight.
        self.logits_proj: Linear | None = None
        # cos|sin table in fp32: rotating in low precision would drift from the reference.
        self.register_buffer(
            "cos_sin",
            rope_cos_sin(
                config.rotary_dim,
                max_position,
                config.rope_theta,
                config.rope_scaling,
                device=self.embed_tokens.device,
            ),
            persistent=False,
        )

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def decoder_layers(self) -> list[DecoderLayer]:
        """`layers`, typed: a ModuleList yields plain Modules."""
        return [cast(DecoderLayer, layer) for layer in self.layers]

    def bind_kv_caches(
        self,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        kv_scales: list[LayerKVScales] | None = None,
        kv_groups: list[int] | None = None,
        kv_pool: torch.Tensor | None = None,
    ) -> None:
        """Bind each layer's KV tensors (and scales; `kv_groups`: each layer's KV cache
        group, whose block table and slots it then reads from the step's metadata;
        `kv_pool`: a 1-D tensor the KV tensors are views of, see `LlamaAttention.bind_pool`)."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(
                f"got KV caches for {len(kv_caches)} layers, model has {len(self.layers)}"
            )
        scales: list[LayerKVScales | None] = [None] * len(kv_caches)
        if kv_scales is not None:
            scales = list(kv_scales)
        groups = kv_groups if kv_groups is not None else [0] * len(kv_caches)
        for layer, (k, v), sc, g in zip(self.decoder_layers(), kv_caches, scales, groups):
            layer.self_attn.k_cache = k
            layer.self_attn.v_cache = v
            layer.self_attn.kv_scales = sc
            layer.self_attn.kv_group = g
            layer.self_attn.bind_pool(kv_pool)

    def unbind_kv_caches(self) -> None:
        for layer in self.decoder_layers():
            layer.self_attn.k_cache = None
            layer.self_attn.v_cache = None
            layer.self_attn.kv_scales = None
            layer.self_attn.bind_pool(None)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.embedding(input_ids, self.embed_tokens)
        return vocab_parallel_embedding(
            input_ids, self.embed_tokens, self.tp.rank * self.config.vocab_size, self.tp
        )

    def set_aux_hidden_state_layers(self, layers: Sequence[int]) -> None:
        """Return these layers' inputs too (vLLM's name); before the forward is compiled."""
        self.aux_hidden_state_layers = tuple(layers)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> ForwardOutput:
        """input_ids, positions [T] -> final hidden states [T, hidden]; with
        `aux_hidden_state_layers`, also those layers' inputs (id 0: the embedding),
        concatenated in their order [T, n x hidden]."""
        x = self.embed(input_ids)
        residual: torch.Tensor | None = None
        aux_ids = self.aux_hidden_state_layers
        taken: dict[int, torch.Tensor] = {}
        # By index, not `for layer in self.layers`: iterating a ModuleList makes dynamo
        # guard on its dict's key order, a guard that cannot be rebuilt when a compiled
        # graph is loaded from the compile cache (`compilation`).
        layers = self.layers
        for i in range(len(layers)):
            if i in aux_ids:
                taken[i] = x if residual is None else x + residual
            x, residual = layers[i](positions, x, residual, self.cos_sin, meta)
        x, _ = self.norm(x, residual)
        if aux_ids:
            return x, torch.cat([taken[i] for i in aux_ids], dim=-1)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab], called on the sampled rows only."""
        if self.logits_proj is not None:
            return self.logits_proj(hidden)
        return prepacked_linear(hidden, self.lm_head_weight, None)

    # ---- weights -------------------------------------------------------------------------

    def serve_lm_head_as(self, scheme: WeightScheme) -> Linear:
        """Compute logits through a `Linear` with `scheme` (e.g. int8) instead of the dense head.

        Call before loading: the head's checkpoint rows (the embedding's, when tied) then
        load into it too. A tied head keeps the embedding as its dense copy for large row
        counts (it exists anyway); an untied one keeps `lm_head` only if `scheme` asks.
        """
        c = self.config
        proj = Linear(c.hidden_size, c.vocab_size, False, self.dtype)
        proj.scheme = scheme
        self.logits_proj = proj
        return proj

    def _targets(self) -> dict[str, list[tuple[torch.Tensor | Linear, int, int]]]:
        """HF tensor name -> [(our parameter or Linear, row offset, rows)] for every tensor we
        need."""
        c = self.config
        q, kv, inter = c.q_size, c.kv_size, c.intermediate_size
        t: dict[str, list[tuple[torch.Tensor | Linear, int, int]]] = {
            "model.embed_tokens.weight": [(self.embed_tokens, 0, c.vocab_size)],
            "model.norm.weight": [(self.norm.weight, 0, c.hidden_size)],
        }
        if self.lm_head is not None:
            t["lm_head.weight"] = [
                (self.lm_head if self.logits_proj is None else self.logits_proj, 0, c.vocab_size)
            ]
        elif self.logits_proj is not None:
            t["model.embed_tokens.weight"].append((self.logits_proj, 0, c.vocab_size))
        for i, layer in enumerate(self.decoder_layers()):
            p = f"model.layers.{i}."
            a, m = layer.self_attn, layer.mlp
            if getattr(layer, "input_layernorm", None) is not None:  # OLMo 2 norms after
                t[p + "input_layernorm.weight"] = [(layer.input_layernorm.weight, 0, c.hidden_size)]
            t[p + "post_attention_layernorm.weight"] = [
                (layer.post_attention_layernorm.weight, 0, c.hidden_size)
            ]
            for name, off, rows in (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)):
                t[p + f"self_attn.{name}.weight"] = [(a.qkv_proj, off, rows)]
                if a.qkv_proj.bias is not None:
                    t[p + f"self_attn.{name}.bias"] = [(a.qkv_proj.bias, off, rows)]
            if a.q_norm is not None and a.k_norm is not None:
                t[p + "self_attn.q_norm.weight"] = [(a.q_norm.weight, 0, c.head_dim)]
                t[p + "self_attn.k_norm.weight"] = [(a.k_norm.weight, 0, c.head_dim)]
            t[p + "self_attn.o_proj.weight"] = [(a.o_proj, 0, c.hidden_size)]
            if a.o_proj.bias is not None:
                t[p + "self_attn.o_proj.bias"] = [(a.o_proj.bias, 0, c.hidden_size)]
            if not isinstance(m, LlamaMLP):  # a sparse block lists its own (fused_moe)
                continue
            for name, off in (("gate_proj", 0), ("up_proj", inter)):
                t[p + f"mlp.{name}.weight"] = [(m.gate_up_proj, off, inter)]
                if m.gate_up_proj.bias is not None:
                    t[p + f"mlp.{name}.bias"] = [(m.gate_up_proj.bias, off, inter)]
            t[p + "mlp.down_proj.weight"] = [(m.down_proj, 0, c.hidden_size)]
            if m.down_proj.bias is not None:
                t[p + "mlp.down_proj.bias"] = [(m.down_proj.bias, 0, c.hidden_size)]
        return t

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedRows]]) -> None:
        """Copy checkpoint tensors into the (fused) parameters; raise listing what is missing.

        A value is a dense tensor or quantized rows (from a GGUF file): `Linear`s take either
        (and pack them as their scheme says), plain parameters get them dequantized.
        Tensors the model does not use (rotary inv_freq buffers, a tied checkpoint's
        duplicate lm_head) are skipped; a shape mismatch names the tensor and both shapes.
        """
        targets = self._targets()
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith("model.") is False and name != "lm_head.weight":
                name = "model." + name  # some exports drop the "model." prefix
            for target, off, rows in targets.get(name, ()):
                if isinstance(target, Linear):
                    dest_shape: tuple[int, ...] = (rows, target.in_features)
                else:
                    dest_shape = tuple(
                        target.narrow(0, off, rows).shape if target.dim() >= 1 else target.shape
                    )
                if tuple(dest_shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                        f"the config implies {tuple(dest_shape)}"
                    )
                if isinstance(target, Linear):
                    target.load_rows(off, tensor)
                else:
                    dest = target.narrow(0, off, rows) if target.dim() >= 1 else target
                    dest.copy_(dequantize(tensor, target.dtype))
                loaded.add(name)
        missing = sorted(set(targets) - loaded)
        if missing == ["lm_head.weight"] and self.pooling_only and self.logits_proj is None:
            # An embedding checkpoint saved from the base model: a pooling engine never
            # computes logits, so the head stays zero instead of being required.
            assert self.lm_head is not None
            self.lm_head.zero_()
            missing = []
        if missing:
            shown = ", ".join(missing[:10]) + (
                f", ... ({len(missing)} in all)" if len(missing) > 10 else ""
            )
            raise ValueError(f"checkpoint is missing tensor(s): {shown}")
        self.finalize_weights()

    def finalize_weights(self) -> None:
        """Let every layer convert its loaded weights to the format it computes with."""
        proj = self.logits_proj
        if proj is not None and self.lm_head is None and not proj.finalized:
            assert proj.weight is not None  # not finalized yet: the dense weight is there
            proj.weight.copy_(self.embed_tokens)  # dummy weights: a tied head is the embedding
        for module in self.modules():
            if isinstance(module, Linear):
                module.finalize()
        if proj is None:
            return
        if proj.format == "dense":  # nothing to gain over the dense head
            self.logits_proj = None
            if self.lm_head is not None and proj.weight is not None:
                self.lm_head = proj.weight
        elif self.lm_head is None:
            # Tied: the embedding is the dense copy for large row counts, at no extra memory.
            proj.use_dense_weight(self.embed_tokens)
        else:
            # Untied and packed: `lm_head` is the packed head's dense copy, or nothing.
            self.lm_head = (
                proj.weight
                if proj.weight is not None
                else _param(0, self.config.hidden_size, dtype=self.dtype)
            )

    @torch.no_grad()
    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights from the config alone, for measuring shapes we have no files for.

        Small normal values (std 0.02, as HF initialises) keep activations finite through
        any number of layers; norms are ones.
        """
        # Drawn where the weights live: an 8B model's worth of CPU randn would take minutes.
        gen = torch.Generator(device=self.embed_tokens.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)
        self.finalize_weights()
