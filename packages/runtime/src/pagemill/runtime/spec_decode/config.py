"""`--speculative-config`: vLLM's JSON spelling, checked at start-up.

`{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a,
"prompt_lookup_max": b}` (prompt lookup: the drafts are the tokens that followed the last
earlier occurrence of the context's final n-gram), or `{"model": PATH, "num_speculative_tokens":
k}` (a smaller draft model with the target's vocabulary), or `{"method": "eagle" | "eagle3",
"model": PATH, "num_speculative_tokens": k}` (an EAGLE / EAGLE-3 head trained on a
Llama-family target's hidden states, `spec_decode.eagle`). Methods pagemill does not have
(Medusa, MTP, ...) and keys it does not know are refused by name: a speculation setting that
is silently dropped would only show up as a slower server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SPEC_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
# vLLM's other methods: refused with a message saying so, not as unknown words.
_NOT_YET = ("medusa", "mlp_speculator", "mtp", "deepseek_mtp", "suffix")
_KEYS = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "draft_tensor_parallel_size",
    "disable_by_batch_size",
)
# vLLM's default n-gram window when neither bound is given.
_DEFAULT_LOOKUP = 5


def _int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"speculative_config.{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"speculative_config.{name} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """What to speculate with; built by `from_dict` from the flag's JSON."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 0
    prompt_lookup_max: int = 0
    model: str | None = None
    # vLLM's: speculate only while fewer requests than this run (0: always).
    disable_by_batch_size: int = 0

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SpeculativeConfig:
        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {raw!r}")
        unknown = sorted(set(raw) - set(_KEYS))
        if unknown:
            raise ValueError(
                f"speculative_config: unsupported key(s) {', '.join(map(repr, unknown))}; "
                f"pagemill reads {', '.join(_KEYS)}"
            )
        model = raw.get("model")
        method = raw.get("method")
        if method is None:
            method = "draft_model" if model is not None else None
        if method in ("[ngram]",):
            method = "ngram"
        if method in _NOT_YET:
            raise ValueError(
                f"speculative_config.method={method!r} is not supported yet; pagemill "
                "speculates with 'ngram', 'eagle', 'eagle3' or a draft model "
                '({"model": PATH})'
            )
        if method not in SPEC_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {SPEC_METHODS} (or give a draft "
                f"'model'), got {method!r}"
            )
        if "num_speculative_tokens" not in raw:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        k = _int("num_speculative_tokens", raw["num_speculative_tokens"], 1)
        tp = raw.get("draft_tensor_parallel_size")
        if tp is not None and tp != 1:
            raise ValueError(f"speculative_config.draft_tensor_parallel_size must be 1, got {tp!r}")
        disable = raw.get("disable_by_batch_size")
        disable = 0 if disable is None else _int("disable_by_batch_size", disable, 2)
        if method == "ngram":
            if model is not None:
                raise ValueError("speculative_config.model is for a draft model, not 'ngram'")
            lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
            if lo is None and hi is None:
                lo = hi = _DEFAULT_LOOKUP
            elif lo is None:
                lo = hi
            elif hi is None:
                hi = lo
            lo = _int("prompt_lookup_min", lo, 1)
            hi = _int("prompt_lookup_max", hi, 1)
            if lo > hi:
                raise ValueError(
                    f"speculative_config.prompt_lookup_min ({lo}) must be <= "
                    f"prompt_lookup_max ({hi})"
                )
            return cls("ngram", k, lo, hi, None, disable)
        if not isinstance(model, str) or not model:
            what = "the EAGLE head" if method in ("eagle", "eagle3") else "the draft model"
            raise ValueError(f"speculative_config.model must name {what} (a path)")
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            if raw.get(key) is not None:
                raise ValueError(f"speculative_config.{key} is for method 'ngram' only")
        return cls(method, k, 0, 0, model, disable)
