"""The engine: a front end (input and output processing) and the engine core behind an
`EngineCoreClient` (in this thread, on a thread of its own, or in its own process).

    LLMEngine / AsyncEngine:  InputProcessor -> EngineCoreClient -> OutputProcessor
    engine core:              EngineCore.step(): schedule -> execute -> sample -> update

The names load lazily: the core's pieces (fault isolation, the protocol) are imported by
modules the engine itself imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagemill.runtime.engine.llm_engine import EngineStats, LLMEngine

__all__ = ["EngineStats", "LLMEngine"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        value = getattr(importlib.import_module(".llm_engine", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
