"""Command-line flags derived from config dataclasses.

A flag's type, default, choices and help all come from its dataclass field (the help from
the string literal written under the field), so the CLI cannot offer an option the config
lacks, or document a default the config does not have. Rules: field `x_y` -> `--x-y`;
bools -> `--x-y/--no-x-y`; `T | None` fields default to None (absent: the config decides);
int fields named `*_bytes` take sizes such as 512MiB or 4GiB, token counts 32k or 32K
(vLLM's spelling); dict fields take JSON; `field(metadata={"choices": ...})` becomes
argparse choices.

Standard library only: `pagemill plan` / `simulate` use it without torch or the runtime.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import textwrap
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from typing import Any

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}

ArgContainer = argparse.ArgumentParser | argparse._ArgumentGroup


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def human_readable_int(text: str) -> int:
    """vLLM's token counts: '2048', '32k' (x1000), '32K' (x1024), '1.5m', '1M'."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)([kKmMgG]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(
            f"expected an integer such as 2048, 32k or 32K, got {text!r}"
        )
    number, suffix = m.groups()
    if suffix in ("K", "M", "G") and "." in number:
        raise argparse.ArgumentTypeError(
            f"{text!r}: no decimals with K/M/G (x1024); try {suffix.lower()}"
        )
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}
    value = float(number) * scale[suffix]
    if value != int(value):
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    return int(value)


def json_object(text: str) -> dict[str, Any]:
    """A JSON object given on the command line (vLLM's dict-valued flags)."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


# Token counts vLLM lets users write as 32k / 32K.
_HUMAN_INTS = ("max_model_len", "max_num_batched_tokens")


def parse_size(text: str) -> int:
    """Bytes from '4GiB', '512MB', '1e9' or '1048576'."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(
            f"expected a size like 512MiB, 4GiB or a number of bytes, got {text!r}"
        )
    value = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


@cache
def field_docs(cls: type) -> Mapping[str, str]:
    """Each field's docstring (the string literal right after its annotated assignment in
    the class body), whitespace collapsed to one line.

    Read from the class's source with ast, which is shipped in the wheel; without source
    (a byte-code-only install) the flags still work, with no help text.
    """
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.ClassDef)
    docs: dict[str, str] = {}
    for stmt, after in zip(node.body, node.body[1:], strict=False):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs


@cache
def _fields(cls: type) -> dict[str, tuple[dataclasses.Field[Any], Any]]:
    """name -> (field, value type with `| None` stripped)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
            args = [a for a in typing.get_args(hint) if a is not type(None)]
            hint = args[0] if len(args) == 1 else hint
        out[f.name] = (f, hint)
    return out


def _flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def add_field_arg(
    container: ArgContainer,
    cls: type,
    name: str,
    *,
    dest: str | None = None,
    aliases: Sequence[str] = (),
    default: Any = dataclasses.MISSING,
) -> argparse.Action:
    """Add the flag of field `name` of dataclass `cls`.

    `dest` is the flag's name (and the namespace attribute) when it differs from the field's;
    `aliases` are further spellings of the same flag; `default` overrides the field's
    default (a command whose own default differs, e.g. the simulator's context length).
    """
    f, kind = _fields(cls)[name]
    dest = dest or name
    if default is dataclasses.MISSING:
        default = None if f.default is dataclasses.MISSING else f.default
    text = field_docs(cls).get(name, "").replace("%", "%%")
    flags = [_flag_name(dest), *aliases]
    if kind is bool:
        on = flags[0] if default else "--no-" + flags[0].removeprefix("--")
        return container.add_argument(
            *flags,
            dest=dest,
            default=default,
            help=f"{text} (default: {on})",
            action=argparse.BooleanOptionalAction,
        )
    kwargs: dict[str, Any] = {"dest": dest, "default": default, "help": text}
    if kind is int and name.endswith("_bytes"):
        kwargs.update(type=parse_size, metavar="SIZE")
    elif kind is int and name in _HUMAN_INTS:
        kwargs["type"] = human_readable_int
    elif typing.get_origin(kind) is dict or kind is dict:
        kwargs.update(type=json_object, metavar="JSON")
    elif kind in (int, float, str):
        kwargs["type"] = kind
    else:
        raise TypeError(f"{cls.__name__}.{name}: no flag for a {kind} field")
    if "choices" in f.metadata:
        kwargs["choices"] = f.metadata["choices"]
    if default is not None:
        kwargs["help"] = f"{text} (default: %(default)s)" if text else "default: %(default)s"
    return container.add_argument(*flags, **kwargs)


def add_config_args(
    container: ArgContainer,
    cls: type,
    names: Iterable[str],
    *,
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """Flags for the fields `names` of `cls`, under the fields' own names."""
    for name in names:
        add_field_arg(container, cls, name, default=(defaults or {}).get(name, dataclasses.MISSING))


def config_kwargs(args: argparse.Namespace, names: Iterable[str]) -> dict[str, Any]:
    """The values of `add_config_args` flags, ready for the config's constructor."""
    return {name: getattr(args, name) for name in names}
