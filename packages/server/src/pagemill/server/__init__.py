"""pagemill-server: the OpenAI-compatible HTTP server, Prometheus metrics and the `pagemill` CLI.

Embed it with `build_app(AsyncEngine(LLMEngine(...)), "model-name")` and any ASGI server,
or run `pagemill serve`.
"""

from .api_server import ServerThread, build_app, run_server
from .async_engine import AsyncEngine, EngineDeadError, QueueFullError
from .metrics import EngineMetrics
from .version import __version__

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
