"""`--generation-config`: the model's own sampling defaults for fields a request leaves unset.

As vLLM does, `auto` reads the model's generation_config.json and takes its temperature,
top_p, top_k, min_p, repetition_penalty and max_new_tokens (as max_tokens); a request's
own values always win, and only values that differ from transformers' own defaults
count (vLLM reads the file through `GenerationConfig.to_diff_dict`, which drops them:
`top_k: 50` written out is transformers' default, not the model's wish). `vllm` ignores the
file; any other value is a folder holding a generation_config.json. The defaults are checked
once, at start-up, by building a `SamplingParams` from them, so a bad file fails there rather
than in every request.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from pagemill.runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field.
GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}

# transformers' GenerationConfig defaults, which to_diff_dict leaves out.
_HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def load_generation_defaults(
    mode: str, model_folder: str | Path, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """SamplingParams field -> default, from `mode` ('auto' | 'vllm' | a folder), with
    `overrides` (--override-generation-config: generation_config.json keys) on top."""
    defaults = _file_defaults(mode, model_folder)
    if not overrides:
        return defaults
    unknown = sorted(set(overrides) - set(GENERATION_KEYS))
    if unknown:
        raise ValueError(
            f"--override-generation-config: unknown key(s) {unknown}; "
            f"known: {sorted(GENERATION_KEYS)}"
        )
    merged = {**defaults, **{GENERATION_KEYS[k]: v for k, v in overrides.items()}}
    try:
        SamplingParams(**merged)
    except (ValueError, TypeError) as e:
        raise ValueError(f"--override-generation-config: {e}") from e
    logger.info("default sampling: %s (--override-generation-config applied)", merged)
    return merged


def _file_defaults(mode: str, model_folder: str | Path) -> dict[str, Any]:
    if mode == "vllm":
        return {}
    folder = Path(model_folder) if mode == "auto" else Path(mode).expanduser()
    file = folder / "generation_config.json"
    if not file.is_file():
        if mode != "auto":
            raise ValueError(
                f"--generation-config {mode!r}: no generation_config.json in that folder"
            )
        return {}
    try:
        raw = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from e
    defaults = {
        field: raw[key]
        for key, field in GENERATION_KEYS.items()
        if raw.get(key) is not None and raw[key] != _HF_DEFAULTS.get(key)
    }
    try:
        SamplingParams(**defaults)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{file} has sampling defaults pagemill cannot use: {e}") from e
    if defaults:
        logger.info(
            "default sampling from %s: %s (requests' own values win; "
            "--generation-config vllm ignores them)",
            file,
            defaults,
        )
    return defaults
