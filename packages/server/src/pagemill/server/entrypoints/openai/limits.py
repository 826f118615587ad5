"""Bounds on what one request may ask for, and the checks that need more than a type.

Every bound here is documented in the server README; each exists because without it one
request could hold the engine for minutes, produce garbage, or crash a step.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict

# prompts x n per HTTP request: `{"prompt": ["hi"] * 2000}` would otherwise keep the engine
# busy for minutes on behalf of one client.
MAX_CHOICES_PER_REQUEST = 128
# Seeds are 64-bit signed integers (OpenAI's range). Each of n > 1 choices samples with
# seed + index, wrapped around within the range, so every choice gets a distinct seed.
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1
# Repetition penalty divides (or multiplies) logits: 1e-300 or 1e300 turns them into
# inf/0 and the output into noise. vLLM's sensible range lies well inside this one.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
# Request models: no coercion between JSON types (`true` is not 1), no inf/nan.
STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


def find_lone_surrogate(data: Any, path: str = "") -> str | None:
    """The dotted path of the first string in `data` that is not valid Unicode, else None.

    JSON may spell a lone UTF-16 surrogate (`"\\ud800"`); Python keeps it in a str that
    no tokenizer can encode. Checked on the raw body before any other validation.
    """
    stack: list[tuple[str, Any]] = [(path, data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return where or "body"
        elif isinstance(value, dict):
            for k, v in value.items():
                if isinstance(k, str):
                    try:
                        k.encode("utf-8")
                    except UnicodeEncodeError:
                        return where or "body"
                if isinstance(v, (str, dict, list)):
                    stack.append((f"{where}.{k}" if where else str(k), v))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                if isinstance(v, (str, dict, list)):
                    stack.append((f"{where}[{i}]", v))
    return None
