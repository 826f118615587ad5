"""Writing this step's K/V into the paged cache, one slot per token.

The runtime computes ``slot = block_table[p // B] * B + p % B`` for every token it feeds;
a slot of -1 marks a token whose K/V must not be stored (e.g. a padded row), so the op
skips it rather than clobbering block 0.

On CPU a cache in the compute dtype is written by the native kernel library's
``pagemill_reshape_and_cache`` (`csrc/paged_decode_cpu.cpp`): one call copies K and V and
checks the slots as it goes, where the torch path takes two ``index_copy_`` calls and
reads the slots back to check them. It is reached through the C++ operator
``torch.ops.pagemill_native.write_kv_cache`` (`cpu_native.load_attention_ops`), else ctypes.

A float8 or int8 cache (``--kv-cache-dtype fp8`` / ``int8``) stores ``saturate(x / scale)``
(int8: rounded) with the layer's ``k_scale``/``v_scale``, one per layer (0-dim) or one per KV
head (``[num_kv_heads]``; see `pagemill.kernels.kv_quant`); other caches take x as it is.
On CPU the native ``pagemill_reshape_and_cache_quant`` quantizes and stores in one pass
(``torch.ops.pagemill_native.write_kv_cache_quant``, else ctypes), the same bytes as
`kv_quant.quantize` gives; the torch path quantizes into a temporary and copies it.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from pagemill.kernels import cpu_native
from pagemill.kernels._dispatch import check_triton_device, lazy_kernels, next_pow2, use_triton
from pagemill.kernels.kv_quant import (
    check_scale,
    is_per_head,
    is_quantized_kv,
    quant_max,
    quantize,
)

_kernels = lazy_kernels("kv_cache")


def _check_args(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(
            "k and v must both be [num_tokens, num_kv_heads, head_dim]; "
            f"got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    check_scale("k_scale", k_scale, k.shape[1])
    check_scale("v_scale", v_scale, k.shape[1])
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]; "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if tuple(k.shape[1:]) != tuple(k_cache.shape[2:]):
        raise ValueError(
            f"k is [T, {k.shape[1]}, {k.shape[2]}] but the cache holds "
            f"[.., .., {k_cache.shape[2]}, {k_cache.shape[3]}]"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(
            f"slot_mapping must be [num_tokens={k.shape[0]}], got {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")


@functools.cache
def _native_write() -> Any:
    lib = cpu_native.load()
    if lib is None:
        return None
    fn = lib.pagemill_reshape_and_cache
    fn.restype = ctypes.c_int
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64]
    return fn


def native_write_serves(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """Whether the native CPU write takes these tensors as they are: CPU, the caches in k's
    dtype and contiguous, each token's heads as contiguous rows (shapes, dtypes and strides
    only: free inside a trace)."""
    return k.dtype == v.dtype == k_cache.dtype == v_cache.dtype and _native_layout(
        k, v, k_cache, v_cache, slot_mapping
    )


def _native_layout(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """The layout both native writes read: CPU tensors, k/v [T, H, D] with each token's
    heads as contiguous rows, contiguous caches [B, S, H, D] of one shape."""
    return (
        k.device.type == "cpu"
        and k_cache.device.type == "cpu"
        and slot_mapping.device.type == "cpu"
        and k.dim() == 3
        and k.shape == v.shape
        and k_cache.dim() == 4
        and k_cache.shape == v_cache.shape
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and tuple(k.shape[1:]) == tuple(k_cache.shape[2:])
        and k.stride(2) == 1
        and v.stride(2) == 1
        and k.stride(1) == k.shape[2]
        and v.stride(1) == v.shape[2]
    )


@functools.cache
def _native_quant_write() -> Any:
    lib = cpu_native.load()
    if lib is None:
        return None
    fn = lib.pagemill_reshape_and_cache_quant
    fn.restype = ctypes.c_int
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn.argtypes = [i32, i32, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i32, i32, ptr, ptr, i64, i64]
    return fn


def native_quant_write_serves(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """Whether the native CPU write quantizes into these caches: as `native_write_serves`,
    but an fp8 or int8 cache (both caches of one format) under k/v in a float dtype."""
    return (
        k.dtype == v.dtype
        and k.dtype in cpu_native.DTYPE_CODES
        and k_cache.dtype == v_cache.dtype
        and k_cache.dtype in cpu_native.KV_FORMAT_CODES
        and _native_layout(k, v, k_cache, v_cache, slot_mapping)
    )


def write_kv_cache_quant_cpu_native(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> bool:
    """The native CPU write of ``k``/``v`` quantized into an fp8/int8 cache (the bytes
    `kv_quant.quantize` gives) at their slots (-1: skipped); False, having written nothing,
    where it does not serve these tensors. A slot outside the cache is a ValueError. The
    scales are checked by the caller (`_check_args`) or by the operator."""
    if not native_quant_write_serves(k, v, k_cache, v_cache, slot_mapping):
        return False
    if cpu_native.load_attention_ops():
        torch.ops.pagemill_native.write_kv_cache_quant(
            k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale
        )
        return True
    fn = _native_quant_write()
    if fn is None:
        return False
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return True
    slots = slot_mapping.to(torch.int64).contiguous()
    ks, vs, scale_stride = cpu_native.kernel_scales(k_scale, v_scale, k.shape[1])
    status = fn(
        cpu_native.DTYPE_CODES[k.dtype],
        cpu_native.KV_FORMAT_CODES[k_cache.dtype],
        k.data_ptr(),
        v.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        num_tokens,
        k.stride(0),
        v.stride(0),
        k.shape[1],
        k.shape[2],
        ks.data_ptr(),
        vs.data_ptr(),
        scale_stride,
        k_cache.shape[0] * k_cache.shape[1],
    )
    if status == 1:
        raise ValueError(
            f"a slot of {slots.tolist()} is outside the cache "
            f"({k_cache.shape[0] * k_cache.shape[1]} slots)"
        )
    if status:
        raise RuntimeError(f"pagemill_reshape_and_cache_quant refused its arguments ({status})")
    return True


def write_kv_cache_cpu_native(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """The native CPU write of ``k``/``v`` [T, KV heads, D] at their slots (-1: skipped);
    False, having written nothing, where it does not serve these tensors (not CPU, a cache
    not in k's dtype or not contiguous, rows not contiguous, no native library): the
    caller then takes the torch path. A slot outside the cache is a ValueError."""
    if not native_write_serves(k, v, k_cache, v_cache, slot_mapping):
        return False
    if cpu_native.load_attention_ops():
        # The same copy as a torch operator: no ctypes conversions per layer.
        torch.ops.pagemill_native.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
        return True
    fn = _native_write()
    if fn is None:
        return False
    slots = slot_mapping.to(torch.int64).contiguous()
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return True
    esize = k.element_size()
    status = fn(
        k.data_ptr(),
        v.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        num_tokens,
        k.stride(0) * esize,
        v.stride(0) * esize,
        k.shape[1] * k.shape[2] * esize,
        k_cache.shape[0] * k_cache.shape[1],
    )
    if status:
        raise ValueError(
            f"a slot of {slots.tolist()} is outside the cache "
            f"({k_cache.shape[0] * k_cache.shape[1]} slots)"
        )
    return True


def write_kv_cache_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    _check_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if write_kv_cache_cpu_native(k, v, k_cache, v_cache, slot_mapping):
        return
    if write_kv_cache_quant_cpu_native(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale):
        return
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.int64)
    keep = slots >= 0
    if not bool(keep.all()):
        k, v, slots = k[keep], v[keep], slots[keep]
    if slots.numel() == 0:
        return
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if int(slots.max()) >= num_slots:
        raise ValueError(f"slot {int(slots.max())} is outside the cache ({num_slots} slots)")
    for src, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        if is_quantized_kv(cache.dtype):
            # index_copy_ has no float8 kernel: the bytes move through uint8 views.
            src = quantize(src, scale, cache.dtype).view(torch.uint8)
            cache = cache.view(torch.uint8)
        else:
            src = src.to(cache.dtype)
        try:
            flat = cache.view(num_slots, cache.shape[2], cache.shape[3])
        except RuntimeError:
            # A cache whose block and slot axes cannot merge into one view: index both.
            cache[slots // cache.shape[1], slots % cache.shape[1]] = src
            continue
        flat.index_copy_(0, slots, src)


def write_kv_cache_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    _check_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    check_triton_device(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(2) != 1 or v.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("k, v and the caches need a contiguous last (head_dim) axis")
    fp8 = is_quantized_kv(k_cache.dtype)  # fp8 or int8 codes, written as bytes
    one = None
    if fp8 and (k_scale is None or v_scale is None):
        one = torch.ones((), dtype=torch.float32, device=k.device)
    _kernels.write_kv_cache_kernel[(num_tokens,)](
        k,
        v,
        k_cache.view(torch.uint8) if fp8 else k_cache,
        v_cache.view(torch.uint8) if fp8 else v_cache,
        slot_mapping.contiguous(),
        (k_scale if k_scale is not None else one) if fp8 else k,
        (v_scale if v_scale is not None else one) if fp8 else v,
        # 0: one scale per layer, 1: one per KV head (the kernel reads scale[h * stride]).
        int(fp8 and is_per_head(k_scale)),
        int(fp8 and is_per_head(v_scale)),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        H_PAD=next_pow2(num_kv_heads),
        D_PAD=next_pow2(head_dim),
        FP8=fp8,
        E4M3=k_cache.dtype == torch.float8_e4m3fn,
        INT8=k_cache.dtype == torch.int8,
        FP8_MAX=quant_max(k_cache.dtype) if fp8 else 0.0,
    )


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store k/v at their slots; ``k_scale``/``v_scale`` (fp32, 0-dim or [num_kv_heads])
    quantize for an fp8 or int8 cache (None: 1.0) and are ignored by a cache in a float
    compute dtype."""
    impl = write_kv_cache_triton if use_triton(k) else write_kv_cache_torch
    impl(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
