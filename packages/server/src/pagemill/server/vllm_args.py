"""`vllm serve`'s command line: the vLLM flags pagemill implements with vLLM's meaning.

The engine flags come from the config dataclasses (cli.add_engine_args, under vLLM's names);
this module adds vLLM's flags that are not config fields (-O, --download-dir, --hf-token,
--trust-remote-code, CORS, request logging, ...), reads vLLM's `--config file.yaml` (keys
are flag names; command-line flags win) and spells flags as vLLM's FlexibleArgumentParser
does (`--max_model_len` is `--max-model-len`). The vLLM flags pagemill does not implement
are in `vllm_refused`. Standard library plus pyyaml: nothing here imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagemill.server.config_args import json_object, positive_int
from pagemill.server.vllm_refused import refuse

__all__ = [
    "OneKey",
    "add_config_flag",
    "add_vllm_engine_flags",
    "add_vllm_frontend_args",
    "apply_hub_options",
    "compilation_level",
    "cors_settings",
    "expand_config_file",
    "log_requests",
    "normalize_flag_spelling",
]


def compilation_level(text: str) -> int:
    """vLLM's -O / --compilation-config: a level 0-3, JSON with "level" (or "mode"), or
    vLLM's dotted form (-O.level=3)."""
    if text.strip().lstrip("-").isdigit():
        level = int(text)
    else:
        if text.startswith(".") and "=" in text:
            key, _, value = text[1:].partition("=")
            text = json.dumps({key: int(value) if value.strip().isdigit() else value})
        config = json_object(text)
        unknown = sorted(set(config) - {"level", "mode"})
        if unknown:
            refuse(
                f"--compilation-config {unknown[0]}",
                "pagemill's compilation has one switch: level 0 runs eagerly, 1-3 compile",
            )
        level = config.get("level", config.get("mode", 3))
        if not isinstance(level, int) or isinstance(level, bool):
            raise argparse.ArgumentTypeError(f"level must be an integer 0-3, got {level!r}")
    if not 0 <= level <= 3:
        raise argparse.ArgumentTypeError(f"level must be 0-3, got {level}")
    return level


class OneKey(argparse.Action):
    """vLLM's --api-key takes several keys; pagemill checks one."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        if len(values) > 1:
            refuse("--api-key with several keys", "pagemill checks one API key")
        setattr(namespace, self.dest, values[0])


def add_vllm_engine_flags(m: argparse._ArgumentGroup) -> None:
    """vLLM's model flags that are not EngineConfig fields (they act before the engine:
    compilation level, Hub access, the remote-code switch)."""
    m.add_argument(
        "-O",
        "--compilation-config",
        type=compilation_level,
        default=None,
        metavar="LEVEL",
        help='vLLM\'s compilation level (or JSON with "level"): 0 runs the model eagerly '
        "(as --enforce-eager), 1-3 compile it, pagemill's default",
    )
    m.add_argument(
        "--download-dir",
        default=None,
        help="where Hub models are downloaded and looked up (default: the Hugging Face "
        "cache, $HF_HUB_CACHE / $HF_HOME)",
    )
    m.add_argument(
        "--hf-token",
        nargs="?",
        const=True,
        default=None,
        help="Hugging Face token for gated or private models; without a value, the one "
        "saved by `hf auth login` (default: $HF_TOKEN, else that one)",
    )
    m.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted for vLLM compatibility; changes nothing: pagemill runs no code from "
        "a model repository (an architecture it does not implement is refused at load)",
    )


def apply_hub_options(args: argparse.Namespace) -> None:
    """--download-dir and --hf-token, through the variables huggingface_hub reads at each
    call (this process, and the engine process it starts, inherit them)."""
    if getattr(args, "download_dir", None):
        os.environ["HF_HUB_CACHE"] = os.path.abspath(os.path.expanduser(args.download_dir))
    token = getattr(args, "hf_token", None)
    if isinstance(token, str) and token:
        os.environ["HF_TOKEN"] = token


def log_requests(args: argparse.Namespace) -> bool:
    """--enable-log-requests, or vLLM's older --no-disable-log-requests (which wins when
    given, as the more specific of the two)."""
    if args.disable_log_requests is not None:
        return not args.disable_log_requests
    return bool(args.enable_log_requests)


def cors_settings(args: argparse.Namespace) -> dict[str, Any] | None:
    """Starlette CORSMiddleware keywords from vLLM's CORS flags; None (no CORS headers at
    all) unless one was given. vLLM allows every origin by default; pagemill binds to
    loopback and answers no browser from elsewhere until told to."""
    given = (args.allowed_origins, args.allowed_methods, args.allowed_headers)
    if all(v is None for v in given) and not args.allow_credentials:
        return None
    origins, methods, headers = (["*"] if v is None else v for v in given)
    return {
        "allow_origins": origins,
        "allow_methods": methods,
        "allow_headers": headers,
        "allow_credentials": args.allow_credentials,
    }


def json_strings(text: str) -> list[str]:
    """vLLM's CORS flags: a JSON list of strings, e.g. '["https://a.example"]'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(
            f'expected a JSON list of strings like ["*"], got {text!r}'
        )
    return value


