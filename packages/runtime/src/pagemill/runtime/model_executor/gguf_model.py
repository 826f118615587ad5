"""A GGUF file as a model folder: its config, tokenizer and chat template extracted once.

A `.gguf` file carries everything a model needs — architecture and shape in its metadata,
the tokenizer (vocabulary, merges, special ids) and usually a chat template — but the rest
of the engine reads "a model folder". `prepare_gguf_folder` checks the file (architecture
and tensor types, so a file that cannot be served fails at once and says why), then has
transformers extract config.json, generation_config.json and the tokenizer into a cache
folder keyed by the file's path, size and mtime. The weights stay in the file:

- quantized rows (Q4_0/Q4_1/Q8_0, Q5_x, the K-quants, IQ4_NL/IQ4_XS) are kept packed
  where the quantization plan allows (bf16 on CPU), F32 / F16 / BF16 are read as they
  are, and everything is dequantized in the compute dtype for fp32 or GPU compute
  (`gguf_weights`, `quantization.gguf_blocks`), straight from the memory-mapped file;
- other types the `gguf` package can dequantize (IQ1/IQ2/IQ3, TQ, ...) are dequantized
  by it tensor by tensor into the compute dtype: no dense copy is written anywhere.

Architectures are one table (`GGUF_ARCHITECTURES`): llama.cpp's architecture name -> the
Hugging Face architecture that serves it; a row only takes effect while the runtime
serves that architecture (`model_config.SUPPORTED_ARCHITECTURES`).
"""

from __future__ import annotations

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

logger = logging.getLogger(__name__)

# llama.cpp's `general.architecture` -> the Hugging Face architecture that serves it. Mistral
# GGUFs say "llama". A new row needs the runtime to serve the architecture and, where
# llama.cpp's converter changes tensors beyond renaming them (q/k row permutation: see
# gguf_weights._PERMUTED_QK_ARCHS), the reader to undo it.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}

# Kept packed (bf16 on CPU) or read as stored; other dequantizable types are dequantized
# tensor by tensor into the compute dtype (see quantization.gguf_blocks).
DIRECT_TYPES = (
    *("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q3_K", "IQ4_NL", "IQ4_XS"),
    *("Q6_K", "Q2_K", "F32", "F16", "BF16"),
)

_MARKER = "pagemill_gguf.json"
_VERSION = 1


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


def inspect_gguf(path: Path) -> dict[str, Any]:
    """Architecture, tensor types and names of a GGUF file; errors say what is unsupported."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # not a GGUF, truncated, wrong version
        raise ValueError(f"{str(path)!r} is not a readable GGUF file: {e}") from e
    field = reader.fields.get("general.architecture")
    arch = str(field.contents()) if field is not None else None
    supported = supported_gguf_architectures()
    if arch not in supported:
        raise ValueError(
            f"GGUF architecture {arch!r} ({path.name}) is not supported; pagemill serves GGUF "
            f"files of {', '.join(supported)}"
        )
    types: dict[str, int] = {}
    for t in reader.tensors:
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
    return {"architecture": arch, "types": types, "tensor_names": [t.name for t in reader.tensors]}


def _key(path: Path) -> dict[str, Any]:
    stat = path.stat()
    return {"gguf_path": str(path), "gguf_size": stat.st_size, "gguf_mtime_ns": stat.st_mtime_ns}


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
    target = _folder_for(path)
    meta = _read_marker(target)
    if meta is not None and all(meta.get(k) == v for k, v in _key(path).items()):
        return target
    start = time.monotonic()
    info = inspect_gguf(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".gguf-", dir=target.parent))
    try:
        _extract(path, info, tmp)
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

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    config.architectures = [GGUF_ARCHITECTURES[info["architecture"]]]
    # A file without an output matrix ties the LM head to the embedding (llama.cpp's rule).
    config.tie_word_embeddings = "output.weight" not in info["tensor_names"]
    config.dtype = "float32"  # what the file's tensors dequantize to
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(str(out))
    raw = json.loads((out / "config.json").read_text())
    raw.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    GenerationConfig.from_model_config(config).save_pretrained(str(out))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer.save_pretrained(str(out))
    except Exception as e:  # a file without tokenizer metadata still serves token ids
        logger.warning(
            "%s has no usable tokenizer (%s); only token-id prompts will work", path.name, e
        )
    meta = {
        "version": _VERSION,
        **_key(path),
        "architecture": info["architecture"],
        "tensor_types": info["types"],
    }
    (out / _MARKER).write_text(json.dumps(meta, indent=2))


def gguf_file_for_folder(folder: str | Path) -> Path | None:
    """The GGUF file an extracted folder stands for, or None for any other folder."""
    meta = _read_marker(Path(folder))
    if meta is None:
        return None
    path = Path(meta["gguf_path"])
    if not path.is_file() or any(meta.get(k) != v for k, v in _key(path).items()):
        raise RuntimeError(
            f"{path} changed (or is gone) since {folder} was extracted from it; pass the "
            f".gguf file itself as the model so that it is checked and extracted again"
        )
    return path
