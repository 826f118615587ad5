"""The FastAPI application and the helpers that run it under uvicorn.

`build_app` takes an engine (wrapped in an `AsyncEngine`, or a bare `LLMEngine` that it
wraps) and returns an ASGI app; nothing here owns a port or a model, so the app can be
embedded, mounted or tested in-process. `ServerThread` runs an app on a background thread
(tests, notebooks, benchmarks); `pagemill serve` uses `run_server`.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

import anyio
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import Message, Receive, Scope, Send

from pagemill.server.async_engine import AsyncEngine, StepObservers
from pagemill.server.entrypoints.anthropic.serving_messages import install_anthropic
from pagemill.server.entrypoints.ollama.serving import install_ollama
from pagemill.server.entrypoints.openai.auth import APIKeyMiddleware
from pagemill.server.entrypoints.openai.errors import (
    APIError,
    error_response,
    install_error_handlers,
)
from pagemill.server.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from pagemill.server.entrypoints.openai.protocol_structured import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from pagemill.server.entrypoints.openai.serving_chat import ChatServing
from pagemill.server.entrypoints.openai.serving_completion import CompletionServing
from pagemill.server.entrypoints.openai.serving_embedding import EmbeddingRequest, EmbeddingServing
from pagemill.server.entrypoints.openai.serving_lora import (
    LoRARegistry,
    install_lora_routes,
    runtime_updating_allowed,
)
from pagemill.server.entrypoints.openai.serving_responses import install_responses
from pagemill.server.entrypoints.openai.serving_tokenize import TokenizeServing
from pagemill.server.entrypoints.watchdog import Watchdog
from pagemill.server.metrics import CONTENT_TYPE_LATEST, EngineMetrics
from pagemill.server.version import __version__

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    from pagemill.runtime import LLMEngine
    from pagemill.server.dashboard import DashboardHub

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


class SSEResponse(StreamingResponse):
    """A stream that notices a client hang-up even while no token is being sent.

    Starlette (ASGI 2.4) only learns of a disconnect when a send fails, i.e. at the next
    token, and leaves the generator to the garbage collector. Here a watcher on `receive`
    cancels the stream at once, which runs the generator's cleanup (the engine abort).
    """

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


class BodySizeLimit:
    """Refuses bodies over `max_bytes` with 413 before they are buffered and parsed."""

    def __init__(
        self, app: Callable[[Scope, Receive, Send], Awaitable[None]], max_bytes: int
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = error_response(413, f"request body exceeds {self.max_bytes} bytes")
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    await too_large(scope, receive, send)
                    return
        received = 0

        async def limited_receive() -> Message:
            # A body without Content-Length (chunked) is counted as it arrives. The app is
            # reading the body when this raises; FastAPI passes HTTPExceptions through to the
            # error handlers, which answer 413 in OpenAI's shape.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise StarletteHTTPException(
                        413, f"request body exceeds {self.max_bytes} bytes"
                    )
            return message

        await self.app(scope, limited_receive, send)


class _ServingArgs(TypedDict):
    """What every endpoint's serving object takes (`ServingBase`'s keywords)."""

    max_model_len: int
    tokenizer: Any
    vocab_limit: int | None
    tokenizer_pool: ThreadPoolExecutor


def build_app(
    engine_client: AsyncEngine | LLMEngine,
    served_model_name: str | Sequence[str],
    api_key: str | None = None,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    metrics: EngineMetrics | None = None,
    watchdog: Watchdog | None = None,
    allow_special_tokens_in_chat: bool = False,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    dashboard: DashboardHub | None = None,
    metrics_require_api_key: bool = False,
    cors: Mapping[str, Any] | None = None,
    lora_modules: Sequence[tuple[str, str]] = (),
    allow_runtime_lora_updating: bool = False,
) -> FastAPI:
    """The OpenAI-compatible app for one engine.

    `engine_client` is an `AsyncEngine` (in-process, or `AsyncEngine.launch`ed in its own
    process), or an `LLMEngine` (then wrapped here; the app's shutdown stops that wrapper's
    thread). `served_model_name` may be several names: requests may use any of them,
    /v1/models lists them all, responses report the first. With `api_key`, /v1/* requires
    `Authorization: Bearer <api_key>` (checked before the body is read, see `auth`);
    /health, /version and /openapi.json stay open, and /metrics too unless
    `metrics_require_api_key`. `watchdog` decides what
    /health says (default: the default step timeout). `allow_special_tokens_in_chat`
    lets special-token strings in chat messages act as control tokens (see serving_chat).
    `tool_call_parser` (vLLM's names: "hermes", "mistral", ...) reads "auto" tool calls; by
    default it is guessed from the chat template. `reasoning_parser` ("deepseek_r1",
    "qwen3") splits the reasoning from the answer. `dashboard` (a `dashboard.DashboardHub`)
    adds the live page at /dashboard (behind `api_key` when there is one). `cors` (Starlette
    `CORSMiddleware` keywords: allow_origins, ...) answers browsers' cross-origin requests;
    without it there are no CORS headers. `lora_modules` ((name, folder) pairs) are the
    adapters a request's ``model`` may name, for an engine with ``enable_lora``;
    `allow_runtime_lora_updating` (or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING) adds
    /v1/load_lora_adapter and /v1/unload_lora_adapter (see `serving_lora`).
    """
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(
            f"served_model_name must be one or more non-empty names, got {served_model_name!r}"
        )
    served_model_name = names[0]
    owns_client = not isinstance(engine_client, AsyncEngine)
    client = engine_client if isinstance(engine_client, AsyncEngine) else AsyncEngine(engine_client)
    if metrics is None:
        metrics = client.observer if isinstance(client.observer, EngineMetrics) else None
    if metrics is None:
        metrics = EngineMetrics(served_model_name)
    client.observer = metrics
    if dashboard is not None:
        dashboard.attach(client)
        client.observer = StepObservers(metrics, dashboard)

    tokenizer = client.tokenizer
    max_model_len = client.max_model_len
    model_config = client.model_config
    # One tokenizer thread for both endpoints: tokenization never runs on the event loop.
    # The front end's one tokenizer thread serves the endpoints too (chat templates,
    # /tokenize): tokenization never runs on the event loop, and encodes never race.
    tokenizer_pool = client.input_pool
    common: _ServingArgs = {
        "max_model_len": max_model_len,
        "tokenizer": tokenizer,
        "vocab_limit": getattr(model_config, "vocab_size", None),
        "tokenizer_pool": tokenizer_pool,
    }
    completions = CompletionServing(client, names, **common)
    chat = ChatServing(
        client,
        names,
        tool_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
        allow_special_tokens=allow_special_tokens_in_chat,
        **common,
    )
    tokens = TokenizeServing(
        client, names, allow_special_tokens=allow_special_tokens_in_chat, **common
    )
    embeddings = EmbeddingServing(client, names, **common)
    loras = None
    engine_config = client.config
    if engine_config is not None and engine_config.enable_lora:
        loras = LoRARegistry(engine_config.max_lora_rank, names)
        for lora_name, lora_path in lora_modules:
            loras.add(lora_name, lora_path)  # a bad folder stops the start, naming it
        completions.loras = chat.loras = embeddings.loras = loras
    elif lora_modules:
        raise ValueError("lora_modules need an engine with enable_lora (--enable-lora)")
    watchdog = watchdog if watchdog is not None else Watchdog(client)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if owns_client:
            client.shutdown()

    # No redirect_slashes: its 307 Location is built from the Host header (and was sent
    # before the key check); a trailing slash is simply a 404.
    app = FastAPI(
        title="pagemill",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        redirect_slashes=False,
    )
    app.state.engine_client = client
    app.state.metrics = metrics
    app.state.served_model_name = served_model_name
    app.state.dashboard = dashboard
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    if api_key is not None:  # outermost: before the body is read or a route matched
        app.add_middleware(
            APIKeyMiddleware, api_key=api_key, protect_metrics=metrics_require_api_key
        )
    elif metrics_require_api_key:
        raise ValueError("metrics_require_api_key needs an api_key")
    if cors is not None:  # outside the key check: a preflight carries no Authorization
        app.add_middleware(CORSMiddleware, **cors)

    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode(), api_key.encode()
        ):
            raise APIError(
                401,
                "missing or invalid API key (send 'Authorization: Bearer <key>')",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    protected = [Depends(check_api_key)]

    @app.get("/health")
    async def health() -> Response:
        verdict = watchdog.check()
        if not verdict.healthy:
            return error_response(503, verdict.reason or "the engine is unavailable")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    if dashboard is not None:
        from pagemill.server.dashboard.routes import install_dashboard

        install_dashboard(app, dashboard)

    @app.get("/v1/models", dependencies=protected)
    async def models() -> ModelList:
        root = str(getattr(client.config, "model", served_model_name))
        cards = [ModelCard(id=name, root=root, max_model_len=max_model_len) for name in names]
        for adapter in [] if loras is None else loras.adapters():
            cards.append(
                ModelCard(
                    id=adapter.lora_name,
                    root=adapter.lora_path,
                    parent=served_model_name,
                    max_model_len=max_model_len,
                )
            )
        return ModelList(data=cards)

    if loras is not None and runtime_updating_allowed(allow_runtime_lora_updating):
        install_lora_routes(app, loras, protected)

    @app.post("/v1/completions", dependencies=protected)
    async def create_completion(req: CompletionRequest, raw_request: Request) -> Response:
        result = await completions.create(req, raw_request)
        if isinstance(result, AsyncIterator):
            return SSEResponse(result)
        return JSONResponse(result.model_dump())

    @app.post("/v1/chat/completions", dependencies=protected)
    async def create_chat_completion(req: ChatCompletionRequest, raw_request: Request) -> Response:
        result = await chat.create(req, raw_request)
        if isinstance(result, AsyncIterator):
            return SSEResponse(result)
        return JSONResponse(result.model_dump())

    @app.post("/v1/embeddings", dependencies=protected)
    async def create_embedding(req: EmbeddingRequest, raw_request: Request) -> Response:
        return JSONResponse((await embeddings.create(req, raw_request)).model_dump())

    install_responses(app, chat)
    install_anthropic(app, chat)
    install_ollama(app, chat, completions)

    @app.post("/tokenize", dependencies=protected)
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        return await tokens.tokenize(req)

    @app.post("/detokenize", dependencies=protected)
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        return await tokens.detokenize(req)

    return app


class ServerThread:
    """Serves an app with uvicorn on a background thread; `port=0` picks a free port.

    For tests, notebooks and in-process benchmarks: `with ServerThread(app) as url: ...`.
    """

    def __init__(
        self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
    ) -> None:
        self.config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            lifespan="on",
            timeout_graceful_shutdown=5,
        )
        self.server = uvicorn.Server(self.config)
        self._thread = threading.Thread(
            target=self.server.run, name="pagemill-uvicorn", daemon=True
        )
        self.url = ""

    def start(self, timeout: float = 30.0) -> str:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start (port in use? see the log)")
            time.sleep(0.02)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        close_dashboard(self.config.app)
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def close_dashboard(app: Any) -> None:
    """End the dashboard's page streams (they never end by themselves) so a shutdown does
    not wait for open pages."""
    hub = getattr(getattr(app, "state", None), "dashboard", None)
    if hub is not None:
        hub.close()


def run_server(
    app: Any, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"
) -> None:
    """Serve until interrupted (Ctrl-C), in the foreground."""
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