def add_config_flag(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--config's help: the file is read before parsing (vllm_args.expand_config_file)."""
    p.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="read flags from a YAML file, vLLM's format: keys are flag names "
        "(max-model-len or max_model_len), values their values; flags on the command "
        "line win",
    )


def add_vllm_frontend_args(p: argparse.ArgumentParser) -> None:
    """vLLM's front-end flags whose features pagemill has, with vLLM's spelling."""
    v = p.add_argument_group("vLLM front-end flags")
    add_config_flag(v)
    v.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters a request's model may name (needs --enable-lora): name=path, or "
        'vLLM\'s JSON form {"name": ..., "path": ...}; each is a PEFT folder',
    )
    v.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (as vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, which also turns them on): off by default, "
        "since they let an API client make the server read any folder",
    )
    v.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM compatibility: pagemill always reads tool calls out of "
        "tool_choice='auto' answers (with --tool-call-parser, or the parser the chat "
        "template implies)",
    )
    v.add_argument(
        "--enable-log-requests",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="log each accepted request (id, prompt, sampling parameters) at INFO "
        "(default: off, as vLLM)",
    )
    v.add_argument(
        "--disable-log-requests",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM's older spelling: --disable-log-requests is --no-enable-log-requests "
        "(the default), --no-disable-log-requests is --enable-log-requests",
    )
    v.add_argument(
        "--max-log-len",
        type=positive_int,
        default=None,
        metavar="N",
        help="with --enable-log-requests, log at most N prompt characters or token ids "
        "(default: all)",
    )
    v.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="accepted for vLLM compatibility: pagemill logs no periodic statistics "
        "(/metrics is served either way)",
    )
    v.add_argument(
        "--uvicorn-log-level",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        default=None,
        help="uvicorn's log level (default: --log-level)",
    )
    for what in ("origins", "methods", "headers"):
        v.add_argument(
            f"--allowed-{what}",
            type=json_strings,
            default=None,
            metavar="JSON",
            help=f"CORS: allowed {what} as a JSON list, e.g. '[\"*\"]' (vLLM's flag); "
            'any CORS flag turns CORS on, the others defaulting to ["*"] '
            "(default: no CORS headers)",
        )
    v.add_argument(
        "--allow-credentials",
        action="store_true",
        help="CORS: allow credentials (cookies, Authorization) on cross-origin requests",
    )


# ------------------------------------------------------------------ spelling, --config


def normalize_flag_spelling(argv: Sequence[str]) -> list[str]:
    """`--max_model_len` -> `--max-model-len` (vLLM takes both); values stay as they are."""
    out = []
    for arg in argv:
        if arg.startswith("--") and len(arg) > 2:
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out


def _config_path(argv: list[str]) -> tuple[str | None, list[str]]:
    """The --config value and argv without it."""
    rest: list[str] = []
    path = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ValueError("--config needs a file name")
            path = argv[i + 1]
            i += 2
            continue
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return path, rest


def expand_config_file(argv: Sequence[str], parser: argparse.ArgumentParser) -> list[str]:
    """vLLM's `--config FILE`: a YAML mapping of flag names (either spelling) to values,
    turned into flags placed before the command line's own, so the command line wins.

    `key: true` is `--key`, `key: false` `--no-key` (or nothing, for a flag that is off
    unless given), a list gives several values, a mapping is passed as JSON. A key the
    parser does not know fails here, naming the key and the file.
    """
    path, rest = _config_path(list(argv))
    if path is None:
        return rest
    # Through importlib: pyyaml ships no type stubs, and its API used here is two names.
    yaml: Any = importlib.import_module("yaml")
    try:
        data = yaml.safe_load(Path(path).expanduser().read_text())
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML ({' '.join(str(e).split())})") from None
    if data is None:
        return rest
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    known = parser._option_string_actions
    # The file goes after a leading positional model, as vLLM puts it: a list-valued flag
    # from the file (--served-model-name a b) must not swallow the model.
    head = 1 if rest and not rest[0].startswith("-") else 0
    extra: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if flag == "--model" and head:
            continue  # the command line's model wins
        if flag not in known:
            raise ValueError(f"--config {path}: unknown option {key!r}")
        if flag == "--config":
            raise ValueError(f"--config {path}: a config file cannot name another")
        if value is None:
            continue
        if isinstance(value, bool):
            if value:
                extra.append(flag)
            elif "--no-" + flag[2:] in known:
                extra.append("--no-" + flag[2:])
            continue
        if isinstance(value, list):
            extra += [flag, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)]
        elif isinstance(value, dict):
            extra += [flag, json.dumps(value)]
        else:
            extra += [flag, str(value)]
    return rest[:head] + extra + rest[head:]
