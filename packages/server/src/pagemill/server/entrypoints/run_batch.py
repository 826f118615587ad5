"""`pagemill run-batch -i in.jsonl -o out.jsonl`: OpenAI's batch file format, as `vllm
run-batch` reads and writes it.

Each input line is `{"custom_id", "method": "POST", "url", "body"}`; each output line is
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`, in the
input's order. The lines go, all at once (the scheduler batches them), through the very
app `pagemill serve` runs, called in this process over ASGI: no port, no HTTP server, and
exactly the server's validation, defaults and error bodies. A line that cannot be read or
that the server refuses fails alone, with its error in its output line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# The endpoints a batch line may name. A URL here that the app does not serve (an endpoint
# this build lacks) fails its lines with a 400 that says so; add a URL by adding it here.
BATCH_URLS: tuple[str, ...] = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")

# Lines in flight at once: enough to keep the scheduler's batch full, few enough that a
# million-line file does not queue a million tokenizations.
DEFAULT_CONCURRENCY = 512


def _error_line(custom_id: Any, status: int, message: str, code: str) -> dict[str, Any]:
    return {
        "id": f"pagemill-{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {
            "status_code": status,
            "request_id": f"pagemill-batch-{uuid.uuid4().hex}",
            "body": None,
        },
        "error": {"code": code, "message": message},
    }


def parse_line(
    line: str, served_urls: Sequence[str]
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the request, None), or (the request as far as it could be read, its error line)."""
    try:
        request = json.loads(line)
    except json.JSONDecodeError as e:
        return {}, _error_line(None, 400, f"not valid JSON: {e}", "invalid_json")
    if not isinstance(request, dict):
        return {}, _error_line(None, 400, "a batch line must be a JSON object", "invalid_request")
    custom_id = request.get("custom_id")
    problems = []
    if not isinstance(custom_id, str):
        problems.append("'custom_id' must be a string")
    if request.get("method", "POST") != "POST":
        problems.append(f"'method' must be POST, got {request.get('method')!r}")
    url = request.get("url")
    body = request.get("body")
    if not isinstance(body, dict):
        problems.append("'body' must be a JSON object")
    elif body.get("stream"):
        problems.append("'body.stream' is not supported in a batch (each line gets one response)")
    if problems:
        return request, _error_line(custom_id, 400, "; ".join(problems), "invalid_request")
    if url not in BATCH_URLS:
        return request, _error_line(
            custom_id,
            400,
            f"url {url!r} is not supported in a batch; supported: {', '.join(BATCH_URLS)}",
            "unsupported_url",
        )
    if url not in served_urls:
        return request, _error_line(
            custom_id, 400, f"url {url!r} is not served by this pagemill", "unsupported_url"
        )
    return request, None


async def run_lines(
    app: Any, lines: Sequence[str], concurrency: int = DEFAULT_CONCURRENCY
) -> list[dict[str, Any]]:
    """One output object per input line (blank lines skipped), in order."""
    import httpx

    served = [getattr(r, "path", "") for r in app.routes]
    gate = asyncio.Semaphore(concurrency)
    # An exception escaping the app is its 500 for that line, not the end of the batch.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)

    async with httpx.AsyncClient(transport=transport, base_url="http://pagemill") as http:

        async def one(line: str) -> dict[str, Any]:
            request, error = parse_line(line, served)
            if error is not None:
                return error
            async with gate:
                try:
                    r = await http.post(request["url"], json=request["body"], timeout=None)
                except Exception as exc:  # the line fails alone
                    logger.exception("run-batch: line %r failed", request["custom_id"])
                    return _error_line(
                        request["custom_id"],
                        500,
                        f"internal error: {type(exc).__name__}",
                        "internal_error",
                    )
            request_id = f"pagemill-batch-{uuid.uuid4().hex}"
            try:
                body: Any = r.json()
            except json.JSONDecodeError:
                body = {"error": {"message": r.text}}
            out: dict[str, Any] = {
                "id": f"pagemill-{uuid.uuid4().hex}",
                "custom_id": request["custom_id"],
                "response": {"status_code": r.status_code, "request_id": request_id, "body": body},
                "error": None,
            }
            if r.status_code >= 400:
                err = body.get("error") if isinstance(body, dict) else None
                if not isinstance(err, dict):
                    err = {}
                out["error"] = {
                    "code": err.get("code") or err.get("type") or str(r.status_code),
                    "message": err.get("message", r.text),
                }
            return out

        return list(await asyncio.gather(*(one(line) for line in lines if line.strip())))


def cmd_run_batch(args: argparse.Namespace) -> int:
    from pagemill.server.cli import _make_engine, check_model, engine_config
    from pagemill.server.vllm_args import apply_hub_options

    config = engine_config(args)
    apply_hub_options(args)
    source = Path(args.input_file).expanduser()
    lines = source.read_text(encoding="utf-8").splitlines()  # a missing file: one line, exit 2
    target = Path(args.output_file).expanduser()
    if not target.parent.is_dir():
        raise FileNotFoundError(f"--output-file {args.output_file}: no folder {target.parent}")
    check_model(config)

    from pagemill.server.async_engine import AsyncEngine
    from pagemill.server.entrypoints.openai.api_server import build_app

    names = args.served_model_name or [config.model]
    client = AsyncEngine(_make_engine(config))
    try:
        app = build_app(client, names)
        results = asyncio.run(run_lines(app, lines, args.max_concurrency))
    finally:
        client.shutdown()
    tmp = target.with_name(target.name + ".partial")
    with tmp.open("w", encoding="utf-8") as f:
        for item in results:
            f.write(json.dumps(item, ensure_ascii=False) + "\n")
    os.replace(tmp, target)
    failed = sum(1 for r in results if r["error"] is not None)
    logger.info("run-batch: %d request(s), %d failed; results in %s", len(results), failed, target)
    return 0


def add_run_batch(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from pagemill.server.cli import add_engine_args
    from pagemill.server.config_args import positive_int
    from pagemill.server.vllm_args import add_config_flag

    p = sub.add_parser(
        "run-batch",
        help="run an OpenAI batch file (JSONL) through the engine, as vllm run-batch",
        description="Read OpenAI batch requests (one JSON object per line: custom_id, "
        "method POST, url /v1/chat/completions or /v1/completions, body) and write one "
        "result line per request, in order, through the same code as `pagemill serve`. "
        "Example: pagemill run-batch -i requests.jsonl -o results.jsonl --model MODEL",
    )
    p.add_argument("-i", "--input-file", required=True, help="the batch file (local path)")
    p.add_argument("-o", "--output-file", required=True, help="where results go (local path)")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="model name(s) the lines' bodies may use (default: the --model value)",
    )
    p.add_argument(
        "--max-concurrency",
        type=positive_int,
        default=DEFAULT_CONCURRENCY,
        metavar="N",
        help=f"lines in flight at once (default {DEFAULT_CONCURRENCY})",
    )
    add_config_flag(p)
    add_engine_args(p, positional_model=False)
    p.set_defaults(func=cmd_run_batch)
    return p
