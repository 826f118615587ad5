"""Packed weights kept across starts: a GGUF model's loaded state, saved once, mmapped after.

Serving a GGUF packs its rows for the CPU kernels (int4 planes, scales, the dense copies for
large batches) at every start, and that costs more than everything else a warm start does.
The result depends only on the file and on how the model was built to hold it, so it is
saved after the first load, as safetensors under `<pagemill cache>/weights/<key>/`, and a
later start fills a freshly built model from it instead of reading and packing the file.

The key is the file's identity (path, size, mtime and a digest of its first MiB, every
shard's for a split file), the model's structure before loading (`model_signature`: module
types, weight schemes and formats, shapes and dtypes; so the config, dtype and quantization
plan), its class-wide switches, the loading code's source, torch, Python and the CPU's
features. What is saved is every module's tensors (parameters, buffers and plain tensor
attributes, each storage once, so tied weights stay tied), and the plain attributes and
child modules that loading changed (a packed layer's format and group size, a dense head
dropped). A restored model must have the signature the loaded one had, or the entry is
discarded and the file loaded again; so is an entry that fails to read. Nothing here is
fatal: at worst the start packs as it would without the cache. Each entry is as large as
the served weights (dense copies included), so only the few entries of a file used last
are kept.

`PAGEMILL_WEIGHT_CACHE=0` turns it off (unset: it follows `PAGEMILL_COMPILE_CACHE`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

WEIGHT_CACHE_ENV = "PAGEMILL_WEIGHT_CACHE"
# Bump when what an entry holds, or how it is keyed, changes.
_FORMAT = 1
_TENSORS = "model.safetensors"
_META = "state.json"
# Entries kept per GGUF file (other dtypes, plans, versions of the loading code).
_KEEP_PER_FILE = 3
# The sources whose code decides the loaded tensors' values and layout.
_LOAD_SOURCES = (
    "model_executor/layers",
    "model_executor/quantization",
    "model_executor/models",
    "model_executor/gguf_weights.py",
    "model_executor/gguf_split.py",
    "model_executor/weights.py",
    "model_executor/weight_cache.py",
)


def weight_cache_enabled() -> bool:
    """`PAGEMILL_WEIGHT_CACHE` (0 or 1) when set, else whatever the compile cache is."""
    value = os.environ.get(WEIGHT_CACHE_ENV, "").strip()
    if value == "":
        from pagemill.runtime.worker.compilation import compile_cache_enabled

        return compile_cache_enabled()
    if value not in ("0", "1"):
        raise ValueError(f"{WEIGHT_CACHE_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def _file_identity(path: Path) -> list[Any]:
    stat = path.stat()
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(1 << 20)).hexdigest()[:16]
    return [str(path), stat.st_size, stat.st_mtime_ns, head]


def _source_digest() -> str:
    import pagemill.kernels
    import pagemill.runtime

    h = hashlib.sha256()
    paths: list[tuple[str, Path]] = []
    for root in map(Path, pagemill.kernels.__path__):
        paths += [(f"kernels/{p.relative_to(root)}", p) for p in root.rglob("*.py")]
    for root in map(Path, pagemill.runtime.__path__):
        for name in _LOAD_SOURCES:
            top = root / name
            if not top.exists():  # a moved file must not silently drop out of the key
                raise FileNotFoundError(f"weight cache key: {top} is missing")
            found = [top] if top.is_file() else sorted(top.rglob("*.py"))
            paths += [(f"runtime/{p.relative_to(root)}", p) for p in found]
    for rel, path in sorted(paths):
        h.update(rel.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _signature_digest(model: nn.Module) -> str:
    from pagemill.runtime.worker.compilation import model_signature

    return hashlib.sha256(json.dumps(model_signature(model)).encode()).hexdigest()[:16]


# ---- plain attributes as JSON ----------------------------------------------------------------

_PLAIN = (bool, int, float, str, type(None))


def _encodable(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_encodable(v) for v in value)
    return isinstance(value, (*_PLAIN, torch.dtype))


def _encode(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v) for v in value]}
    if isinstance(value, list):
        return {"list": [_encode(v) for v in value]}
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if "dtype" in value:
            dtype = getattr(torch, value["dtype"])
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"not a dtype: {value['dtype']!r}")
            return dtype
        if "tuple" in value:
            return tuple(_decode(v) for v in value["tuple"])
        return [_decode(v) for v in value["list"]]
    return value


def _plain_attributes(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Per module, its plain attributes (encoded), to see which loading changed."""
    out: dict[str, dict[str, Any]] = {}
    for name, module in model.named_modules():
        out[name] = {
            k: _encode(v)
            for k, v in vars(module).items()
            if not k.startswith("__") and not isinstance(v, torch.Tensor) and _encodable(v)
        }
    return out


