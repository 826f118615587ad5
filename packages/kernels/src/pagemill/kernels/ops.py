"""The KV write and paged attention as torch.library custom ops, for compiled graphs.

torch.compile traces a model's forward into one graph. These two steps do not trace: the
attention runs a plan's per-chunk loop and the KV write checks slots on the host. As
custom ops they enter the graph as single opaque calls, so the graph never breaks at them
and everything between them (norms, rotary, projections, activations) compiles and fuses.
The attention plan crosses the graph as an opaque object: it is built once per step on
the host and the compiled graph only hands it on.

Eager code calls `paged_attention` / `write_kv_cache` directly: a custom op's dispatch
costs more than nothing, and only a graph needs the wrapping. `COMPILE_READY` is False
on a torch that cannot pass opaque objects through a graph (the engine then stays eager).
A layer's sliding window and soft-cap are plain int/float arguments: constants of the
graph, one per layer, never part of the shared plan; its attention sinks (gpt-oss) an
optional tensor.

On CPU with the C++ operators loaded (`cpu_native.load_attention_ops`) a graph skips these
custom ops where it can (`direct_kv_write`, `direct_decode`): their bodies are Python, which
the compiled graph calls back into at every layer of every step, through dynamo's frame
lookup. The KV write then is the C++ operator in every graph (a cache in the compute
dtype); attention is, in the graphs of decode-only steps, the C++ decode operator over
plain block tables and lengths (the model runner's decode buffers), the kernel the plan's
native path runs. Prefill and mixed steps, fp8 writes and other devices keep the custom ops.
"""

from __future__ import annotations

import torch

from pagemill.kernels import cpu_native
from pagemill.kernels._opaque import register_opaque
from pagemill.kernels.attention import AttentionPlan, paged_attention
from pagemill.kernels.attention_cpu import TorchPlan
from pagemill.kernels.kv_cache import (
    native_quant_write_serves,
    native_write_serves,
    write_kv_cache,
    write_kv_cache_cpu_native,
    write_kv_cache_quant_cpu_native,
)
from pagemill.kernels.kv_quant import is_quantized_kv

COMPILE_READY = register_opaque(AttentionPlan)

_LIB = torch.library.Library("pagemill", "DEF")
_LIB.define(
    "write_kv_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
    "Tensor slot_mapping, Tensor? k_scale=None, Tensor? v_scale=None) -> ()"
)
if COMPILE_READY:
    _LIB.define(
        "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, "
        f"{torch._library.opaque_object.get_opaque_type_name(AttentionPlan)} plan, "
        "float scale, int window=0, float softcap=0.0, Tensor? k_scale=None, "
        "Tensor? v_scale=None, Tensor? sinks=None) -> Tensor"
    )


