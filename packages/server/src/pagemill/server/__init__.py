"""pagemill-server: the OpenAI-compatible HTTP server, Prometheus metrics and the `pagemill` CLI.

Embed it with `build_app(AsyncEngine(LLMEngine(...)), "model-name")` and any ASGI server,
or run `pagemill serve`.

The public names load lazily: `pagemill plan`, `pagemill --help` and the simulator import
this package first, and must not pay for torch and the runtime they never use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pagemill.server.version import __version__

if TYPE_CHECKING:
    from pagemill.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError
    from pagemill.server.entrypoints.openai.api_server import ServerThread, build_app, run_server
    from pagemill.server.metrics import EngineMetrics

_LAZY = {
    "ServerThread": ".entrypoints.openai.api_server",
    "build_app": ".entrypoints.openai.api_server",
    "run_server": ".entrypoints.openai.api_server",
    "AsyncEngine": ".async_engine",
    "EngineDeadError": ".async_engine",
    "QueueFullError": ".async_engine",
    "EngineMetrics": ".metrics",
}

__all__ = [
    "AsyncEngine",
    "EngineDeadError",
    "EngineMetrics",
    "QueueFullError",
    "ServerThread",
    "__version__",
    "build_app",
    "run_server",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