def _children(model: nn.Module) -> dict[str, list[str]]:
    return {
        name: [k for k, v in module._modules.items() if v is not None]
        for name, module in model.named_modules()
    }


def _tensor_slots(module: nn.Module) -> Iterator[tuple[str, str, torch.Tensor | None]]:
    """(kind, name, tensor) for a module's parameters, buffers and plain tensor attributes."""
    for pname, p in module._parameters.items():
        yield "param", pname, p
    for bname, b in module._buffers.items():
        yield "buffer", bname, b
    for key, value in vars(module).items():
        if isinstance(value, torch.Tensor):
            yield "attr", key, value


class _Before:
    """What a built, not yet loaded model looks like: what loading changes is saved."""

    def __init__(self, model: nn.Module) -> None:
        self.plain = _plain_attributes(model)
        self.children = _children(model)


class WeightCache:
    """One key's entry; `restore` fills a built model from it, `save` writes it."""

    def __init__(self, model: nn.Module, gguf_files: list[Path], settings: dict[str, Any]):
        from pagemill.kernels import gemv_q4_cpu, gemv_q8_cpu
        from pagemill.runtime.model_executor.default_model import cache_dir
        from pagemill.runtime.worker.compilation import _cpu_flags, class_switches

        self.parts = {
            "format": _FORMAT,
            "files": [_file_identity(p) for p in gguf_files],
            "model": _signature_digest(model),
            "classes": class_switches(model),
            "settings": {k: repr(v) for k, v in sorted(settings.items())},
            "source": _source_digest(),
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "cpu": hashlib.sha256(_cpu_flags().encode()).hexdigest()[:16],
            # Whether int4 layers were laid out for the native GEMV: it may be switched off
            # (PAGEMILL_NATIVE_CPU_KERNELS=0) or fail to build, and then they must not be.
            "gemv_q4": gemv_q4_cpu.available(),
            "gemv_q8": gemv_q8_cpu.available(),
        }
        self.key = hashlib.sha256(json.dumps(self.parts, sort_keys=True).encode()).hexdigest()
        self.folder = cache_dir() / "weights" / self.key[:32]
        self._before = _Before(model)
        self.discarded = False  # restore() found an entry it could not use

    # ---- save ----------------------------------------------------------------------------

    def save(self, model: nn.Module, extra: dict[str, Any]) -> None:
        """Write the loaded `model`'s state (never raises: the next start loads the file)."""
        try:
            self._save(model, extra)
        except Exception:
            logger.warning(
                "weight cache: could not save to %s; the next start packs the weights again",
                self.folder,
                exc_info=True,
            )

    def _save(self, model: nn.Module, extra: dict[str, Any]) -> None:
        from safetensors.torch import save_file

        start = time.monotonic()
        stored: dict[tuple[Any, ...], str] = {}  # one entry per storage view: ties stay ties
        tensors: dict[str, torch.Tensor] = {}
        strides: dict[str, list[int]] = {}
        modules: dict[str, Any] = {}
        plain_after = _plain_attributes(model)
        children_after = _children(model)
        for name, module in model.named_modules():
            slots = []
            for kind, slot, t in _tensor_slots(module):
                if t is None:
                    slots.append([kind, slot, None, False])
                    continue
                if t.device.type != "cpu":
                    raise ValueError(f"{name}.{slot} is on {t.device}, not the CPU")
                view = (
                    t.untyped_storage().data_ptr(),
                    t.storage_offset(),
                    tuple(t.shape),
                    t.stride(),
                    t.dtype,
                )
                if view not in stored:
                    stored[view] = tid = f"t{len(stored)}"
                    tensors[tid] = t.detach().contiguous()
                    strides[tid] = list(t.stride())
                slots.append([kind, slot, stored[view], isinstance(t, nn.Parameter)])
            before = self._before.plain.get(name, {})
            changed = {
                k: v for k, v in plain_after[name].items() if k not in before or before[k] != v
            }
            dropped = [
                c for c in self._before.children.get(name, []) if c not in children_after[name]
            ]
            modules[name] = {"slots": slots, "plain": changed, "dropped": dropped}
        meta = {
            "key": self.key,
            "parts": self.parts,
            "signature": _signature_digest(model),
            "strides": strides,
            "modules": modules,
            "extra": extra,
        }
        self.folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".weights-", dir=self.folder.parent))
        try:
            save_file(tensors, str(tmp / _TENSORS))
            (tmp / _META).write_text(json.dumps(meta))
            shutil.rmtree(self.folder, ignore_errors=True)
            with contextlib.suppress(OSError):  # another process saved the same entry first
                tmp.rename(self.folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        logger.info(
            "weight cache: saved the packed weights to %s in %.1f s",
            self.folder,
            time.monotonic() - start,
        )
        self._evict_stale()

    def _evict_stale(self) -> None:
        """Keep the `_KEEP_PER_FILE` entries of this file used last: every change to the
        loading code keys a new entry, and each is the size of the served weights."""
        entries = []
        for meta_file in self.folder.parent.glob(f"*/{_META}"):
            try:
                parts = json.loads(meta_file.read_text()).get("parts", {})
                if parts.get("files") == self.parts["files"]:
                    entries.append((meta_file.stat().st_mtime, meta_file.parent))
            except (OSError, ValueError):
                continue
        for _, folder in sorted(entries, reverse=True)[_KEEP_PER_FILE:]:
            if folder != self.folder:
                logger.info("weight cache: removing %s (not used lately)", folder)
                shutil.rmtree(folder, ignore_errors=True)

    # ---- restore -------------------------------------------------------------------------

    def restore(self, model: nn.Module) -> dict[str, Any] | None:
        """Fill the built (unloaded) `model` from the entry and return what `save` was given
        as `extra`; None when there is no usable entry (a bad one is removed). After a None
        the model may be half filled: build it again before loading the file."""
        if not (self.folder / _META).is_file():
            return None
        try:
            meta = json.loads((self.folder / _META).read_text())
            if meta.get("key") != self.key:
                raise ValueError("the entry was written under another key")
            self._restore(model, meta)
            if _signature_digest(model) != meta["signature"]:
                raise ValueError("the restored model's structure differs from the loaded one's")
        except Exception as e:
            logger.warning(
                "weight cache: the entry in %s cannot be used (%s); removed, the weights are "
                "loaded from the file again",
                self.folder,
                e,
            )
            shutil.rmtree(self.folder, ignore_errors=True)
            self.discarded = True
            return None
        with contextlib.suppress(OSError):  # used now: the last to be evicted
            os.utime(self.folder / _META)
        extra: dict[str, Any] = meta.get("extra", {})
        return extra

    def _restore(self, model: nn.Module, meta: dict[str, Any]) -> None:
        from safetensors import safe_open

        modules = dict(model.named_modules())
        if set(modules) != set(meta["modules"]):
            raise ValueError("the model's modules differ from the entry's")
        with safe_open(str(self.folder / _TENSORS), framework="pt", device="cpu") as f:
            loaded = {tid: f.get_tensor(tid) for tid in f.keys()}  # noqa: SIM118
        for tid, stride in meta["strides"].items():
            t = loaded[tid]
            if list(t.stride()) != stride:  # saved contiguous; give the layout back
                loaded[tid] = torch.empty_strided(t.shape, stride, dtype=t.dtype).copy_(t)
        params: dict[str, nn.Parameter] = {}  # one Parameter per tensor: ties stay ties
        for name, entry in meta["modules"].items():
            module = modules[name]
            for child in entry["dropped"]:
                module._modules[child] = None
            for key, value in entry["plain"].items():
                object.__setattr__(module, key, _decode(value))
            new_params: dict[str, nn.Parameter | None] = {}
            new_buffers: dict[str, torch.Tensor | None] = {}
            for kind, slot, tid, is_param in entry["slots"]:
                t = None if tid is None else loaded[tid]
                if t is not None and is_param:
                    t = params.setdefault(tid, nn.Parameter(t, requires_grad=False))
                if kind == "param":
                    new_params[slot] = t
                elif kind == "buffer":
                    new_buffers[slot] = t
                else:
                    assert t is not None
                    object.__setattr__(module, slot, t)
            module._parameters = new_params
            module._buffers = new_buffers
