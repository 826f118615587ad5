"""The tokenizer's grammar table (xgrammar's `TokenizerInfo`) kept across starts.

An engine core needs the tokenizer only to build this table for grammars. Building it
means loading the Hugging Face tokenizer in the core process (transformers' config and
tokenizer modules imported, the vocabulary parsed): about a second of a warm start's CPU,
spent beside the model's load on a machine whose cores that start already keeps busy. A
later start with the same tokenizer files reads the table back instead, with the stop ids
it was built with.

The key is everything the table is built from: the bytes of the tokenizer folder's files
that transformers reads (tokenizer files, the model config that picks the tokenizer class,
generation config), the vocabulary size and the model's own stop ids, and the versions of
xgrammar, transformers and tokenizers. A tokenizer given as anything but a local folder is
not cached. An entry that cannot be read is ignored (and rewritten by the start that then
builds the table); `PAGEMILL_TOKENIZER_CACHE=0` turns the cache off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from pagemill.runtime.switches import env_switch

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)

TOKENIZER_CACHE_ENV = "PAGEMILL_TOKENIZER_CACHE"
# Bump when what an entry holds, or how it is keyed, changes.
_FORMAT = 1
# What transformers may read to build a tokenizer from a folder.
_KEY_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "added_tokens.json",
    "special_tokens_map.json",
    "config.json",
    "generation_config.json",
)
_PACKAGES = ("xgrammar", "transformers", "tokenizers")


def tokenizer_cache_enabled() -> bool:
    """`PAGEMILL_TOKENIZER_CACHE` (0 or 1; unset: on); any other value is refused."""
    return env_switch(TOKENIZER_CACHE_ENV, default=True)


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "-"


def info_key(tokenizer_path: str, vocab_size: int, model_eos_ids: Sequence[int]) -> str | None:
    """The key of the table built from the tokenizer at `tokenizer_path`; None when it is not
    a local folder or one of its files cannot be read (nothing to key it by: the table is
    then built from the tokenizer, as without the cache)."""
    folder = Path(tokenizer_path).expanduser()
    if not folder.is_dir():
        return None
    h = hashlib.sha256()
    h.update(json.dumps([_FORMAT, vocab_size, list(model_eos_ids)]).encode())
    for package in _PACKAGES:
        h.update(f"{package}={_version(package)};".encode())
    for name in _KEY_FILES:
        path = folder / name
        h.update(name.encode())
        try:
            h.update(path.read_bytes() if path.is_file() else b"\0absent")
        except OSError as exc:
            logger.warning("tokenizer cache: not used for %s (%s)", folder, exc)
            return None
    return h.hexdigest()


@dataclass(frozen=True)
class TokenizerInfoCache:
    """One folder of tables, one file per key."""

    folder: Path

    @staticmethod
    def default() -> TokenizerInfoCache:
        from pagemill.runtime.model_executor.default_model import cache_dir

        return TokenizerInfoCache(cache_dir() / "tokenizer-info")

    def _path(self, key: str) -> Path:
        return self.folder / f"{key[:32]}.json"

    def load(self, key: str) -> tuple[xgr.TokenizerInfo, list[int]] | None:
        """The table and stop ids saved under `key`, or None (absent or unreadable)."""
        import xgrammar as xgr

        path = self._path(key)
        if not path.is_file():
            return None
        try:
            entry = json.loads(path.read_text())
            if entry["key"] != key or entry["format"] != _FORMAT:
                return None
            stop = [int(i) for i in entry["stop_token_ids"]]
            return xgr.TokenizerInfo.deserialize_json(entry["info"]), stop
        except Exception as exc:  # a torn or foreign file: build the table again
            logger.warning("tokenizer cache: ignoring %s (%s)", path, exc)
            return None

    def save(self, key: str, info: xgr.TokenizerInfo, stop_token_ids: Sequence[int]) -> None:
        """Write the entry (atomically: a reader sees the old file or the new one)."""
        entry = {
            "key": key,
            "format": _FORMAT,
            "stop_token_ids": list(stop_token_ids),
            "info": info.serialize_json(),
        }
        path = self._path(key)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(entry))
            tmp.replace(path)
        except OSError as exc:
            logger.warning("tokenizer cache: could not save %s (%s)", path, exc)
            tmp.unlink(missing_ok=True)
