"""How one embedding (pooling) request wants its prompt turned into a vector.

vLLM's `PoolingParams`: a pooling request runs its prompt through the model (prefill only,
batched and chunked by the same scheduler as generation) and returns one pooled hidden state
instead of sampling. `pooling_type` and `normalize` left None take the model's defaults
(its sentence-transformers `modules.json` / `1_Pooling/config.json`, else the engine's
`pooler_config`, else last token, normalized) — the front end resolves them before the
request reaches the engine core, so the core only ever sees complete parameters.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pagemill.runtime.sampling_params import RequestOutputKind


class PoolingType(enum.Enum):
    """Which hidden states of the prompt make the vector (vLLM's names)."""

    LAST = "LAST"  # the last prompt token's (decoder embedding models: Qwen3-Embedding, gte-Qwen2)
    MEAN = "MEAN"  # the average over every prompt token
    CLS = "CLS"  # the first token's


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class PoolingParams:
    """Options of one pooling request.

    `dimensions` keeps the first `dimensions` components (matryoshka truncation) and then
    normalizes again when `normalize` holds. `truncate_prompt_tokens` keeps only the last
    that many prompt tokens (vLLM's side: the end of a text is what a last-token pooler
    reads; -1 means the context length); without it a prompt longer than the context is
    an error.
    """

    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    # Pooling answers once, whole (vLLM's PoolingParams carries the same constant).
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            name = str(self.pooling_type).upper()
            if name not in PoolingType.__members__:
                raise ValueError(
                    f"PoolingParams.pooling_type must be one of "
                    f"{list(PoolingType.__members__)} or None, got {self.pooling_type!r}"
                )
            self.pooling_type = name
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(
                f"PoolingParams.normalize must be a bool or None, got {self.normalize!r}"
            )
        dims = self.dimensions
        if dims is not None and (not _is_int(dims) or dims < 1):
            raise ValueError(
                f"PoolingParams.dimensions must be None or an integer >= 1, got {dims!r}"
            )
        cut = self.truncate_prompt_tokens
        if cut is not None and (not _is_int(cut) or (cut < 1 and cut != -1)):
            raise ValueError(
                "PoolingParams.truncate_prompt_tokens must be None, -1 (the context length) "
                f"or an integer >= 1, got {cut!r}"
            )
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError("PoolingParams.output_kind must be a RequestOutputKind")

    @property
    def resolved_type(self) -> PoolingType:
        """The pooling type; only meaningful once the front end has resolved the defaults."""
        return PoolingType(self.pooling_type or "LAST")

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """MEAN and CLS read hidden states of every (or the first) prompt position, which a
        prefix-cache hit would skip; LAST reads only the last token, always recomputed."""
        return self.resolved_type is not PoolingType.LAST


RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed")
_POOLER_CONFIG_KEYS = ("pooling_type", "normalize")


@dataclass(frozen=True)
class PoolerConfig:
    """The engine's pooling defaults (vLLM's `--pooler-config`), over the model's own."""

    pooling_type: str | None = None
    normalize: bool | None = None

    @classmethod
    def parse(cls, text: str | None) -> PoolerConfig:
        """From `--pooler-config`'s JSON object, e.g. '{"pooling_type": "MEAN"}'."""
        if text is None:
            return cls()
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"pooler_config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("pooler_config must be a JSON object")
        unknown = sorted(set(raw) - set(_POOLER_CONFIG_KEYS))
        if unknown:
            raise ValueError(
                f"pooler_config: unsupported key(s) {unknown}; pagemill reads "
                f"{list(_POOLER_CONFIG_KEYS)}"
            )
        checked = PoolingParams(
            pooling_type=raw.get("pooling_type"), normalize=raw.get("normalize")
        )
        return cls(checked.pooling_type, checked.normalize)


def sentence_transformers_pooling(path: Path) -> PoolerConfig:
    """The pooling a sentence-transformers model folder declares (`modules.json` with a
    Pooling module's config and, or not, a Normalize module); empty when it has none."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return PoolerConfig()
    try:
        modules: list[dict[str, Any]] = json.loads(modules_file.read_text())
    except (OSError, ValueError):
        return PoolerConfig()
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules}
    normalize = "Normalize" in kinds
    pooling_type = None
    pooling = kinds.get("Pooling")
    if pooling is not None:
        config_file = path / str(pooling.get("path", "")) / "config.json"
        try:
            config = json.loads(config_file.read_text())
        except (OSError, ValueError):
            config = {}
        # sentence-transformers' flags, in the order it gives them precedence.
        for flag, kind in (
            ("pooling_mode_cls_token", "CLS"),
            ("pooling_mode_mean_tokens", "MEAN"),
            ("pooling_mode_lasttoken", "LAST"),
        ):
            if config.get(flag):
                pooling_type = kind
                break
    return PoolerConfig(pooling_type, normalize)


@dataclass(frozen=True)
class PoolingDefaults:
    """What a pooling request leaves unset gets: the request's own fields, else
    `--pooler-config`, else the model folder's sentence-transformers modules, else the last
    token, normalized (vLLM's defaults for a decoder turned into an embedding model)."""

    pooling_type: str = "LAST"
    normalize: bool = True
    hidden_size: int | None = None
    # From config.json's `matryoshka_dimensions`: the only `dimensions` the model allows.
    matryoshka_dimensions: tuple[int, ...] | None = None

    @classmethod
    def load(
        cls, path: Path | None, pooler_config: str | None, hidden_size: int | None
    ) -> PoolingDefaults:
        engine = PoolerConfig.parse(pooler_config)
        model = PoolerConfig() if path is None else sentence_transformers_pooling(path)
        pooling_type = engine.pooling_type or model.pooling_type or "LAST"
        normalize = next((v for v in (engine.normalize, model.normalize) if v is not None), True)
        matryoshka = None
        if path is not None and (path / "config.json").is_file():
            try:
                dims = json.loads((path / "config.json").read_text()).get("matryoshka_dimensions")
            except (OSError, ValueError):
                dims = None
            if isinstance(dims, list) and dims and all(_is_int(d) for d in dims):
                matryoshka = tuple(dims)
        return cls(pooling_type, normalize, hidden_size, matryoshka)

    def resolve(self, params: PoolingParams) -> PoolingParams:
        """Complete parameters for the engine core; a `dimensions` the model cannot give
        is a ValueError naming it."""
        dims = params.dimensions
        if dims is not None:
            if self.matryoshka_dimensions is not None and dims not in self.matryoshka_dimensions:
                raise ValueError(
                    f"dimensions={dims} is not one this model was trained for "
                    f"({list(self.matryoshka_dimensions)})"
                )
            if self.hidden_size is not None and dims > self.hidden_size:
                raise ValueError(
                    f"dimensions={dims} exceeds the model's embedding size ({self.hidden_size})"
                )
        return replace(
            params,
            pooling_type=params.pooling_type or self.pooling_type,
            normalize=self.normalize if params.normalize is None else params.normalize,
        )
