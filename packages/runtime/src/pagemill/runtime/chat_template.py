"""`--chat-template`: a Jinja file or the template itself, in place of the tokenizer's.

vLLM's rule for telling the two apart: a value that names an existing file is read from
it; a value with template syntax in it is the template; anything else is a path that does
not exist, which is an error rather than a template that renders the path as text.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_TEMPLATE_MARKS = ("{{", "{%", "\n")


def resolve_chat_template(value: str) -> str:
    """The template text of a `--chat-template` value."""
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a long inline template is not a valid file name
        pass
    if any(mark in value for mark in _TEMPLATE_MARKS):
        return value
    raise ValueError(
        f"chat template {value!r} is neither a file nor a Jinja template: pass the path of "
        f"a template file, or the template itself"
    )


def apply_chat_template_override(tokenizer: Any | None, chat_template: str | None) -> None:
    """Make `tokenizer` render with `chat_template` (every chat path reads the tokenizer's)."""
    if chat_template is None:
        return
    template = resolve_chat_template(chat_template)
    if tokenizer is None:
        raise ValueError("a chat template was given but the model has no tokenizer to use it with")
    tokenizer.chat_template = template