def _write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    if (
        k_cache.device.type == "cpu"
        and slot_mapping.dtype == torch.int64
        and is_quantized_kv(k_cache.dtype)
        and write_kv_cache_quant_cpu_native(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    ):
        return  # quantized in one native pass (scales checked by the operator)
    if (
        k_cache.device.type != "cpu"
        or slot_mapping.dtype != torch.int64
        or k_cache.dtype != k.dtype
    ):
        write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    # Compiled graphs are driven by the model runner, which derives every slot from block
    # tables it owns: valid by construction. So this path skips the checks of
    # `write_kv_cache` (-1 slots, bounds), which cost two host syncs in each layer.
    if write_kv_cache_cpu_native(k, v, k_cache, v_cache, slot_mapping):
        return  # one native call, its slot check costs no host sync
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    k_cache.view(num_slots, k_cache.shape[2], k_cache.shape[3]).index_copy_(0, slot_mapping, k)
    v_cache.view(num_slots, v_cache.shape[2], v_cache.shape[3]).index_copy_(0, slot_mapping, v)


def _write_kv_cache_fake(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    return None


_LIB.impl("write_kv_cache", _write_kv_cache, "CompositeExplicitAutograd")
torch.library.register_fake("pagemill::write_kv_cache", _write_kv_cache_fake, lib=_LIB)

if COMPILE_READY:

    def _paged_attention(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: AttentionPlan,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        impl = plan.impl
        if (
            isinstance(impl, TorchPlan)
            and impl.native is not None
            and not impl.decode
            and not impl.prefill
            and q.shape[0] == plan.num_tokens
            and q.shape[1] == plan.num_heads
            and q.dtype == plan.dtype
            and k_cache.shape == plan.k_cache_shape
            and cpu_native.supports(q, k_cache)
            and (sinks is None or (sinks.dtype == torch.float32 and sinks.is_contiguous()))
        ):
            # A decode-only step on the native kernel: the common case at batch 1, where
            # the general entry's checks and dispatch cost about as much as the kernel
            # (12 of 37 us per layer, measured). The plan was built for these tensors.
            lib = cpu_native.load()
            fp8 = is_quantized_kv(k_cache.dtype)
            if lib is not None:
                nd = impl.native
                out = torch.empty_like(q)
                cpu_native.paged_decode(
                    lib,
                    q,
                    k_cache,
                    v_cache,
                    out,
                    nd.tables,
                    nd.lens,
                    nd.rows,
                    scale,
                    window,
                    softcap,
                    k_scale if fp8 else None,
                    v_scale if fp8 else None,
                    sinks,
                )
                return out
        return paged_attention(
            q,
            k_cache,
            v_cache,
            plan.block_tables,
            plan.query_start_loc,
            plan.seq_lens,
            scale,
            plan=plan,
            window=window,
            softcap=softcap,
            k_scale=k_scale,
            v_scale=v_scale,
            sinks=sinks,
        )

    def _paged_attention_fake(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: AttentionPlan,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return torch.empty_like(q)

    _LIB.impl("paged_attention", _paged_attention, "CompositeExplicitAutograd")
    torch.library.register_fake("pagemill::paged_attention", _paged_attention_fake, lib=_LIB)


# ---- the C++ operators themselves, for a compiled graph's decode steps ----------------------


def direct_kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> bool:
    """Inside a trace: put the KV write into the graph as the C++ operator
    (`torch.ops.pagemill_native.write_kv_cache`, or `write_kv_cache_quant` with the layer's
    scales for an fp8/int8 cache) where it serves these tensors (CPU, the cache in k's
    dtype or an 8-bit format the kernel quantizes to, the layouts it reads), and say
    whether it did; False: nothing was traced, the caller puts in the custom op
    (`torch.ops.pagemill.write_kv_cache`).

    The custom op's body is Python: the compiled graph leaves its C++ code for it at every
    layer of every step, and a Python frame called from a compiled region also pays
    dynamo's frame lookup. The checks here read shapes, dtypes and strides, which the
    graph fixes, so they cost nothing at run time; whether the operators are loaded is
    read, never built, here (`cpu_native.attention_ops_loaded`: a build inside a trace
    would be traced)."""
    if not (
        slot_mapping.dtype == torch.int64
        and k_cache.dim() == 4
        and cpu_native.attention_ops_loaded()
    ):
        return False
    if native_write_serves(k, v, k_cache, v_cache, slot_mapping):
        torch.ops.pagemill_native.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
        return True
    if native_quant_write_serves(k, v, k_cache, v_cache, slot_mapping):
        torch.ops.pagemill_native.write_kv_cache_quant(
            k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale
        )
        return True
    return False


def direct_decode_serves(
    dtype: torch.dtype,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> bool:
    """Whether `direct_decode` takes a layer's caches and sinks for queries of `dtype` (a
    query laid out as the model makes it: CPU, its last dimension contiguous); known before
    a step, so a caller can skip the plan the fallback would need."""
    return (
        k_cache.dim() == 4
        and cpu_native.supports_cache(dtype, k_cache)
        and v_cache.shape == k_cache.shape
        and v_cache.dtype == k_cache.dtype
        and v_cache.is_contiguous()
        and (sinks is None or (sinks.dtype == torch.float32 and sinks.is_contiguous()))
        and cpu_native.attention_ops_loaded()
    )


def direct_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Inside a trace, for a decode-only step (one query token per request, row = request):
    attention as the C++ decode operator (`torch.ops.pagemill_native.paged_decode`, the
    kernel the plan's native path runs, so the same numbers) over plain tensors, `tables`
    [S, W] and `lens` [S] int32; None where it does not serve these tensors (nothing was
    traced: the caller runs the custom op with the plan)."""
    if not (
        cpu_native.supports(q, k_cache)
        and tables.dtype == torch.int32
        and lens.dtype == torch.int32
        and direct_decode_serves(q.dtype, k_cache, v_cache, sinks)
    ):
        return None
    fp8 = is_quantized_kv(k_cache.dtype)
    out: torch.Tensor = torch.ops.pagemill_native.paged_decode(
        q,
        k_cache,
        v_cache,
        tables,
        lens,
        None,
        scale,
        window,
        softcap,
        k_scale if fp8 else None,
        v_scale if fp8 else None,
        sinks,
    )
    return out
