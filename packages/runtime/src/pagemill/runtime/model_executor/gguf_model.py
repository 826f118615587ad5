"""A GGUF file as a model folder: its config, tokenizer and chat template extracted once.

A `.gguf` file carries everything a model needs — architecture and shape in its metadata,
the tokenizer (vocabulary, merges, special ids) and usually a chat template — but the rest
of the engine reads "a model folder". `prepare_gguf_folder` checks the file (architecture
and tensor types, so a file that cannot be served fails at once and says why), writes
config.json from the file's metadata (`gguf_arch`: llama.cpp's conventions per
architecture) and generation_config.json, and has transformers extract the tokenizer and
chat template, into a cache folder keyed by the file's path, size and mtime (every shard's,
for a split file: `gguf_split`). The weights stay in the file:

- quantized rows (Q4_0/Q4_1/Q8_0, Q5_x, the K-quants, IQ4_NL/IQ4_XS) are kept packed
  where the quantization plan allows (bf16 on CPU), F32 / F16 / BF16 are read as they
  are, and everything is dequantized in the compute dtype for fp32 or GPU compute
  (`gguf_weights`, `quantization.gguf_blocks`), straight from the memory-mapped file;
- other types the `gguf` package can dequantize (IQ1/IQ2/IQ3, TQ, ...) are dequantized
  by it tensor by tensor into the compute dtype: no dense copy is written anywhere.

Architectures are one table (`gguf_arch.GGUF_ARCHS`, summed up as `GGUF_ARCHITECTURES`):
llama.cpp's architecture name -> the Hugging Face architecture that serves it; a row only
takes effect while the runtime serves that architecture
(`model_config.SUPPORTED_ARCHITECTURES`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
import tempfile
import time
from functools import cache
from pathlib import Path
from typing import Any

from pagemill.runtime.model_config import SUPPORTED_ARCHITECTURES
from pagemill.runtime.model_executor.default_model import cache_dir
from pagemill.runtime.model_executor.gguf_arch import GGUF_ARCHS, Metadata, config_from_gguf
from pagemill.runtime.model_executor.gguf_split import (
    check_shards,
    gguf_shards,
    open_gguf_checkpoint,
    shards_by_name,
)

logger = logging.getLogger(__name__)

# llama.cpp's `general.architecture` -> the Hugging Face architecture that serves it (Mistral
# GGUFs say "llama"); what each needs undone and its config are `gguf_arch.GGUF_ARCHS`.
GGUF_ARCHITECTURES: dict[str, str] = {a.name: a.hf_architecture for a in GGUF_ARCHS.values()}

# Kept packed (bf16 on CPU) or read as stored; other dequantizable types are dequantized
# tensor by tensor into the compute dtype (see quantization.gguf_blocks).
DIRECT_TYPES = (
    *("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q3_K", "IQ4_NL", "IQ4_XS"),
    *("Q6_K", "Q2_K", "F32", "F16", "BF16"),
)

_MARKER = "pagemill_gguf.json"
_VERSION = 3


def supported_gguf_architectures() -> list[str]:
    return [g for g, hf in GGUF_ARCHITECTURES.items() if hf in SUPPORTED_ARCHITECTURES]


@cache
def dequantizable_types() -> tuple[str, ...]:
    """GGML types the `gguf` package can turn into floats (probed: it raises for the rest)."""
    import gguf
    import numpy as np

    names = list(DIRECT_TYPES)
    for qtype in gguf.GGMLQuantizationType:
        if qtype.name in names or qtype not in gguf.GGML_QUANT_SIZES:
            continue
        _, type_size = gguf.GGML_QUANT_SIZES[qtype]
        try:
            gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
        except (NotImplementedError, ValueError, TypeError, KeyError):
            continue
        names.append(qtype.name)
    return tuple(names)


def _open(path: Path) -> Any:  # a gguf.GGUFReader
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # not a GGUF, truncated, wrong version
        raise ValueError(f"{str(path)!r} is not a readable GGUF file: {e}") from e


def inspect_gguf(path: Path) -> dict[str, Any]:
    """Architecture, tensor types, shards and config of a GGUF file (any shard of a split
    one); errors say what is unsupported."""
    import gguf

    reader = _open(path)
    shards = gguf_shards(path, reader)
    readers = [reader if p == path else _open(p) for p in shards]
    check_shards(shards, readers)
    first = readers[0]
    field = first.fields.get("general.architecture")
    arch = str(field.contents()) if field is not None else None
    supported = supported_gguf_architectures()
    if arch not in supported:
        raise ValueError(
            f"GGUF architecture {arch!r} ({shards[0].name}) is not supported; pagemill serves "
            f"GGUF files of {', '.join(supported)}"
        )
    tensors = {t.name: t for r in readers for t in r.tensors}
    types: dict[str, int] = {}
    for t in tensors.values():
        name = gguf.GGMLQuantizationType(int(t.tensor_type)).name
        types[name] = types.get(name, 0) + 1
    known = dequantizable_types()
    bad = sorted(t for t in types if t not in known)
    if bad:
        raise ValueError(
            f"{path.name} holds tensors of GGML type(s) {', '.join(bad)}, which pagemill cannot "
            f"load; supported: {', '.join(DIRECT_TYPES)} (quantized ones kept packed) and, "
            f"dequantized, {', '.join(t for t in known if t not in DIRECT_TYPES)}"
        )
    meta = Metadata(
        first.fields,
        {n: tuple(int(d) for d in t.shape.tolist()) for n, t in tensors.items()},
        lambda n: gguf.quants.dequantize(tensors[n].data, tensors[n].tensor_type),
    )
    return {
        "architecture": arch,
        "types": types,
        "tensor_names": list(tensors),
        "shards": shards,
        "config": config_from_gguf(meta),
    }


def _key(path: Path) -> dict[str, Any]:
    stat = path.stat()
    return {"gguf_path": str(path), "gguf_size": stat.st_size, "gguf_mtime_ns": stat.st_mtime_ns}


def _shards_key(shards: list[Path]) -> list[list[Any]]:
    """Size and mtime of every shard after the first (whose own are `_key`'s)."""
    return [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in shards[1:]]


def _folder_for(path: Path) -> Path:
    digest = hashlib.sha256(json.dumps(_key(path), sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{path.stem}-{digest}-v{_VERSION}"


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((Path(folder) / _MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return meta if isinstance(meta, dict) and meta.get("version") == _VERSION else None


def prepare_gguf_folder(path: str | Path) -> Path:
    """The model folder that stands for GGUF file `path`, extracted on first use."""
    path = Path(path).expanduser().absolute()  # not resolve(): keep a Hub snapshot's file name
    shards = shards_by_name(path)
    path = shards[0]  # a split model is named by its first shard, whichever was given
    target = _folder_for(path)
    meta = _read_marker(target)
    if meta is not None and _unchanged(path, meta):
        return target
    start = time.monotonic()
    from pagemill.runtime.model_executor.gguf_once import parsed_once
    from pagemill.runtime.model_executor.loader import GGUF_INDEX_FILE

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".gguf-", dir=target.parent))
    try:
        with contextlib.ExitStack() as once:
            for shard in shards:  # inspection, tokenizer and tensor table: one parse each
                once.enter_context(parsed_once(shard))
            info = inspect_gguf(path)
            _extract(path, info, tmp)
            open_gguf_checkpoint(path, index_file=tmp / GGUF_INDEX_FILE)  # the engine's table
        if target.exists():  # stale (the file changed) or half-written: replace it
            shutil.rmtree(target, ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:  # another process finished the same extraction first
            if _read_marker(target) is None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info(
        "extracted %s's config and tokenizer to %s in %.1f s",
        path.name,
        target,
        time.monotonic() - start,
    )
    return target


def _extract(path: Path, info: dict[str, Any], out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    # Through the config class: transformers' defaults and spelling for the keys the file
    # does not decide (initializer_range, ...), the file's values for the rest.
    raw = dict(info["config"])
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    config.save_pretrained(str(out))
    GenerationConfig.from_model_config(config).save_pretrained(str(out))
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        except ValueError:
            # transformers picks the class from the file's model config, which it reads for
            # its own GGUF architectures only (not Granite, SmolLM3, OLMo 2); the tokenizer
            # itself depends on tokenizer.ggml.* alone, which the generic class builds.
            from transformers import PreTrainedTokenizerFast

            tokenizer = PreTrainedTokenizerFast.from_pretrained(
                str(path.parent), gguf_file=path.name
            )
        _save_tokenizer(tokenizer, out)
    except Exception as e:  # a file without tokenizer metadata still serves token ids
        logger.warning(
            "%s has no usable tokenizer (%s); only token-id prompts will work", path.name, e
        )
    meta = {
        "version": _VERSION,
        **_key(path),
        "architecture": info["architecture"],
        "tensor_types": info["types"],
        "shards": _shards_key(info["shards"]),
    }
    (out / _MARKER).write_text(json.dumps(meta, indent=2))


# Text whose tokens tell a tokenizer's pipeline apart: spaces, newlines, accents, CJK,
# emoji, digits.
_PROBE = "Hello  world,\n  héllo 中文 😀 x=12345 <eos></s><|im_end|>"


def _save_tokenizer(tokenizer: Any, out: Path) -> None:
    """Save transformers' GGUF tokenizer so that loading the folder gives it back.

    A model-specific tokenizer class rebuilds its own pipeline around the saved vocabulary
    (GemmaTokenizer: sentencepiece spaces), which is wrong for a file whose vocabulary is
    another kind (a byte-level one under a Gemma architecture); then the folder names the
    generic class, which runs tokenizer.json — exactly what transformers built — as saved.
    """
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(str(out))
    want = tokenizer.encode(_PROBE)
    try:
        if AutoTokenizer.from_pretrained(str(out)).encode(_PROBE) == want:
            return
    except Exception as e:  # the class cannot even encode with this vocabulary
        logger.debug("%s does not reload as saved (%s)", type(tokenizer).__name__, e)
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2))
    if AutoTokenizer.from_pretrained(str(out)).encode(_PROBE) != want:
        logger.warning("the tokenizer saved in %s encodes unlike the GGUF's own", out)


def _unchanged(path: Path, meta: dict[str, Any]) -> bool:
    """Whether the file (and every shard) is as it was when `meta` was written."""
    try:
        return all(meta.get(k) == v for k, v in _key(path).items()) and meta.get(
            "shards", []
        ) == _shards_key(shards_by_name(path))
    except (OSError, ValueError):  # gone, or a shard is missing
        return False


def gguf_file_for_folder(folder: str | Path) -> Path | None:
    """The GGUF file an extracted folder stands for, or None for any other folder."""
    meta = _read_marker(Path(folder))
    if meta is None:
        return None
    path = Path(meta["gguf_path"])
    if not _unchanged(path, meta):
        raise RuntimeError(
            f"{path} changed (or is gone) since {folder} was extracted from it; pass the "
            f".gguf file itself as the model so that it is checked and extracted again"
        )
    return path
